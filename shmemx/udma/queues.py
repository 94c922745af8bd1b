"""Send and completion queues: posting WQEs, ringing doorbells, polling CQEs.

One ``QueuePair`` per (peer, qp) of this PE. Its rings and context words live in the PE's UDMA segment, so a
dump from another process sees them; Python mirrors of the hot words keep posting cheap.

Who owns which word, and who may write it:

* ``wq_ctx.head``, ``cqe_cnt`` and the SQ doorbell: the submitting kernel thread. Post = write the WQE at
  ``ring + 64 * (head % depth)``, ``head += bb``, ``cqe_cnt += 1`` if the flag asks for a CQE, then store the new
  monotonic head into the doorbell (last, so that the engine never sees a doorbell before its WQE).
* the SQ consumer index, the CQ ring and the CQ producer index: the DMA engine thread only.
* ``cq_ctx.tail``, ``wq_ctx.tail`` and the CQ doorbell: the poller (quiet). It walks the CQ from its tail to
  ``cqe_cnt``, checks each CQE's owner bit (1 on even laps of the ring, 0 on odd ones), raises on an error CQE,
  and restores the SQ tail from the last CQE's 16-bit ``entry_idx`` (the BB counter after its WQE).

Credits: a post that would leave fewer than ``CREDIT_GUARD`` free BBs first drains the CQ (waits for every
outstanding CQE), so an unexecuted WQE is never overwritten. WQEs without CQE are reclaimed only by a later CQE's
entry_idx, as on the hardware: post a CQE-producing WQE at least every ``depth - 10`` BBs.

One submitter per queue at a time, as on the hardware: the first thread that posts claims the queue until its
quiet has retired everything it posted (or its kernel launch ends); another thread that posts meanwhile gets a
``SubmitterError`` naming both blocks.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from ..errors import CompletionError, ShmemError, SubmitterError
from ..shm.control import WaitCall
from ..shm.waits import CMP_MASKED, WORD_KINDS, Patience, Wait, block_on_word, thread_slot
from .describe import format_cqe, format_wqe
from .layout import (C_ENTRY_IDX, C_STATUS, DW0, DW1, M32, NOTIFY_WQE, OWNER_SHIFT, RW_WQE, CqeStatus, Opcode, cqe_owner,
                     decode_cqe, decode_wqe, pack_wqe, tp_word, wqe_length)
from ._engine import (ST_B_POSTED, ST_CQ_TAIL, ST_CQE_CNT, ST_CQES, ST_DOORBELLS, ST_HEAD, ST_N_POSTED, ST_OWNER,
                      ST_OWNER_BLOCK, ST_TAIL, ST_WORDS)
from .rings import Api, decode_sidecar, read_wqe, scan_wqes, sidecar_word
from .segment import (CQ_TAIL, CREDIT_GUARD, HW_CI, HW_CQ_DB, HW_CQ_PI, HW_ERR_ARG, HW_ERR_POS, HW_ERR_STATUS,
                      HW_ERR_SUBSTATUS, HW_ERR_WHERE, HW_SQ_DB, HW_STATE, WQ_CQE_CNT, WQ_HEAD, WQ_TAIL)

__all__ = ["QueuePair"]

_now = time.perf_counter_ns
# A quiet spins this many times a wait's spin (waits.grace_period: 0 when PEs outnumber cores) before it sleeps:
# the engine is executing its WQEs meanwhile, and a 1 MiB copy alone takes ~60 us here
QUIET_SPIN_FACTOR = 20
_U32_KIND = WORD_KINDS["<u4"]
_OWNER_MASK = 1 << OWNER_SHIFT


def _state_word(k: int, doc: str) -> property:
    """A QueuePair attribute that is word ``k`` of its record in the plane's posting state block."""

    def get(self) -> int:
        return self._s[self._o + k]

    def set(self, value: int) -> None:
        self._s[self._o + k] = value

    return property(get, set, doc=doc)


class QueuePair:
    """The SQ and CQ of one (peer, qp) channel of this PE."""

    def __init__(self, udma: Any, peer: int, qp_idx: int):
        seg = udma.seg
        self.udma = udma
        self.my_pe = udma.my_pe
        self.peer = peer
        self.qp_idx = qp_idx
        self.index = i = peer * seg.qp_num + qp_idx
        self.depth = seg.sq_depth
        self.mask = seg.sq_depth - 1
        self.cq_depth = seg.cq_depth
        self.mm = seg.segment.mm
        self.sq_base = seg.sq_offset + i * seg.sq_bytes
        self.sq = seg.sq_ring(i)  # [depth, 64] uint8
        self.sq32 = self.sq.view("<u4")  # [depth, 16]
        self.cq = seg.cq_ring(i)
        self.cq32 = self.cq.view("<u4")
        self.sidecar = seg.sidecar(i)
        self.wq32 = seg.wq32[i]
        self.cq_ctx32 = seg.cq32[i]
        self.hw32 = seg.hw32[i]
        # the hot words through a u32 memoryview of the segment: a store costs 55 ns there, 140 ns through numpy
        self._w = udma.words
        wq_word = (seg.wq32.ctypes.data - seg.segment.addr) // 4 + 16 * i
        self._i_head, self._i_cqe_cnt = wq_word + WQ_HEAD, wq_word + WQ_CQE_CNT
        self._i_db = (seg.hw_offset + 64 * i) // 4 + HW_SQ_DB
        self._i_sidecar = (seg.sidecar_offset + 4 * i * seg.sq_depth) // 4
        self._i_cq = (seg.cq_offset + i * seg.cq_bytes) // 4  # word 0 of CQ slot 0
        self._cq_addr = seg.segment.addr + seg.cq_offset + i * seg.cq_bytes
        # a quiet spins QUIET_SPIN_FACTOR graces whatever the last waits did, then sleeps on this PE's wake word
        self._quiet_patience = Patience(spin=QUIET_SPIN_FACTOR * udma.rt.spin, adaptive=False, sleep_pe=self.my_pe)
        rmi = seg.remote_mem_info[i]
        self.tpn = int(rmi["tpn"])
        self.tid = int(rmi["tid"])
        self.token = int(rmi["rmt_token_value"])
        self.eid_lo, self.eid_hi = (int(x) for x in rmi["eid"])
        self.eid = self.eid_hi << 64 | self.eid_lo
        self.remote_base = int(rmi["addr"])
        self.remote_len = int(rmi["len"])
        self.amo_va = int(seg.wq_ctx[i]["amo_addr"])
        self.amo = seg.amo[i]  # [8] uint64 fetch scratch
        self._dw2 = tp_word(self.tpn)
        # posting side (kernel threads): head, tail, cqe_cnt, cq_tail, submitter, and the WQEs and bytes posted since
        # the owner last published them (observe.counters), in the plane's private state block, which the native
        # posting path (_post.c) reads and writes too (owner_block starts at -1 there: this object may be made
        # after the native path claimed the queue)
        self._s = udma.qwords
        self._o = i * ST_WORDS
        self._kick = udma.engine.kick  # wakes the engine after a doorbell store
        self._ring = udma.engine.ring  # the same for one WQE: executed at once when small and the queue idle

    def __repr__(self) -> str:
        return f"QueuePair(pe {self.my_pe} -> pe {self.peer} qp {self.qp_idx})"

    head = _state_word(ST_HEAD, "the posted head (monotonic BB counter)")
    tail = _state_word(ST_TAIL, "the retired tail (from the last consumed CQE's entry_idx)")
    cqe_cnt = _state_word(ST_CQE_CNT, "CQEs asked for so far")
    cq_tail = _state_word(ST_CQ_TAIL, "CQEs consumed so far")
    owner_block = _state_word(ST_OWNER_BLOCK, "the submitter's AIV block (-1: none)")
    n_posted = _state_word(ST_N_POSTED, "WQEs posted since the last publish")
    b_posted = _state_word(ST_B_POSTED, "bytes posted since the last publish")
    doorbells = _state_word(ST_DOORBELLS, "doorbells rung since the last publish")
    cqes = _state_word(ST_CQES, "CQEs consumed since the last publish")

    @property
    def owner(self) -> int | None:
        """The submitting thread's ident, or None."""
        return self._s[self._o + ST_OWNER] or None

    @owner.setter
    def owner(self, ident: int | None) -> None:
        self._s[self._o + ST_OWNER] = ident or 0

    @property
    def name(self) -> str:
        return f"pe {self.peer} qp {self.qp_idx}"

    @property
    def cq_pi(self) -> int:
        """The CQ producer index (CQEs the engine has written)."""
        return int(self.hw32[HW_CQ_PI])

    @property
    def error(self) -> dict | None:
        """The queue's first failure, from the engine's record, until a poller reports it: position, status,
        substatus and the detail in words; None while the queue is not in error."""
        hw = self.hw32
        if not hw[HW_STATE]:
            return None
        pos = int(hw[HW_ERR_POS])
        status = int(hw[HW_ERR_STATUS])
        detail = self.udma.engine.describe_fault(status, int(hw[HW_ERR_WHERE]), int(hw[HW_ERR_ARG]), pos,
                                                 decode_wqe(self.wqe_at(pos)))
        return {"pos": pos, "status": status, "substatus": int(hw[HW_ERR_SUBSTATUS]), "detail": detail}

    # --- submitters --------------------------------------------------------------------------------------

    def claim(self, what: str) -> None:
        """Make the calling thread this queue's submitter, or raise if another block is using it."""
        me = threading.get_ident()
        if self.owner == me:
            return
        if self.owner is not None and self.head != self.tail and self.udma.thread_alive(self.owner):
            if self.udma.rt.events is not None:
                self.udma.rt.events.claim(self.peer, self.qp_idx)
            mine = thread_slot()
            raise SubmitterError(
                f"pe {self.my_pe}: {what} to pe {self.peer} qp {self.qp_idx}: the send queue is in use by block "
                f"{self.owner_block}, which has {(self.head - self.tail) & M32} BBs posted and not yet quieted; "
                f"block {mine} may not post to it concurrently (one submitter per (peer, qp), as on the hardware: "
                f"quiet it in block {self.owner_block} first, or give each block its own qp)")
        self.publish()
        self.owner = me
        self.owner_block = thread_slot()

    def release(self) -> None:
        self.publish()
        self.owner = None
        self.owner_block = -1

    def publish(self) -> None:
        """Add the WQEs, bytes, doorbells and CQEs counted since the last call to the owner's stats slot (by the
        owning thread)."""
        n = self.n_posted
        if n:
            b = self.b_posted
            self.n_posted = self.b_posted = 0
            self.udma.rt.stats.add_posted(max(self.owner_block, 0), self.index, n, b)
        d, c = self.doorbells, self.cqes
        if d or c:
            self.doorbells = self.cqes = 0
            self.udma.rt.stats.add_counts(max(self.owner_block, 0), d, c)

    # --- posting -----------------------------------------------------------------------------------------

    def _room(self, bbs: int, what: str) -> None:
        if ((self.head + bbs - self.tail) & M32) + CREDIT_GUARD < self.depth:
            return
        self.poll(self.cqe_cnt, what, release=False)
        if ((self.head + bbs - self.tail) & M32) + CREDIT_GUARD >= self.depth:
            raise ShmemError(
                f"pe {self.my_pe}: {what} to pe {self.peer} qp {self.qp_idx}: send queue full "
                f"({(self.head - self.tail) & M32} of {self.depth} BBs posted since the last retired CQE) and no "
                f"CQE outstanding to free it: post a CQE-producing WQE (config cqe=1) at least every "
                f"{self.depth - CREDIT_GUARD} BBs")

    def _emit(self, head: int, bbs: int, api: int, cqes: int) -> None:
        """The events of the ``bbs`` BBs written from ``head`` (before their doorbell): the native writer's, as for
        the native posts (``Poster.emit_posted``)."""
        self.udma.poster.emit_posted(self.index, head & M32, bbs, int(api), max(self.owner_block, 0) & 0xFF, cqes)

    def _rang(self, head: int, flag: int, api: int, bbs: int) -> None:
        w = self._w
        w[self._i_sidecar + ((head - bbs) & self.mask)] = sidecar_word(api, self.owner_block)
        cqe = 1 if flag & 0x20 else 0
        if self.udma.rt.events is not None:
            self._emit(head - bbs, bbs, api, cqe)
        self.head = head
        w[self._i_head] = head & M32
        if cqe:
            self.cqe_cnt = (self.cqe_cnt + 1) & M32
            w[self._i_cqe_cnt] = self.cqe_cnt
        self.doorbells += 1
        w[self._i_db] = head & M32  # the doorbell, last
        self._ring(self.index, (head - bbs) & M32, bbs)

    def post_rw(self, opcode: int, flag: int, rmt_va: int, length: int, local_va: int, api: int, what: str) -> int:
        """Post a one-BB WRITE or READ; returns its BB position. (``_rang`` inlined: this is the per-token path.)"""
        if self.owner != threading.get_ident():
            self.claim(what)
        head = self.head
        if ((head + 1 - self.tail) & M32) + CREDIT_GUARD >= self.depth:
            self._room(1, what)
            head = self.head
        slot = head & self.mask
        RW_WQE.pack_into(self.mm, self.sq_base + slot * 64, DW0[flag], DW1[opcode], self._dw2, self.tid,
                         self.eid_lo, self.eid_hi, self.token, 0, rmt_va, length, 0, local_va)
        w = self._w
        w[self._i_sidecar + slot] = api | self.owner_block << 8  # sidecar_word, inlined
        if self.udma.rt.events is not None:  # stamped before the doorbell: the engine may run the WQE right after
            self._emit(head, 1, api, 1 if flag & 0x20 else 0)
        self.head = new = (head + 1) & M32
        w[self._i_head] = new
        if flag & 0x20:
            self.cqe_cnt = (self.cqe_cnt + 1) & M32
            w[self._i_cqe_cnt] = self.cqe_cnt
        self.doorbells += 1
        w[self._i_db] = new  # the doorbell, last
        self.n_posted += 1
        self.b_posted += length
        self._ring(self.index, head, 1)
        return head

    def post_bytes(self, wqe: bytes, flag: int, api: int, what: str) -> int:
        """Post a WQE given as bytes (64 or 128); a two-BB WQE at the last slot wraps to the ring start."""
        if self.owner != threading.get_ident():
            self.claim(what)
        bbs = len(wqe) // 64
        self._room(bbs, what)
        head = self.head
        slot = head & self.mask
        off = self.sq_base + slot * 64
        first = min(len(wqe), (self.depth - slot) * 64)
        self.mm[off:off + first] = wqe[:first]
        if first < len(wqe):  # the second BB of a WQE at the last slot goes to the ring start
            self.mm[self.sq_base:self.sq_base + len(wqe) - first] = wqe[first:]
        self.n_posted += 1
        self.b_posted += wqe_length(wqe)
        self._rang(head + bbs, flag, api, bbs)
        return head

    def _count_batch(self, n: int) -> None:
        """Count the WQEs in the ``n`` BBs a doorbell publishes from ``self.head`` (raw / submit path)."""
        positions, lengths, _ops = scan_wqes(self.sq32, self.mask, self.head, n)
        self.n_posted += len(positions)
        self.b_posted += int(lengths.sum())

    def rw_bytes(self, opcode: int, flag: int, rmt_va: int, length: int, local_va: int) -> bytes:
        """The 64 bytes ``post_rw`` would write for this WRITE or READ (a defer batch stages them)."""
        return RW_WQE.pack(DW0[flag], DW1[opcode], self._dw2, self.tid, self.eid_lo, self.eid_hi, self.token, 0,
                           rmt_va, length, 0, local_va)

    def notify_bytes(self, flag: int, rmt_va: int, length: int, local_va: int, sig_va: int, value: int) -> bytes:
        """The 128 bytes of a WRITE_WITH_NOTIFY to this queue's peer (the signal word on its heap as well)."""
        return NOTIFY_WQE.pack(DW0[flag], DW1[Opcode.WRITE_WITH_NOTIFY], self._dw2, self.tid, self.eid_lo,
                               self.eid_hi, self.token, 0, rmt_va, self.tid | self.token << 32, sig_va, value, 0, length,
                               0, local_va)

    def build(self, opcode: int, flag: int, rmt_va: int, **fields: int) -> bytes:
        """A WQE for this queue's peer (its TP, tokenId, EID and token) as bytes."""
        return pack_wqe(opcode=opcode, flag=flag, tp_id=self.tpn, rmt_seg_id=self.tid, rmt_eid=self.eid,
                        rmt_token_value=self.token, rmt_va=rmt_va, **fields)

    def reserve(self, bbs: int, what: str = "raw post") -> int:
        """Make room for ``bbs`` BBs (draining the CQ if needed) and return the head where they go."""
        if self.owner != threading.get_ident():
            self.claim(what)
        if bbs + CREDIT_GUARD >= self.depth:
            raise ValueError(f"pe {self.my_pe}: {what}: {bbs} BBs do not fit a send queue of depth {self.depth} "
                             f"(at most {self.depth - CREDIT_GUARD - 1})")
        self._room(bbs, what)
        return self.head

    def ring_doorbell(self, head: int, cqes: int = 0, api: int = Api.RAW) -> None:
        """Publish WQEs written at ``[self.head, head)``: store the head, add ``cqes`` to cqe_cnt, ring."""
        n = (head - self.head) & M32
        if ((head - self.tail) & M32) + CREDIT_GUARD >= self.depth or n > self.depth:
            raise ValueError(f"pe {self.my_pe}: doorbell for {self.name}: head {head} is {n} BBs past the posted "
                             f"head {self.head} and would leave less than the credit guard between it and the "
                             f"retired tail {self.tail} (depth {self.depth}): reserve() the room first")
        if self.owner != threading.get_ident():
            self.claim("doorbell")
        if n:
            slots = (self.head + np.arange(n)) & self.mask
            self.sidecar[slots] = sidecar_word(api, thread_slot())
            self._count_batch(n)
            if self.udma.rt.events is not None:
                self._emit(self.head, n, api, cqes)
        self.head = head
        self.wq32[WQ_HEAD] = head & M32
        if cqes:
            self.cqe_cnt = (self.cqe_cnt + cqes) & M32
            self.wq32[WQ_CQE_CNT] = self.cqe_cnt
        self.doorbells += 1
        self.hw32[HW_SQ_DB] = head & M32
        self._kick()

    # --- polling (quiet) ---------------------------------------------------------------------------------

    def _valid_count(self, t: int, n: int) -> int:
        """How many CQEs from position ``t`` on (at most ``n``) the engine has written (owner bits).

        The engine writes CQEs in order, so the common answers (all of them, none) come from reading the owner
        bits of the last and the first with two word reads: a quiet's first look and every re-check while it
        waits run no numpy (a numpy call costs 15-30 us when a large copy has just evicted the caches).
        """
        if self._cqe_valid(t + n - 1):
            return n
        if n == 1 or not self._cqe_valid(t):
            return 0
        pos = t + np.arange(n, dtype=np.int64)
        slots = pos % self.cq_depth
        owner = (self.cq32[slots, 0] >> OWNER_SHIFT) & 1
        valid = owner == cqe_owner(pos, self.cq_depth)
        return n if valid.all() else int(np.argmin(valid))

    def _cqe_valid(self, pos: int) -> bool:
        """Whether the engine has written the CQE at position ``pos`` (its owner bit, ``cqe_owner``)."""
        return (self._w[self._i_cq + 16 * (pos % self.cq_depth)] >> OWNER_SHIFT & 1) == cqe_owner(pos, self.cq_depth)

    def poll(self, target: int, what: str = "qp_quiet", *, call: WaitCall = WaitCall.QP_QUIET,
             report: bool = True, release: bool = True) -> None:
        """Consume CQEs up to ``target`` (a cqe_cnt value); raise the first error CQE after consuming them all.

        Counted in the calling block's quiet time (stats) and traced as a quiet span; the owning block publishes
        its posted counts here.

        Raises:
            CompletionError: an error CQE (carrying the decoded CQE and WQE), or the queue failed without one.
        """
        start = _now()
        chaos = self.udma.rt.chaos
        if chaos is not None:
            chaos.jitter()
        try:
            self._poll(target, what, call, report, release, start)
        finally:
            rt = self.udma.rt
            if (self.n_posted or self.doorbells or self.cqes) and self.owner == threading.get_ident():
                self.publish()
            rt.stats.add_quiet(thread_slot(), _now() - start)
            if chaos is not None:
                chaos.jitter()

    def _poll(self, target: int, what: str, call: WaitCall, report: bool, release: bool, start: int) -> None:
        t = self.cq_tail
        first_error = None
        while t != target:
            k = self._valid_count(t, min((target - t) & M32, self.cq_depth))
            if k == 0:
                self._wait_cqe(t, target, what, call)
                continue
            error = self._consume(t, k)
            first_error = first_error or error
            t = (t + k) & M32
        consumed = (t - self.cq_tail) & M32
        self.cqes += consumed
        if self.udma.rt.events is not None:  # after the CQEs, before the retire hook may drop a registration
            self.udma.poster.emit_quiet(self.index, int(call), target, start, thread_slot() & 0xFF, consumed)
        if t != self.cq_tail:
            self._retire(t)
        if release and self.owner == threading.get_ident() and self.tail == self.head:
            self.release()
        if report and first_error is not None:
            self._raise(decode_cqe(first_error), what)
        if report and self.error is not None:
            self._raise(None, what)

    def _wait_cqe(self, t: int, target: int, what: str, call: WaitCall) -> None:
        """Wait until the engine wrote the CQEs from position ``t`` up to ``target`` (at most a ring's worth): the
        owner bit of the last of them (the engine writes them in order), without the interpreter lock while it
        spins or sleeps (on this PE's wake word, which the engine bumps after writing CQEs)."""
        last = (t + min((target - t) & M32, self.cq_depth) - 1) & M32
        rt = self.udma.rt
        block_on_word(rt, self._cq_addr + 64 * (last % self.cq_depth), _U32_KIND, CMP_MASKED,
                      cqe_owner(last, self.cq_depth) << OWNER_SHIFT,
                      Wait(call, pe=self.peer, qp=self.qp_idx, target=target,
                           describe=lambda: self._describe_wait(what, target)),
                      mask=_OWNER_MASK, patience=self._quiet_patience)

    def _consume(self, t: int, k: int) -> bytes | None:
        """Take the ``k`` written CQEs from position ``t``: restore the SQ tail from the last one's entry_idx;
        returns the first error CQE's bytes, or None. (A few CQEs are read as words: a numpy call costs 15-30 us
        right after a large copy evicted the caches, and a put + quiet loop runs this after every copy.)"""
        if k <= 16:
            w, base, depth = self._w, self._i_cq, self.cq_depth
            first_error = None
            for pos in range(t, t + k):
                if w[base + 16 * (pos % depth) + C_STATUS] >> 16 and first_error is None:
                    first_error = pos % depth
            entry_idx = w[base + 16 * ((t + k - 1) % depth) + C_ENTRY_IDX] & 0xFFFF
            self.tail = (self.tail + ((entry_idx - self.tail) & 0xFFFF)) & M32
            return None if first_error is None else bytes(self.cq[first_error])
        slots = (t + np.arange(k, dtype=np.int64)) % self.cq_depth
        rows = self.cq32[slots]
        status = rows[:, 0] >> 16
        entry_idx = int(rows[-1, 1] & 0xFFFF)
        self.tail = (self.tail + ((entry_idx - self.tail) & 0xFFFF)) & M32
        if status.any():
            return bytes(self.cq[int(slots[int(np.argmax(status != 0))])])
        return None

    def _retire(self, t: int) -> None:
        """Publish the new CQ tail (consumed up to ``t``) and SQ tail; registrations only they used may go."""
        self.cq_tail = t
        self.cq_ctx32[CQ_TAIL] = t
        self.hw32[HW_CQ_DB] = t & 0xFFFFFF
        self.wq32[WQ_TAIL] = self.tail
        self.udma.retired(self)

    def _describe_wait(self, what: str, target: int) -> str:
        return (f"pe {self.my_pe}: {what} on pe {self.peer} qp {self.qp_idx}: {target - self.cq_tail & M32} CQEs "
                f"outstanding (cqe_cnt {target}, CQ tail {self.cq_tail}); the engine executed "
                f"{(int(self.hw32[HW_CI]) - self.tail) & M32} of {(self.head - self.tail) & M32} posted BBs")

    def wqe_at(self, pos: int) -> bytes:
        """The bytes of the WQE posted at BB position ``pos`` (unwrapped, 64 or 128 bytes)."""
        return read_wqe(self.sq, self.mask, pos)

    def _raise(self, cqe, what: str) -> None:
        err = self.error
        self.hw32[HW_STATE] = 0  # reported: the engine executes this queue's later WQEs again
        pos = cqe.user_data if cqe is not None else (err or {}).get("pos", 0)
        if err is not None and err.get("pos") is not None:
            pos = err["pos"]
        wqe = decode_wqe(self.wqe_at(pos))
        # the queue's own record names the failure; the CQE may be a later WQE's FLUSHED one (when the failing
        # WQE asked for no CQE)
        status = CqeStatus(err["status"]).name if err is not None else cqe.status_name
        detail = (err or {}).get("detail", "")
        call, block = decode_sidecar(int(self.sidecar[pos & self.mask]))
        lines = [f"pe {self.my_pe}: {call} to pe {self.peer} qp {self.qp_idx} (block {block}, WQE at BB "
                 f"{pos}): {status}" + (f": {detail}" if detail else "")]
        if cqe is not None and cqe.user_data != pos:
            lines.append(f"  CQE of the WQE at BB {cqe.user_data} (the failing WQE asked for none): {format_cqe(cqe)}")
        elif cqe is not None:
            lines.append(f"  CQE: {format_cqe(cqe)}")
        lines.append(f"  WQE: {format_wqe(wqe, self.udma.describe_va)}")
        raise CompletionError("\n".join(lines), cqe=cqe, wqe=wqe, pe=self.my_pe, peer=self.peer,
                              qp_idx=self.qp_idx)
