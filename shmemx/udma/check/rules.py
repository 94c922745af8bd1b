"""The findings of the analysis: for each conflict ``analyze`` meets, which kind it is, what the two sides did, why
they are unordered and what to add (``report`` words them).

``Rules`` is the half of ``analyze.Analyzer`` that makes findings; it reads the replay's state (threads, lanes,
releases, quiets, shadow memory) and never changes clocks. The kind of a read of memory a WQE may still be writing
comes from how the reader learned of the WQE: through a barrier (``barrier-not-completion``), through a signal on
another QP of the target (``signal-other-qp``), on the same QP without being ordered after it
(``unfenced-signal``), after a quiet of another QP (``quiet-wrong-qp``), through any other publication
(``flag-before-payload``); a reader that never learned of the post reads a slot reused under it (``slot-reuse``)
or reads with no synchronisation at all (``unsynchronized-read``).
"""

from __future__ import annotations

import bisect

import operator

from ..events import LANE_A
from .clocks import CAS, FAA, NOTIFY, READ, Lane, Thread, Word, Wqe, apply_op, odr_text, word_value
from .report import Finding, Side, describe_wqe
from .shadow import ReadRec, State, WriteRec

__all__ = ["Rules", "OPS"]

OPS = (operator.eq, operator.ne, operator.gt, operator.ge, operator.lt, operator.le)  # by ACLSHMEM_CMP_*


class Rules:
    """Finding makers of ``analyze.Analyzer`` (see the module docstring)."""

    def _submitter(self, t: Thread, lane: Lane, w: Wqe) -> None:
        last = lane.last_user
        if last is not None and last[0] != t.ti and not t.vc[last[0]] >= last[1]:
            other = self.by_ti[last[0]]
            self.add(Finding(
                "two-submitters", self.wqe_side(w, f"posts {describe_wqe(w)}"),
                self.side(other.pe, other.block, last[2], f"block {other.block} posted to or quieted the same send "
                          f"queue"), lane.peer, lane.qp, (lane.peer, w.dst, max(w.length, 1)), w,
                why=f"blocks {other.block} and {self.by_ti[t.ti].block} use (pe {lane.peer}, qp {lane.qp}) of pe "
                    f"{lane.pe} with nothing ordering them (one submitter per QP, as on the hardware; it raised "
                    f"SubmitterError only if they overlapped in time)",
                fix=f"give each block its own qp (qp_idx = block index), or quiet the queue in block {other.block} "
                    f"and sync_all() before block {self.by_ti[t.ti].block} posts"))
        lane.last_user = (t.ti, t.clock, w.site)

    def on_claim(self, t: Thread, ts, pe, idx, r) -> None:
        """A post that SubmitterError refused (another block still owned the queue): two submitters."""
        a = r[5]
        lane = self.lanes.get((pe, *LANE_A.unpack(a)))
        if lane is None or lane.last_user is None or not lane.wqes:
            return
        w = lane.wqes[-1]
        other = self.by_ti[lane.last_user[0]]
        self.add(Finding(
            "two-submitters", self.side(pe, t.block, r[4], f"posts to pe {lane.peer} qp {lane.qp} (refused: "
                                                           f"SubmitterError)"),
            self.wqe_side(w, lambda: f"posted {describe_wqe(w)} and had not quieted it"), lane.peer, lane.qp,
            (lane.peer, w.dst, max(w.length, 1)), w,
            why=f"blocks {other.block} and {t.block} of pe {pe} post to one send queue (one submitter per QP, as on "
                f"the hardware)",
            fix=f"give each block its own qp (qp_idx = block index), or quiet the queue in block {other.block} and "
                f"sync_all() before block {t.block} posts"))

    def on_unsubmitted(self, t: Thread, ts, pe, idx, r) -> None:
        a, pending = r[5], r[6]
        peer, qp = LANE_A.unpack(a)
        self.add(Finding(
            "unfinished-work", self.side(pe, t.block, r[4], f"deferred {pending} WQE{'s' if pending != 1 else ''} "
                                                           f"(aclshmemx_defer_t) to pe {peer} qp {qp}"),
            None, peer, qp, (peer, None, 0), None,
            why="the defer batch was never submitted: its WQEs were never posted, the kernel ended first",
            fix="end the batch with a call that passes batch=aclshmemx_submit_t(state)"))

    def _unfinished(self, t: Thread, site: int, threads: set, what: str) -> None:
        """WQEs posted by ``threads`` that no quiet of their lane retired (a kernel or the job ended first)."""
        for lane in self.lanes.values():
            left = [w for w in lane.wqes[lane.reaped:] if w.ti in threads and not w.reaped]
            if not left:
                continue
            w = left[-1]
            self.add(Finding(
                "unfinished-work", self.side(t.pe, t.block, site, what),
                self.wqe_side(w, lambda w=w, n=len(left): f"posted {describe_wqe(w)} (the last of {n} WQEs no "
                                                          f"quiet retired)"),
                lane.peer, lane.qp, (lane.peer, w.dst, max(w.length, 1)), w,
                why="no quiet of the QP retired them: nothing tells the poster (or anyone) they completed, and a "
                    "barrier or the end of a kernel does not complete UDMA work",
                fix=f"aclshmemx_udma_qp_quiet({lane.peer}, {lane.qp}) before the kernel returns"))
            for x in left:
                x.reaped = True  # reported once

    def on_src_changed(self, t: Thread, ts, pe, idx, r) -> None:
        a, pos = r[5], r[6]
        lane = self.lanes.get((pe, *LANE_A.unpack(a)))
        if lane is None:
            return
        w = lane.by_pos.get(pos) or next((x for x in reversed(lane.wqes) if x.pos & 0xFFFF_FFFF == pos), None)
        if w is None or w.reported or self.known(t, w):
            return
        w.reported = True
        self.add(Finding(
            "source-overwrite", self.side(pe, t.block, r[4], "quieted"), self.wqe_side(w), w.target, w.qp,
            (pe, w.local if w.local_heap else None, w.length), w,
            why="its source bytes changed between the post and the quiet that retired it (a store the checker "
                "could not see: a local numpy array or a raw view); the engine may read the new bytes",
            fix="leave a put's source alone until the quiet of its QP (aclshmemx_udma_qp_quiet) returns, or "
                "double-buffer it"))

    def _skipped(self, t: Thread, entries: list, j: int, op, target: int, site: int, pe: int, off: int) -> None:
        """A wait that saw a later put_signal than the earliest one that met it, whose payload the later one
        overwrote: if the waiter then reads that payload (``_load``), the earlier one was lost unread (the slot was
        reused before the reader's credit). A payload nobody reads (a signal's dummy) is no finding."""
        got = entries[j].by
        if not isinstance(got, Wqe) or got.opcode != NOTIFY:
            return
        for e in entries[:j]:
            w = e.by
            if (isinstance(w, Wqe) and w.opcode == NOTIFY and w.pe == got.pe and w.target == got.target
                    and e.cur is not None and op(e.cur, target) and t.ti not in e.consumed and not self.known(t, w)
                    and w.dst < got.dst + got.length and got.dst < w.dst + w.length):
                self.skips[t.ti].append((w.target, w.dst, w.dst + w.length, Finding(
                    "slot-reuse", self.side(t.pe, t.block, site, f"waits on {self.alloc_name(pe, off)}, sees a later "
                                                                 f"round's signal, then reads the slot it skipped:"),
                    self.wqe_side(w, lambda w=w: f"posted {describe_wqe(w)}, whose payload was overwritten unread"),
                    w.target, w.qp, (w.target, w.dst, w.length), got,
                    why=f"the earlier put_signal's payload ({self.alloc_name(w.target, w.dst)}) was written again by "
                        f"{describe_wqe(got)} before pe {t.pe} read it: the writer reused the slot without the "
                        f"reader's credit",
                    fix=f"make pe {w.pe} wait for a credit from pe {t.pe} (signal_op after the read, wait_until "
                        f"before the reuse), or use more slots")))
                return

    def _stale(self, t: Thread, word: Word, pe: int, off: int, size: int, cmp: int, target: int, site: int) -> None:
        """A wait met by writes this thread already consumed at a wait for the same condition (and nothing it
        knows of since): it can return on the old value."""
        cur, chain = word.initial, []
        for entry in word.entries:
            if not self.known(t, entry.by):
                continue
            if entry.op == "add" and cur is not None:
                cur = apply_op(cur, "add", entry.value, size)
                chain.append(entry)
            elif entry.op == "add":
                chain.append(entry)
            else:
                cur, chain = (None if entry.value is None else word_value(entry.value, size)), [entry]
        cond = (cmp, target)
        if cur is None or not chain or not OPS[cmp](cur, target) or \
                not all(cond in e.consumed.get(t.ti, ()) for e in chain):
            return
        last = chain[-1]
        writer = (self.wqe_side(last.by, f"posted {describe_wqe(last.by)}") if isinstance(last.by, Wqe)
                  else self.side(last.pe, self.by_ti[last.ti].block, last.site, "wrote it"))
        sym = ("==", "!=", ">", ">=", "<", "<=")[cmp]
        self.add(Finding(
            "stale-flag", self.side(t.pe, t.block, site, f"waits until {self.alloc_name(pe, off)} {sym} {target}"),
            writer, pe, last.by.qp if isinstance(last.by, Wqe) else None, (pe, off, size), last.by
            if isinstance(last.by, Wqe) else None,
            why=f"the value {cur} it already consumed at an earlier wait still meets the condition: this wait can "
                f"return before the new write arrives (nothing resets the word or makes the new value differ)",
            fix="signal a value that differs every round (the iteration or sequence number) and wait for it, or "
                "reset the word before the acknowledgement that lets the writer signal again"))

    def _unsynchronized_get(self, me: Side, p: Wqe, pe: int, off: int, t: Thread) -> None:
        """A write of memory that a get (``p``) whose post the writer never learned of reads: the same finding as
        when the get comes second (``_read_finding``), so the kind does not depend on which ran first."""
        same = p.pe == t.pe
        self.add(Finding(
            "block-race" if same else "unsynchronized-read", me,
            self.wqe_side(p, lambda: f"posted {describe_wqe(p)}, which reads it"), p.target, p.qp, (pe, off, 1), p,
            why=(f"block {self.by_ti[p.ti].block} of pe {p.pe} gets it with nothing ordering the get and this write"
                 if same else f"pe {p.pe}'s get reads it with no wait, quiet or barrier ordering it with this write"),
            fix=("sync_all() between them" if same else
                 "signal after the write (or its quiet) and wait for the signal before the get")))

    def _read_finding(self, t: Thread, rec: WriteRec, pe: int, off: int, me: Side, engine: Wqe | None) -> None:
        """Thread ``t`` (or a WQE it posts, ``engine``) reads memory that ``rec`` may still be writing."""
        by = rec.by
        mem = (pe, off, 1)
        if not isinstance(by, Wqe):
            other = self.by_ti[by[0]]
            same = other.pe == t.pe
            self.add(Finding(
                "block-race" if same else "unsynchronized-read", me,
                self.side(other.pe, other.block, rec.site, "stored to it"), pe, None, mem, engine,
                why=(f"block {other.block} stored it with nothing ordering the two blocks" if same else
                     f"pe {other.pe} stored it directly, and no wait, barrier or signal orders this read after "
                     f"that store"),
                fix=("sync_all() between the store and the read" if same else
                     "signal after the store (aclshmemx_signal_op) and wait for the signal before reading")))
            return
        w = by
        kind, why, fix = self._classify(t, w, me, engine)
        self.add(Finding(kind, me, self.wqe_side(w, f"posted {describe_wqe(w)}, which may still be writing it"),
                         w.target, w.qp, mem, w, engine=engine, why=why, fix=fix))

    def _classify(self, t: Thread, w: Wqe, me: Side, engine: Wqe | None = None) -> tuple[str, str, str]:
        pe_of = w.pe
        qtext = f"aclshmemx_udma_qp_quiet({w.target}, {w.qp})"
        if w.opcode in (READ, FAA, CAS):
            return ("get-before-quiet", f"a get's (or a fetching atomic's) destination is undefined until the quiet "
                                        f"of its QP "
                                        f"(qp {w.qp} of pe {w.target}) returns",
                    f"{qtext} before reading it")
        if t.vc[w.ti] >= w.clock:  # t knows w was posted, not that it completed
            rel = self._publisher(t, w)
            wrong = self._wrong_quiet(w, rel[0] if rel else None)
            where = f" at {self.findings.site_text(self.sites.get((pe_of, rel[5])))}" if rel else ""
            if wrong is not None:
                lane, qsite = wrong
                at = self.findings.site_text(self.sites.get((pe_of, qsite)))
                return ("quiet-wrong-qp",
                        f"pe {pe_of} quieted qp {lane.qp} of pe {lane.peer} at {at}, then published{where}, but the "
                        f"WQE is on qp {w.qp}: a quiet covers its own QP only (aclshmemx_udma_quiet(pe) is QP 0)",
                        f"{qtext} (the WQE's QP) before the signal{where}")
            if rel is None:
                return ("flag-before-payload", f"pe {t.pe} learned of the post from pe {pe_of} before the WQE was "
                                               f"complete",
                        f"{qtext} before publishing anything that lets pe {t.pe} read it")
            what, sig = rel[3], rel[4]
            if what == "barrier":
                return ("barrier-not-completion",
                        f"pe {pe_of} went through a barrier{where} after posting it, and a barrier completes no UDMA "
                        f"work (only a quiet of the QP does)",
                        f"{qtext} before the barrier{where}")
            if sig is not None and sig.lane.peer == w.target and sig.qp != w.qp:
                return ("signal-other-qp",
                        f"the signal went on qp {sig.qp} ({describe_wqe(sig)}{where}), the payload on qp {w.qp}: "
                        f"different QPs are not ordered",
                        f"post the payload and its signal on one QP with a fenced signal, or {qtext} before the "
                        f"signal{where}")
            if sig is not None and sig.lane is w.lane:
                return ("unfenced-signal",
                        f"the signal ({describe_wqe(sig)}{where}) is on the same QP but not ordered after the "
                        f"{odr_text(w.odr)} payload: SO waits only for earlier RO/SO WQEs, and NO/RO for none",
                        f"set fence=1 on the signal's config (e.g. lanes.FENCE_SO, flag 0x2e), or post the payload "
                        f"SO, or {qtext} first")
            via = "aclshmemx_signal_op (a direct store that nothing orders after a WQE)" if what == "signal_op" \
                else ("a store to a flag" if what == "store" else describe_wqe(sig) if sig is not None else what)
            return ("flag-before-payload", f"pe {t.pe} learned of it through pe {pe_of}'s {via}{where}, published "
                                           f"before the WQE completed",
                    f"{qtext} before the signal{where}, or send the flag with the payload "
                    f"(aclshmemx_udma_qp_put_signal_nbi)")
        prev = engine is None and self._prev_known(t, w)  # (a get's read of a reused slot: no credit is read)
        if prev:
            return ("slot-reuse", f"pe {pe_of} wrote the slot again before pe {t.pe} gave it back: the reader "
                                  f"consumed the previous write there, and the new one is not ordered after its read",
                    f"make pe {pe_of} wait for a credit from pe {t.pe} (signal_op after the read, wait_until before "
                    f"the reuse), or use more slots")
        return ("unsynchronized-read", f"no wait, quiet or barrier orders this read after pe {pe_of}'s WQE",
                f"signal the payload (aclshmemx_udma_qp_put_signal_nbi, or {qtext} then a signal) and wait for it "
                f"before reading")

    def _prev_known(self, t: Thread, w: Wqe) -> bool:
        for _start, s in self.shadow[w.target].states_in(w.dst, w.dst + max(w.length, 1)):
            for rec in s.writes:
                prev = rec.prev
                if rec.by is w and prev is not None and self.known(t, prev.by) and \
                        (isinstance(prev.by, Wqe) or prev.pe != t.pe):  # a previous message, not the own init
                    return True
        return False

    def _publisher(self, t: Thread, w: Wqe):
        """The first release by w's PE after w was posted that ``t`` knows of (how ``t`` learned of the post)."""
        ts_list = self.release_ts[w.pe]
        rels = self.releases[w.pe]
        i = bisect.bisect_left(ts_list, w.ts)  # a doorbell's WQEs share its time stamp
        while i < len(rels):
            rel = rels[i]
            if rel[2] > w.clock or rel[1] != w.ti:
                if t.vc[rel[1]] >= rel[2] and rel[4] is not w:
                    return rel
            i += 1
        return None

    def _wrong_quiet(self, w: Wqe, until):
        """A quiet by w's PE, after w and before ``until``, of another QP to w's target (or None)."""
        quiets = self.quiets[w.pe]
        i = bisect.bisect_right(self.quiet_ts[w.pe], w.ts)
        while i < len(quiets) and (until is None or quiets[i][0] < until):
            lane = quiets[i][1]
            if lane.peer == w.target and lane.qp != w.qp:
                return lane, quiets[i][2]
            i += 1
        return None

    def _waw(self, me: Side, rec: WriteRec, pe: int, off: int, w: Wqe | None = None, store: Thread | None = None,
             sync: bool = False) -> None:
        by = rec.by
        other = (self.wqe_side(by, f"posted {describe_wqe(by)}") if isinstance(by, Wqe)
                 else self.side(rec.pe, self.by_ti[by[0]].block, rec.site, "stored to it"))
        if isinstance(by, Wqe) and by.opcode in (READ, FAA, CAS) and store is not None:
            self.add(Finding("get-before-quiet", me, other, by.target, by.qp, (pe, off, 1), by,
                             why="the get may still land in its destination and overwrite this store",
                             fix=f"aclshmemx_udma_qp_quiet({by.target}, {by.qp}) before touching the destination"))
            return
        if store is not None and not isinstance(by, Wqe) and self.by_ti[by[0]].pe == store.pe:
            self.add(Finding("block-race", me, other, pe, None, (pe, off, 1), None,
                             why=f"two blocks of pe {store.pe} write it with nothing ordering them",
                             fix="sync_all() between them"))
            return
        wq = w if w is not None else (by if isinstance(by, Wqe) else None)
        self.add(Finding(
            "unordered-writes", me, other, pe, wq.qp if wq is not None else None, (pe, off, 1), wq,
            why=("two writes of one synchronisation word whose order matters, with nothing ordering them (e.g. a "
                 "reset racing the next signal)" if sync else
                 "two writes of one range with nothing ordering them: which one lands last depends on timing"),
            fix=("reset the word before the acknowledgement that lets the other side signal again" if sync else
                 "give each writer its own range (offset by rank * slot bytes), or order them (quiet, then signal "
                 "and wait)")))

    def _war(self, me: Side, rd: ReadRec, pe: int, off: int, w: Wqe | None, s: State,
             store: Thread | None = None) -> None:
        reader = self.by_ti[rd.ti]
        other = self.side(reader.pe, reader.block, rd.site, "read it")
        if store is not None:
            same = reader.pe == store.pe
            self.add(Finding("block-race" if same else "unsynchronized-read", me, other, pe, None, (pe, off, 1), None,
                             why=(f"block {reader.block} read it with nothing ordering its read before this store"
                                  if same else f"pe {reader.pe} read it with nothing ordering its read before this "
                                               f"store"),
                             fix="sync_all() between them" if same else "order them with a signal and a wait"))
            return
        if not any(isinstance(rec.by, Wqe) or rec.pe != reader.pe for rec in s.writes):
            # nothing from elsewhere was there to consume: the read is not of a previous message in a reused slot
            # but of memory this WQE is the first to write, and it is unordered with it. The read may as well
            # come after the post (then the read-after-write path reports it): same kind either way.
            kind = "unsynchronized-read"
            why = (f"pe {reader.pe} read it with no wait, quiet or barrier ordering the read after pe {w.pe}'s WQE, "
                   f"which may land before or after the read")
            fix = (f"signal the payload (aclshmemx_udma_qp_put_signal_nbi, or aclshmemx_udma_qp_quiet({w.target}, "
                   f"{w.qp}) then a signal) and wait for it before reading")
        else:
            kind = "slot-reuse"
            why = (f"pe {reader.pe}'s read of the slot is not ordered before this post: the new data may land while "
                   f"it still reads")
            fix = (f"wait for a credit from pe {reader.pe} (its signal_op after the read) before reusing the slot, "
                   f"or use more slots")
        self.add(Finding(kind, me, other, w.target, w.qp, (pe, off, 1), w, why=why, fix=fix))

    def _overwrite(self, me: Side, p: Wqe, pe: int, off: int, w: Wqe | None, t: Thread | None = None) -> None:
        if p.opcode == READ and t is not None and not t.vc[p.ti] >= p.clock:
            self._unsynchronized_get(me, p, pe, off, t)
            return
        what = "the source of a get by" if p.opcode == READ else "the source of"
        p.reported = True  # the store was seen: the checksum at the quiet need not report it again
        self.add(Finding(
            "source-overwrite", me, self.wqe_side(p, f"posted {describe_wqe(p)}, which still reads it"), p.target, p.qp,
            (pe, off, 1), p,
            why=f"it is {what} a WQE not known complete here: the engine may read it after this write",
            fix=f"aclshmemx_udma_qp_quiet({p.target}, {p.qp}) on pe {p.pe} before rewriting it, or double-buffer"))

    # --- atomics: an access with a width (issue 24) ----------------------------------------------------------------

    def _rec_side(self, rec: WriteRec, what: str) -> Side:
        by = rec.by
        if isinstance(by, Wqe):
            return self.wqe_side(by, lambda: f"posted {describe_wqe(by)}")
        return self.side(rec.pe, self.by_ti[by[0]].block, rec.site, what)

    def _atomic_finding(self, kind: str, me: Side, other: Side, w: Wqe | None, pe: int, off: int) -> None:
        if kind == "mixed-width-atomics":
            why = ("two atomics over common bytes with another width or first byte, with nothing ordering them: the "
                   "engine makes its atomics atomic with each other only per word of one width (a 32-bit add on half "
                   "of a 64-bit word is not)")
            fix = "use one width for every atomic on the word, or order them (the quiet of the first, then a signal)"
        else:
            why = ("an atomic of the engine and a plain access (a load, a store, a get, a put) of the same bytes with "
                   "nothing ordering them: atomics are atomic only with other atomics of their width")
            fix = ("make the other access an atomic of the same width (aclshmemx_udma_atomic_fetch / _set, or "
                   "aclshmem_wait_until to poll), or order the two (the quiet of the atomic's QP, then a signal the "
                   "other side waits for)")
        self.add(Finding(kind, me, other, w.target if w is not None else None, w.qp if w is not None else None,
                         (pe, off, 1), w, why=why, fix=fix))

    def _atomic_race(self, me: Side, old: WriteRec, new: WriteRec | None, pe: int, off: int) -> None:
        """``me`` (doing ``new``, or a plain load when None) and the earlier write ``old``: one atomic, one not."""
        atomic = old if old.width else new
        w = atomic.by if atomic is not None and isinstance(atomic.by, Wqe) else None
        self._atomic_finding("atomic-race", me, self._rec_side(old, "stored to it"), w, pe, off)

    def _atomic_race_read(self, me: Side, rd: ReadRec, rec: WriteRec, pe: int, off: int) -> None:
        reader = self.by_ti[rd.ti]
        other = self.side(reader.pe, reader.block, rd.site, "read it with a plain load")
        self._atomic_finding("atomic-race", me, other, rec.by if isinstance(rec.by, Wqe) else None, pe, off)

    def _mixed_width(self, me: Side, old: WriteRec, new, pe: int, off: int) -> None:
        w = old.by if isinstance(old.by, Wqe) else None
        self._atomic_finding("mixed-width-atomics", me, self._rec_side(old, "wrote it"), w, pe, off)

    def _atomic_read(self, me: Side, rec: WriteRec, w: Wqe, pe: int, off: int) -> None:
        """A get ``w`` of a word that ``rec`` writes, unordered. The READ of an atomic's CAS loop finds nothing
        itself: the CAS it is followed by conflicts with whatever the READ would have (one finding, the same
        whichever of the two accesses this run logged first)."""
        if rec.width and not w.atomic and not rec.reads_only:
            self._atomic_race(me, rec, None, pe, off)

    def _pin_conflict(self, me: Side, p: Wqe, rec: WriteRec, pe: int, off: int) -> None:
        """A write ``rec`` of a word that the READ or put ``p`` (not known complete) reads."""
        other = self.wqe_side(p, lambda: f"posted {describe_wqe(p)}, which reads it")
        if p.atomic_read:
            return  # (see _atomic_read: its CAS carries the conflict)
        if rec.width:
            if not rec.reads_only:
                self._atomic_finding("atomic-race", me, other, p, pe, off)
        else:
            self._overwrite(me, p, pe, off, rec.by if isinstance(rec.by, Wqe) else None)
