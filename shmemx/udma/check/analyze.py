"""The analysis of ``--check``: replay every PE's log in time-stamp order and decide each finding from
happens-before, never from when the engine ran a WQE.

Clocks. Every kernel thread (PE, AIV block; the main thread shares block 0's) has a vector clock over the threads
and over the job's *lanes*, the (PE, peer, QP) send queues. A thread entry counts that thread's events; a lane
entry is the number of the lane's WQEs, in posting order, known complete (a quiet of that lane retires a prefix).
WQEs known complete beyond that prefix (a put_signal's own payload, what an SO WQE waited for) are kept as a set
per lane beside the clock. Edges:

* program order, and a launch to its blocks, a block to the launch's end, ``sync_all`` among the blocks of a PE;
* a barrier: every arrival joins the barrier's clock, every departure takes it (threads only: a barrier
  completes no WQE, as in CANN SHMEM);
* a quiet of (peer, qp) that returned: the lane's WQEs posted before its last CQE-producing WQE are complete;
* a wait (or a test that held, or a plain load of a synchronisation word) takes the clock of the write whose
  value met it: a ``signal_op`` or a store (the writer's clock then), a put_signal's signal or an atomic (the
  poster's clock at post, plus the WQE itself and whatever it was ordered after on its QP: a fence orders every
  earlier WQE of the QP, SO every earlier RO/SO one, NO and RO nothing; ``lanes.FENCE_SO`` is what the MoE
  kernels use for that reason).

Memory (``shadow``). Each heap interval keeps the writes that may be visible there, the reads since, and the WQEs
that will still read it. A kernel read of a range a WQE writes is a finding unless the reader knows the WQE
complete; a write over memory a WQE will read (its source, a remote get's source) unless the writer knows that
WQE complete; a WQE posted over a range that a thread read or wrote, or another WQE writes, unless its poster
knew of that access (or, for two WQEs of one QP, the QP orders them). Synchronisation words (waited on,
signalled, or an atomic's target, anywhere in the job) do not race with one another unless the order matters
(a store against a different store or an add); a plain load of one is an acquire (a plain-load poll loop gets a
warning instead of a race). A wait whose condition the writes it already consumed still meet is a stale flag.
Which kind a finding is, and what to add, comes from the events between the two sides (``rules``); the clocks and
the WQEs' orderings are ``clocks``, the memory ``shadow``.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from typing import NamedTuple

import numpy as np

from ...shm.control import WaitCall
from ..layout import REDUCE_FLAG, Odr
from ..rings import Api
from .clocks import (CAS, FAA, NOTIFY, READ, WRITE, Entry, Lane, Rel, Thread, Word, Wqe, apply_op, compact, order_matters,
                     same_bytes, word_value)
from ..events import LANE_A, LOCAL_HEAP, MET_WORD, POST_A, POST_FLAGS, QUIET_A, SIGNAL_A, WAIT_A, Access, Kind, Log
from .report import Finding, Findings, Side, describe_wqe
from .rules import OPS, Rules
from .shadow import ReadRec, Shadow, State, WriteRec

__all__ = ["Analyzer", "analyze"]

_M32 = 0xFFFF_FFFF
_U64 = (1 << 64) - 1
_HISTORY = 256  # writes remembered per synchronisation word
_FINALIZE = int(WaitCall.FINALIZE)
_ATOMIC_API = int(Api.ATOMIC)
LOCAL = 1 << 20  # shadow key of a PE's registered local arrays (by process address): pe | LOCAL


class SyncWrite(NamedTuple):
    """A write of a synchronisation word, as the analysis checks and records it.

    ``by``: the Wqe that writes it, or (thread index, clock) of a kernel thread's signal_op or store. ``kind`` of
    its shadow record: "signal" (a WQE's signal or atomic), "signal_op", "store", "wqe" (a payload over the word);
    None: "signal" for a WQE's, "signal_op" for a thread's.
    """

    pe: int
    off: int
    size: int
    op: str  # "set", "add" or "cas"
    value: int | None
    by: object
    rel: Rel
    site: int
    kind: str | None = None


def _mixed(a: WriteRec, b: WriteRec) -> bool:
    """Two atomics over common bytes that the hardware does not make atomic with each other: another width or
    another first byte (a 32-bit add on half of a 64-bit word)."""
    return bool(a.width and b.width) and (a.at, a.width) != (b.at, b.width)


def _atomic_vs_plain(a: WriteRec, b: WriteRec) -> bool:
    """An atomic of the engine and a plain write of the same bytes (a store, a payload; a signal_op is the
    signalling store the atomics are atomic with), neither an atomic that changes nothing."""
    if bool(a.width) == bool(b.width) or a.reads_only or b.reads_only:
        return False
    return "signal_op" not in (a.kind, b.kind)


class Analyzer(Rules):
    """One replay of a job's logs (``analyze`` runs it)."""

    def __init__(self, logs: list[Log], heap_size: int):
        self.logs = {log.pe: log for log in logs}
        self.n_pes = max(self.logs) + 1 if self.logs else 0
        self.heap_size = heap_size
        self.findings = Findings()
        self.sites = {(pe, sid): site for pe, log in self.logs.items() for sid, site in log.sites.items()}
        self.allocs: dict[int, dict] = defaultdict(dict)  # pe -> offset -> (size, name)
        self.alloc_starts: dict[int, list] = defaultdict(list)
        self.words: dict[tuple[int, int], Word] = {}
        self.word_offsets: dict[int, list] = defaultdict(list)  # pe -> sorted offsets of its words
        self.shadow = {pe: Shadow(heap_size) for pe in range(self.n_pes)}
        self.shadow.update({pe | LOCAL: Shadow(1 << 64) for pe in range(self.n_pes)})  # registered local arrays
        self.regs: dict[int, tuple[list, list]] = {}  # pe -> (sorted local VAs, [(va, address, bytes)])
        self.barriers: dict[int, Rel] = {}
        self.launches: dict[tuple[int, int], Rel] = {}
        self.launch_end: dict[tuple[int, int], list] = defaultdict(list)
        self.syncs: dict[tuple, list] = defaultdict(list)
        self.releases: dict[int, list] = defaultdict(list)  # pe -> [(ts, ti, clock, what, wqe or None, site)]
        self.release_ts: dict[int, list] = defaultdict(list)
        self.quiets: dict[int, list] = defaultdict(list)  # pe -> [(ts, lane)] of its quiets
        self.quiet_ts: dict[int, list] = defaultdict(list)
        self.warned: set = set()
        self.skips: dict[int, list] = defaultdict(list)  # thread -> [(pe, lo, hi, finding)] of skipped payloads
        self._prepass()

    # --- set-up ---------------------------------------------------------------------------------------------

    def _prepass(self) -> None:
        threads, lanes, sync = set(), set(), defaultdict(set)
        self.events = []
        self.met: dict[tuple[int, int], list] = {}
        self.polls: set = set()
        for pe, log in self.logs.items():
            rows = log.records.tolist()
            last: dict[int, tuple] = {}
            last_idx: dict[int, tuple] = {}
            wait_at: dict[int, tuple] = {}  # block -> its WAIT whose MET records may follow
            for idx, r in enumerate(rows):
                ts, kind, block, flags, site, a, b, c, d, e, f, g = r
                if kind == Kind.SITE:
                    continue
                if kind == Kind.REGISTER:
                    self._register(pe, a, b, c, log.string(d, e))
                    continue
                threads.add((pe, block))
                if kind == Kind.MET:  # the MET records of a wait follow its WAIT record in its own thread; other
                    # threads of the PE share the log and may have written records in between
                    at = wait_at.get(block)
                    if at is not None:
                        words = [i for w in (a, b, c, d, e) for i in MET_WORD.unpack(w)][:f]
                        self.met.setdefault(at, []).extend(words)
                    continue
                if kind == Kind.WAIT:
                    wait_at[block] = (pe, idx)
                else:
                    wait_at.pop(block, None)
                if kind == Kind.POST:
                    _, peer, qp, op = POST_A.unpack(a)
                    lanes.add((pe, peer, qp))
                    if op == NOTIFY:
                        sync[peer].add((d, 8))
                    elif op in (FAA, CAS) or op == WRITE and flags & REDUCE_FLAG:
                        sync[peer].add((b, f))
                elif kind == Kind.QUIET:
                    lanes.add((pe, *QUIET_A.unpack(a)[:2]))
                elif kind == Kind.SIGNAL:
                    tpe, _, size = SIGNAL_A.unpack(a)
                    sync[tpe].add((b, size))
                elif kind == Kind.WAIT:
                    wpe, _, size, _ = WAIT_A.unpack(a)
                    for k in range(min(d, 1 << 16)):
                        sync[wpe].add((b + k * c, size))
                access = Access.unpack(a) if kind == Kind.ACCESS else None
                if access is not None and not access.write and not access.approx:
                    key = (site, access.pe, b, c)
                    if last.get(block) == key:
                        self.polls.add((pe, idx))
                        self.polls.add(last_idx[block])
                        sync[access.pe].add((b, min(c, 8)))
                    last[block] = key
                    last_idx[block] = (pe, idx)
                else:
                    last.pop(block, None)
                self.events.append((ts, pe, idx, r))
        self.events.sort(key=lambda x: (x[0], x[1], x[2]))
        self._index(threads, lanes, sync)

    def _index(self, threads: set, lanes: set, sync: dict) -> None:
        """The clocks' entries (threads, then lanes) and the synchronisation words the prepass found."""
        self.thread_index = {key: i for i, key in enumerate(sorted(threads))}
        nt = len(self.thread_index)
        self.lane_index = {key: nt + i for i, key in enumerate(sorted(lanes))}
        size = nt + len(self.lane_index)
        self.nt = nt
        self.threads = {key: Thread(i, key[0], key[1], size) for key, i in self.thread_index.items()}
        self.by_ti = {t.ti: t for t in self.threads.values()}
        self.lanes = {key: Lane(li, *key) for key, li in self.lane_index.items()}
        self.by_li = {lane.li: lane for lane in self.lanes.values()}
        for pe, words in sync.items():
            if pe in self.shadow:
                for off, size in words:
                    self.shadow[pe].mark_sync(off, off + max(size, 1))
                    self.words.setdefault((pe, off), Word(size, None))
                self.word_offsets[pe] = sorted(off for (wpe, off) in self.words if wpe == pe)

    def _register(self, pe: int, va: int, address: int, nbytes: int, name: str) -> None:
        """A REGISTER record: local VAs [va, va + nbytes) of ``pe`` are the array at ``address`` named ``name``."""
        vas, regs = self.regs.setdefault(pe, ([], []))
        i = bisect.bisect_left(vas, va)
        vas.insert(i, va)
        regs.insert(i, (va, address, nbytes))
        key = pe | LOCAL
        if address not in self.allocs[key]:
            bisect.insort(self.alloc_starts[key], address)
        self.allocs[key][address] = (nbytes, name)

    # --- helpers --------------------------------------------------------------------------------------------

    def known(self, t: Thread, by) -> bool:
        """Whether thread ``t`` knows ``by`` happened: a Wqe complete, or a thread's event (thread index, clock)."""
        if type(by) is tuple:
            return t.vc[by[0]] >= by[1]
        lane = by.lane.li
        if t.vc[lane] >= by.seq:
            return True
        s = t.extras.get(lane)
        return s is not None and by.seq in s

    def join(self, t: Thread, rel: Rel) -> None:
        np.maximum(t.vc, rel.vc, out=t.vc)
        for li, seqs in rel.extras.items():
            mine = t.extras.get(li)
            prefix, rest = compact(int(t.vc[li]), (mine | seqs) if mine else seqs)
            t.vc[li] = prefix
            t.extras[li] = set(rest)

    def alloc_name(self, pe: int, off: int) -> str:
        starts = self.alloc_starts[pe]
        i = bisect.bisect_right(starts, off) - 1
        if i >= 0:
            start = starts[i]
            size, name = self.allocs[pe][start]
            if off < start + max(size, 1):
                return f"{'local array ' if pe & LOCAL else ''}'{name}'+{off - start:#x}"
        return f"local array at {off:#x}" if pe & LOCAL else f"heap+{off:#x}"

    def side(self, pe: int, block: int, site: int, what: str) -> Side:
        return Side(pe, block, self.sites.get((pe, site)), what)

    def wqe_side(self, w: Wqe, what=None) -> Side:
        """The side of a WQE's poster; ``what`` may be a function making the text (built only for a finding)."""
        return self.side(w.pe, self.by_ti[w.ti].block, w.site, what or (lambda: describe_wqe(w)))

    def _release(self, t: Thread, ts: int, what: str, wqe=None, site: int = 0) -> None:
        self.releases[t.pe].append((ts, t.ti, t.clock, what, wqe, site))
        self.release_ts[t.pe].append(ts)

    def add(self, finding: Finding) -> None:
        pe, off = finding.mem[0], finding.mem[1]
        finding.memory = self.alloc_name(pe, off) if off is not None else "a local (non-heap) array"
        if pe & LOCAL:  # a registered local array: named by its variable, no heap offset
            finding.mem = (pe & (LOCAL - 1), None, finding.mem[2])
        self.findings.add(finding)

    # --- the replay -----------------------------------------------------------------------------------------

    def run(self) -> Findings:
        handlers = {Kind.ALLOC: self.on_alloc, Kind.FREE: self.on_free, Kind.POST: self.on_post,
                    Kind.CLAIM: self.on_claim, Kind.UNSUBMITTED: self.on_unsubmitted,
                    Kind.QUIET: self.on_quiet, Kind.SIGNAL: self.on_signal, Kind.WAIT: self.on_wait,
                    Kind.ARRIVE: self.on_arrive, Kind.DEPART: self.on_depart, Kind.LAUNCH: self.on_launch,
                    Kind.JOIN: self.on_join, Kind.BLOCK_BEGIN: self.on_block_begin, Kind.BLOCK_END: self.on_block_end,
                    Kind.SYNC_ARRIVE: self.on_sync_arrive, Kind.SYNC_DEPART: self.on_sync_depart,
                    Kind.ACCESS: self.on_access, Kind.SRC_CHANGED: self.on_src_changed,
                    Kind.LOCAL_ACCESS: self.on_local_access, Kind.FETCH: self.on_fetch}
        for ts, pe, idx, r in self.events:
            handler = handlers.get(r[1])
            if handler is not None:
                t = self.threads[(pe, r[2])]
                t.tick()
                handler(t, ts, pe, idx, r)
        return self.findings

    # --- allocations ----------------------------------------------------------------------------------------

    def on_alloc(self, t, ts, pe, idx, r) -> None:
        off, size = r[5], r[6]
        name = self.logs[pe].string(r[7], r[8])
        if off not in self.allocs[pe]:
            bisect.insort(self.alloc_starts[pe], off)
        self.allocs[pe][off] = (size, name)
        self.shadow[pe].reset(off, off + size)
        for _woff, word in self._words_in(pe, off, off + size):
            word.entries.clear()
            word.initial = 0 if r[3] & 1 else None

    def on_free(self, t, ts, pe, idx, r) -> None:
        off, size = r[5], r[6]
        self.shadow[pe].reset(off, off + size)
        if off in self.allocs[pe]:
            del self.allocs[pe][off]
            self.alloc_starts[pe].remove(off)

    # --- posts and quiets -----------------------------------------------------------------------------------

    def on_post(self, t: Thread, ts, pe, idx, r) -> None:
        _, _, block, flags, site, a, b, c, d, e, f, g = r
        pos, peer, qp, opcode = POST_A.unpack(a)
        lane = self.lanes[(pe, peer, qp)]
        w = Wqe()
        w.lane, w.ti, w.clock, w.ts, w.site, w.pe = lane, t.ti, t.clock, ts, site, pe
        w.opcode, w.flag, w.api = opcode, POST_FLAGS.field(flags, "flag"), POST_FLAGS.field(flags, "api")
        w.pos = lane.unwrap(pos)
        w.end = w.pos + (2 if opcode in (NOTIFY, FAA, CAS) else 1)
        w.target, w.dst, w.length = peer, b, f
        w.local_heap, w.local = bool(flags & LOCAL_HEAP), c
        w.laddr = None if w.local_heap else self._local_address(pe, c, f)
        w.sig_off, w.value = d, e
        w.crc = g if opcode in (WRITE, NOTIFY) and (flags & LOCAL_HEAP or c) else None
        w.reaped = w.reported = False
        w.cqe = bool(w.flag >> 5 & 1)
        reduce = opcode == WRITE and bool(w.flag & REDUCE_FLAG)
        w.atomic = f if opcode in (FAA, CAS) or reduce or (opcode == READ and w.api == _ATOMIC_API) else 0
        lane.wqes.append(w)
        w.seq = len(lane.wqes)
        lane.by_pos[w.pos] = w
        self._order(lane, w)
        self._submitter(t, lane, w)
        w.rel = self._wqe_rel(t, w) if opcode in (NOTIFY, FAA, CAS) or reduce else None
        self._local_side(t, w)
        if peer not in self.shadow or w.dst + w.length > self.heap_size and opcode != NOTIFY:
            return
        if opcode == READ:
            self._engine_read(t, w, peer, w.dst, w.length)
            return
        if opcode in (WRITE, NOTIFY) and w.length and not reduce:
            self._engine_write(t, w, peer, w.dst, w.length, "wqe")
        if opcode == NOTIFY:
            self._sync_write(t, ts, SyncWrite(peer, w.sig_off, 8, "set", w.value, w, w.rel, site))
            self._release(t, ts, "signal", w, site)
        elif opcode in (FAA, CAS) or reduce:
            self._sync_write(t, ts, SyncWrite(peer, w.dst, w.length, "cas" if opcode == CAS else "add",
                                              None if opcode == CAS or reduce else w.value, w, w.rel, site))
            self._release(t, ts, "atomic", w, site)

    def _local_side(self, t: Thread, w: Wqe) -> None:
        """The WQE's access to its own PE's memory: a put's source (read when it executes), a get's destination
        or a fetching atomic's (written): this PE's heap, or a registered local array (its own shadow)."""
        if w.local_heap:
            key, off = w.pe, w.local
        elif w.laddr is not None:
            key, off = w.pe | LOCAL, w.laddr
        else:
            return  # the atomics' scratch, or memory the log does not describe
        if not w.length or (w.opcode == WRITE and w.flag & REDUCE_FLAG):
            return
        if w.opcode in (WRITE, NOTIFY):
            self._engine_read(t, w, key, off, w.length)
        elif w.opcode == READ and not w.atomic:
            self._engine_write(t, w, key, off, w.length, "get")
        elif w.opcode in (FAA, CAS):
            self._engine_write(t, w, key, off, w.length, "get")

    def _local_address(self, pe: int, va: int, length: int):
        """The process address of local VA ``va`` (a registered array of ``pe``), or None."""
        regs = self.regs.get(pe)
        if not regs or not va:
            return None
        i = bisect.bisect_right(regs[0], va) - 1
        if i < 0:
            return None
        rva, addr, nbytes = regs[1][i]
        return addr + (va - rva) if va + length <= rva + max(nbytes, 1) else None

    def _order(self, lane: Lane, w: Wqe) -> None:
        """What ``w``'s completion implies on its QP (``w.prefix``, ``w.extra``), and the lane's SO state."""
        prefix, extra = lane.ordered
        if w.fence:
            w.prefix, w.extra = w.seq, frozenset()
        elif w.odr == Odr.SO:
            w.prefix, w.extra = compact(prefix, extra | {w.seq})
        else:
            w.prefix, w.extra = 0, frozenset({w.seq})
        if w.odr in (Odr.SO, Odr.RO):
            if w.fence:
                lane.ordered = (w.seq, frozenset())
            else:
                lane.ordered = compact(prefix, extra | {w.seq})

    def on_quiet(self, t: Thread, ts, pe, idx, r) -> None:
        """The quiet's thread knows every WQE of the lane that ends at or before the SQ tail complete."""
        a, tail_raw = r[5], r[6]
        lane = self.lanes[(pe, *QUIET_A.unpack(a)[:2])]
        tail = lane.unwrap(tail_raw) if lane.wqes else tail_raw
        wqes = lane.wqes
        k = lane.reaped
        while k < len(wqes) and wqes[k].end <= tail:
            wqes[k].reaped = True
            k += 1
        lane.reaped = k
        li = lane.li
        if k > t.vc[li]:
            t.vc[li] = k
            s = t.extras.get(li)
            if s:
                t.extras[li] = {x for x in s if x > k}
        self.quiets[pe].append((ts, lane, r[4]))
        self.quiet_ts[pe].append(ts)
        lane.last_user = (t.ti, t.clock, r[4])

    # --- the engine's accesses, decided at post ----------------------------------------------------------

    def _engine_read(self, t: Thread, w: Wqe, pe: int, off: int, n: int) -> None:
        """A WQE will read ``[off, off+n)`` of PE ``pe`` when it executes: what it reads must be complete for
        its poster now, and nobody may write it until the WQE is known complete (a pin)."""
        reader = self.wqe_side(w, lambda: f"posts {describe_wqe(w)}, which reads")

        def fn(s: State, start: int) -> State:
            for rec in s.writes:
                if self._knows_write(t, rec):
                    continue
                if s.sync:
                    self._atomic_read(reader, rec, w, pe, start)
                else:
                    self._read_finding(t, rec, pe, start, reader, w)
                    w.reported = True  # its source conflicts already: the checksum at the quiet need not say so
            return s.replace(pins=self._pins_after(t, s.pins, w) + (w,))

        self.shadow[pe].update(off, off + n, fn)

    def _pins_after(self, t: Thread, pins: tuple, w: Wqe | None) -> tuple:
        """The pins that stay after an access by ``t`` (or its WQE ``w``): those ``t`` does not know complete.
        A pin ``t`` knows complete is implied by whatever comes next: knowing the next access means knowing ``t``'s
        clock (a quiet of the lane covers every earlier WQE). Decided by happens-before alone, never by whether the
        WQE happened to be retired already in this run."""
        if not pins:
            return pins
        return tuple(p for p in pins if not (self.known(t, p) or (w is not None and self._ordered(p, w))))

    def _engine_write(self, t: Thread, w: Wqe, pe: int, off: int, n: int, kind: str) -> None:
        """A WQE will write ``[off, off+n)`` of PE ``pe``: its poster must know of every earlier access there.
        What it does not know of stays recorded (and is found again by a later access), so the findings do not
        depend on which of two unordered accesses this run logged first."""
        writer = self.wqe_side(w, lambda: f"posts {describe_wqe(w)}, which writes")

        sync_hit = []

        def fn(s: State, start: int) -> State:
            if s.sync:  # a flag written by a payload: checked and recorded as a signal below
                sync_hit.append(start)
                return s
            prev = None
            unordered = []
            for rec in s.writes:
                if self._knows_write(t, rec) or (isinstance(rec.by, Wqe) and (self._ordered(rec.by, w)
                                                                               or same_bytes(rec.by, w))):
                    prev = prev or rec
                    continue
                self._waw(writer, rec, pe, start, w=w)
                unordered.append(rec)
                prev = prev or rec
            reads = tuple(rd for rd in s.reads if not t.vc[rd.ti] >= rd.clock)
            for rd in reads:
                self._war(writer, rd, pe, start, w, s)
            for p in s.pins:
                if p is not w and not self.known(t, p) and not self._ordered(p, w):
                    self._overwrite(writer, p, pe, start, w, t)
            rec = WriteRec(w, kind, w.site, w.pe, prev=prev)
            return s.replace(writes=tuple(unordered) + (rec,), reads=reads, pins=self._pins_after(t, s.pins, w))

        self.shadow[pe].update(off, off + n, fn)
        if sync_hit:
            rel = w.rel or self._wqe_rel(t, w)
            value = w.value if kind == "wqe" and w.opcode == WRITE and n <= 8 else None
            for woff, word in self._words_in(pe, off, off + n):
                v = None if value is None else value >> 8 * (woff - off) & ((1 << 8 * word.size) - 1)
                self._sync_write(t, w.ts, SyncWrite(pe, woff, word.size, "set", v, w, rel, w.site, "wqe"), writer)
            self._release(t, w.ts, "signal", w, w.site)

    def _wqe_rel(self, t: Thread, w: Wqe) -> Rel:
        """What the WQE's completion releases: its poster's clock at post, itself, and what its QP orders first."""
        rel = t.release()
        li = w.lane.li
        rel.vc[li] = max(rel.vc[li], w.prefix)
        if w.extra:
            rel.extras[li] = frozenset(rel.extras.get(li, frozenset()) | w.extra)
        return rel

    def _ordered(self, first: Wqe, then: Wqe) -> bool:
        """Whether ``then`` cannot execute before ``first`` completes (one QP: fence, or SO after RO/SO)."""
        if first.lane is not then.lane or first.seq >= then.seq:
            return False
        return first.seq <= then.prefix or first.seq in then.extra

    def _knows_write(self, t: Thread, rec: WriteRec) -> bool:
        return self.known(t, rec.by)

    # --- signals, stores and waits on synchronisation words --------------------------------------------------

    def _sync_write(self, t: Thread, ts: int, sw: SyncWrite, side: Side | None = None) -> None:
        """A write of a synchronisation word (signal_op, a put_signal's signal, an atomic, a store, a payload):
        checked against the unordered writes whose order matters, then recorded for the waits."""
        if sw.pe not in self.shadow:
            return
        kind = sw.kind or ("signal" if isinstance(sw.by, Wqe) else "signal_op")
        width = sw.size if kind == "signal" else 0  # the engine's atomics (FAA, CAS, fp32 add, a put_signal's signal)
        rec = WriteRec(sw.by, kind, sw.site, t.pe, sw.op, sw.value, rel=sw.rel, width=width, at=sw.off if width else -1)
        me = side or (self.wqe_side(sw.by, lambda: f"posts {describe_wqe(sw.by)}") if isinstance(sw.by, Wqe)
                      else self.side(t.pe, t.block, sw.site, "signals"))
        wqe = sw.by if isinstance(sw.by, Wqe) else None
        self.shadow[sw.pe].update(sw.off, sw.off + sw.size,
                                  lambda s, start: self._sync_state(t, me, rec, wqe, sw.pe, s, start))
        self._sync_history(t, ts, sw)

    def _sync_state(self, t: Thread, me: Side, rec: WriteRec, wqe: Wqe | None, pe: int, s: State,
                    start: int) -> State:
        """The shadow interval after the synchronisation write ``rec`` (by ``wqe`` if a WQE's): the unordered
        writes it conflicts with reported, the adds whose order does not matter kept, and it appended."""
        keep = []
        for old in s.writes:
            if (wqe is not None and isinstance(old.by, Wqe) and self._ordered(old.by, wqe)) or self.known(t, old.by):
                continue  # ordered before this write, or known to its writer
            if _mixed(old, rec):
                self._mixed_width(me, old, rec, pe, start)
            elif order_matters(old, rec.op, rec.value):
                self._waw(me, old, pe, start, w=wqe, sync=True)
            elif _atomic_vs_plain(old, rec):
                self._atomic_race(me, old, rec, pe, start)
            elif old.op == "add" or rec.op == "add":
                keep.append(old)
        if rec.width and not rec.reads_only:
            for rd in s.reads:
                if not t.vc[rd.ti] >= rd.clock:
                    self._atomic_race_read(me, rd, rec, pe, start)
        for p in s.pins:
            if p is not wqe and not self.known(t, p) and not (wqe is not None and self._ordered(p, wqe)):
                self._pin_conflict(me, p, rec, pe, start)
        return s.replace(writes=tuple(keep) + (rec,), pins=self._pins_after(t, s.pins, wqe))

    def _sync_history(self, t: Thread, ts: int, sw: SyncWrite) -> None:
        """The write appended to its word's history (the last ``_HISTORY``), with the word's value after it."""
        word = self.words.get((sw.pe, sw.off))
        if word is None:
            word = self.words[(sw.pe, sw.off)] = Word(sw.size, None)
            bisect.insort(self.word_offsets[sw.pe], sw.off)
        entry = Entry(ts, sw.op, sw.value, sw.by, sw.rel, sw.site, t.pe, t.ti)
        entries = word.entries
        prev = entries[-1].cur if entries else word.initial
        entry.cur = apply_op(prev, sw.op, sw.value, word.size)
        entries.append(entry)
        if len(entries) > _HISTORY:
            del entries[:len(entries) - _HISTORY]

    def on_signal(self, t: Thread, ts, pe, idx, r) -> None:
        a, off, value = r[5], r[6], r[9]
        tpe, op, size = SIGNAL_A.unpack(a)
        sw = SyncWrite(tpe, off, size, "add" if op == 1 else "set", value, (t.ti, t.clock), t.release(), r[4])
        what = f"signals (aclshmemx_signal_op {'ADD' if op else 'SET'} {word_value(value, size)})"
        self._sync_write(t, ts, sw, self.side(t.pe, t.block, r[4], what))
        self._release(t, ts, "signal_op", None, r[4])

    def on_wait(self, t: Thread, ts, pe, idx, r) -> None:
        _, _, block, flags, site, a, b, c, d, e, f, g = r
        wpe, cmp, size, _ = WAIT_A.unpack(a)
        seen = f | g << 32
        met = self.met.get((pe, idx))
        indices = range(d) if met is None else met
        single = d == 1 and met is None
        for k in indices:
            self._acquire_word(t, ts, wpe, b + k * c, size, cmp, e, seen if single else None, site,
                               test=bool(flags & 1))

    def _acquire_word(self, t: Thread, ts: int, pe: int, off: int, size: int, cmp: int, target: int, seen, site: int,
                      test: bool = False) -> None:
        word = self.words.get((pe, off))
        if word is None:
            return
        target = word_value(target, size)
        op = OPS[cmp]
        if not test:
            self._stale(t, word, pe, off, size, cmp, target, site)
        entries = word.entries
        seen = None if seen is None else word_value(seen, size)
        j = None
        for i in range(len(entries) - 1, -1, -1):
            cur = entries[i].cur
            if cur is None or (op(cur, target) if seen is None else cur == seen):
                j = i
                break
        if j is None:
            return
        if entries[j].op == "set":
            self._skipped(t, entries, j, op, target, site, pe, off)
        self._take(t, entries, j, (cmp, target))

    def _take(self, t: Thread, entries: list, j: int, cond) -> None:
        """Thread ``t`` read the value of write ``entries[j]``: it acquires that write (and, for an add, the adds
        before it back to the last set, whose sum it saw); ``cond``: the wait's condition, recorded as consumed."""
        chain = [entries[j]]
        if entries[j].op == "add":
            i = j - 1
            while i >= 0 and entries[i].op == "add":
                chain.append(entries[i])
                i -= 1
            if i >= 0:
                chain.append(entries[i])
        for entry in chain:
            if entry.rel is not None:
                self.join(t, entry.rel)
            if cond is not None:
                entry.consumed.setdefault(t.ti, set()).add(cond)

    # --- barriers, launches, blocks -------------------------------------------------------------------------

    def on_arrive(self, t: Thread, ts, pe, idx, r) -> None:
        n = r[5]
        if r[6] == _FINALIZE:
            self._unfinished(t, r[4], {th.ti for th in self.threads.values() if th.pe == pe}, "finalized")
        rel = self.barriers.get(n)
        if rel is None:
            self.barriers[n] = t.release()
        else:
            self.join_rel(rel, t)
        self._release(t, ts, "barrier", None, r[4])

    def join_rel(self, rel: Rel, t: Thread) -> None:
        np.maximum(rel.vc, t.vc, out=rel.vc)
        for li, s in t.extras.items():
            if s:
                rel.extras[li] = frozenset(rel.extras.get(li, frozenset()) | s)

    def on_depart(self, t: Thread, ts, pe, idx, r) -> None:
        rel = self.barriers.get(r[5])
        if rel is not None:
            self.join(t, rel)

    def on_launch(self, t: Thread, ts, pe, idx, r) -> None:
        self.launches[(pe, r[5])] = t.release()

    def on_block_begin(self, t: Thread, ts, pe, idx, r) -> None:
        rel = self.launches.get((pe, r[5]))
        if rel is not None:
            self.join(t, rel)

    def on_block_end(self, t: Thread, ts, pe, idx, r) -> None:
        self._unfinished(t, r[4], {t.ti}, "returned from its kernel")
        self.launch_end[(pe, r[5])].append(t.release())

    def on_join(self, t: Thread, ts, pe, idx, r) -> None:
        for rel in self.launch_end.pop((pe, r[5]), []):
            self.join(t, rel)

    def on_sync_arrive(self, t: Thread, ts, pe, idx, r) -> None:
        self.syncs[(pe, r[5], r[6])].append(t.release())

    def on_sync_depart(self, t: Thread, ts, pe, idx, r) -> None:
        for rel in self.syncs.get((pe, r[5], r[6]), []):
            self.join(t, rel)

    # --- kernel accesses ----------------------------------------------------------------------------------

    def on_access(self, t: Thread, ts, pe, idx, r) -> None:
        _, _, block, flags, site, a, off, n, value, e, f, g = r
        acc = Access.unpack(a)
        if acc.pe not in self.shadow:
            return
        if acc.write:
            self._store(t, ts, acc, off, n, value if acc.value_known else None, site)
        else:
            self._load(t, ts, acc, off, n, site, poll=(pe, idx) in self.polls)

    def on_local_access(self, t: Thread, ts, pe, idx, r) -> None:
        """A kernel thread's load or store of a registered local array (line tracing, ``watch``): checked against
        the WQEs that read or write the array, in the PE's local shadow."""
        a, address, n, site = r[5], r[6], r[7], r[4]
        acc = Access(pe | LOCAL, bool(a & 1), False, False, False)
        if a & 1:
            self._store(t, ts, acc, address, n, None, site)
        else:
            self._load(t, ts, acc, address, n, site, poll=False)

    def on_fetch(self, t: Thread, ts, pe, idx, r) -> None:
        """A fetching atomic's old value, read after its quiet: an acquire of the write it read (a write of
        another thread whose value it is, as a wait's; which one the engines ran first is not in the log, so every
        write posted while the atomic was in flight and the last one posted before it): a lock taken with a CAS
        orders what the previous holder did before its release."""
        a, pos, value = r[5], r[6], r[9]
        lane = self.lanes.get((pe, *LANE_A.unpack(a)))
        if lane is None:
            return
        w = lane.by_pos.get(pos) or next((x for x in reversed(lane.wqes) if x.pos & _M32 == pos), None)
        if w is None or w.opcode == READ:  # a CAS loop's read: its CAS's value is what the loop acts on
            return
        word = self.words.get((w.target, w.dst))
        if word is None:
            return
        value = word_value(value, word.size)
        entries = word.entries
        for j in range(len(entries) - 1, -1, -1):  # every write it may have read: those posted while it was in
            entry = entries[j]  # flight, and the last one posted before it (the engines run the two unordered)
            if entry.ts < ts and entry.ti != t.ti and (entry.cur is None or entry.cur == value):
                self._take(t, entries, j, None)
                if entry.ts < w.ts:
                    return

    def _load(self, t: Thread, ts: int, acc: Access, off: int, n: int, site: int, poll: bool) -> None:
        pe = acc.pe
        skips = self.skips.get(t.ti)
        if skips:
            for item in [x for x in skips if x[0] == pe and x[1] < off + n and off < x[2]]:
                skips.remove(item)
                self.add(item[3])
        me = self.side(t.pe, t.block, site, "reads")
        acquired, raced = [], []

        def fn(s: State, start: int) -> State:
            for rec in s.writes:
                if self._knows_write(t, rec):
                    continue
                if s.sync and rec.width and not rec.reads_only and not acc.approx:
                    raced.append((rec, start))  # a plain load of a word the engine writes atomically
                if s.sync or poll or not isinstance(rec.by, Wqe):  # a flag, or a thread's store: an acquire
                    acquired.append(rec)
                    continue
                if acc.approx:
                    continue
                self._read_finding(t, rec, pe, start, me, None)
            if acc.approx:  # a hull: no finding against it either
                return s
            reads = tuple(rd for rd in s.reads if rd.ti != t.ti) + (ReadRec(t.ti, t.clock, site, t.pe),)
            return s.replace(reads=reads)

        self.shadow[pe].update(off, off + n, fn)
        for rec, start in raced:
            self._atomic_race(me, rec, None, pe, start)
        for rec in acquired:  # a plain load of a flag: take what its writer released
            self._acquire_rec(t, pe, rec)
        signalled = any(rec.kind in ("signal", "signal_op") for rec in acquired)
        if (poll or signalled) and not raced and (t.pe, site) not in self.warned:
            self.warned.add((t.pe, site))
            self.add(Finding(
                "raw-poll", me.with_what(f"polls {self.alloc_name(pe, off)} with plain loads" if poll else
                                         f"reads the flag {self.alloc_name(pe, off)} with a plain load"), None, pe, None,
                (pe, off, n), None, severity="warning",
                why="a loop of plain loads is not an acquire on the hardware (no ordering, no cache invalidation), and "
                    "it spins a core; --check treated it as one",
                fix="aclshmem_signal_wait_until / aclshmem_wait_until on the word (it sleeps, and orders what follows "
                    "after the write it saw)"))

    def _acquire_rec(self, t: Thread, pe: int, rec: WriteRec) -> None:
        """A plain load of ``rec``'s memory taken as an acquire of what its writer released."""
        by = rec.by
        if isinstance(by, Wqe):
            if by.rel is not None:
                self.join(t, by.rel)
            elif by.seq > t.vc[by.lane.li]:
                t.extras.setdefault(by.lane.li, set()).add(by.seq)
            return
        rel = rec.rel
        if rel is not None:
            self.join(t, rel)
        else:
            t.vc[by[0]] = max(t.vc[by[0]], by[1])

    def _store(self, t: Thread, ts: int, acc: Access, off: int, n: int, value, site: int) -> None:
        """A kernel thread's store. Threads' own loads and stores are taken as sequentially consistent (a store
        is visible when it returns, as MTE and aclshmem_ptr stores are here): a store releases the writer's
        clock to whoever loads it, and only stores whose order matters conflict with each other. Against UDMA
        work every rule holds: a store over memory a WQE still writes or will read is a finding."""
        pe = acc.pe
        remote = (pe & (LOCAL - 1)) != t.pe
        me = self.side(t.pe, t.block, site, "writes" if not acc.direct else "stores directly to")
        by = (t.ti, t.clock)
        sync_parts = []
        rel = t.release()

        def fn(s: State, start: int) -> State:
            if s.sync:
                sync_parts.append(start)
                return s
            if acc.approx:  # a hull: nothing is decided on it (and no finding can be made against it)
                return s
            unordered = []
            for rec in s.writes:
                if self._knows_write(t, rec):
                    continue
                if isinstance(rec.by, Wqe) or (value is None or order_matters(rec, "set", value)):
                    self._waw(me, rec, pe, start, store=t)
                unordered.append(rec)
            for p in s.pins:
                if not self.known(t, p):
                    self._overwrite(me, p, pe, start, None, t)
            rec = WriteRec(by, "direct" if acc.direct or remote else "store", site, t.pe, "set",
                           value if n <= 8 else None, rel=rel)
            reads = tuple(rd for rd in s.reads if not t.vc[rd.ti] >= rd.clock)
            return s.replace(writes=tuple(unordered) + (rec,), reads=reads, pins=self._pins_after(t, s.pins, None))

        self.shadow[pe].update(off, off + n, fn)
        if sync_parts:  # stores into synchronisation words: checked and recorded as signals
            for woff, word in self._words_in(pe, off, off + n):
                v = value if n <= 8 else (0 if value == 0 else None)
                if v is not None and n <= 8:
                    v = v >> 8 * (woff - off) & ((1 << 8 * word.size) - 1)
                self._sync_write(t, ts, SyncWrite(pe, woff, word.size, "set", v, by, rel, site, "store"), me)
        if sync_parts or acc.direct or remote:
            self._release(t, ts, "store", None, site)

    def _words_in(self, pe: int, lo: int, hi: int):
        offs = self.word_offsets[pe]
        i = bisect.bisect_left(offs, lo)
        out = []
        while i < len(offs) and offs[i] < hi:
            out.append((offs[i], self.words[(pe, offs[i])]))
            i += 1
        return out

    # --- findings -------------------------------------------------------------------------------------------

def analyze(logs: list[Log], heap_size: int) -> Findings:
    """Run the analysis over the logs of a job's PEs."""
    return Analyzer(logs, heap_size).run()
