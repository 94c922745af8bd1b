"""The raw WQE path: direct access to a queue pair's contexts and rings, for kernels that build WQEs themselves.

DeepEP's elastic dispatch does not call put per token: it reserves N slots in an SQ, writes N WQEs with vector
stores and rings the doorbell once. ``aclshmemx_udma_raw_queue(pe, qp_idx)`` gives the same access:

    q = shmemx.aclshmemx_udma_raw_queue(peer, 0)
    head = q.reserve(n)                                   # drains the CQ first if the ring is short of room
    q.write(head, q.build_writes(rmt_va=q.remote_va(dst) + offsets, sge_len=nbytes,
                                 sge_va=q.local_va(src) + src_offsets, flag=flags))
    q.ring_doorbell(head + n, cqes=int((flags & 0x20 != 0).sum()))
    q.poll()                                              # = aclshmemx_udma_qp_quiet

``wq_ctx``, ``cq_ctx`` and ``remote_mem_info`` are structured views of the live records in shared memory;
``sq`` / ``cq`` are ``[depth, 64] uint8`` views of the rings (``sq_words``: ``[depth, 8] uint64``). What is
written there is exactly what the engine executes: the engine validates every field (EID, TP, tokenId, token,
ranges) and reports a malformed WQE with an error CQE, as the hardware would.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from ..runtime import runtime
from ..shm.control import WaitCall
from ..shm.waits import thread_slot
from ..udma.layout import M32, NOTIFY_CTX_OFFSET, NOTIFY_SGE_OFFSET, Opcode, build_write_batch
from ..udma.rings import Api
from ..udma.queues import QueuePair
from .checks import check_target
from .rma import aclshmemx_udma_qp_quiet

__all__ = ["RawQueue", "RawQueues", "aclshmemx_udma_raw_queue"]


class RawQueue:
    """Raw access to the SQ/CQ of (pe, qp_idx) of the calling PE (see the module docstring)."""

    def __init__(self, qp: QueuePair):
        self._qp = qp
        seg = qp.udma.seg
        self.peer = qp.peer
        self.qp_idx = qp.qp_idx
        self.depth = qp.depth
        self.wq_ctx = seg.wq_ctx[qp.index:qp.index + 1].reshape(())
        self.cq_ctx = seg.cq_ctx[qp.index:qp.index + 1].reshape(())
        self.remote_mem_info = seg.remote_mem_info[qp.index:qp.index + 1].reshape(())
        self.sq = qp.sq
        self.sq_words = qp.sq.view(np.uint64)
        self.cq = qp.cq
        self._pinned: list = []  # registrations handed out by local_va since the last doorbell
        self._templates: dict = {}  # (flag, opcode) -> the words 0-4 of this queue's one-BB WQEs (build_writes)

    def __repr__(self) -> str:
        return f"RawQueue(pe {self._qp.my_pe} -> pe {self.peer} qp {self.qp_idx}, head {self.head})"

    @property
    def head(self) -> int:
        """The posted head (monotonic BB counter)."""
        return self._qp.head

    @property
    def cqe_cnt(self) -> int:
        return self._qp.cqe_cnt

    def remote_va(self, arr: np.ndarray) -> int:
        """Device VA on this queue's peer of the symmetric address ``arr`` (a heap view)."""
        rt = self._qp.udma.rt
        _, off = rt.heap.locate(arr, "raw remote_va argument")
        return self._qp.remote_base + off

    def local_va(self, arr: np.ndarray, *, writable: bool = False) -> int:
        """Local VA of ``arr`` (this PE's heap, or a local array registered while this queue uses it).

        A registered array stays registered until the WQEs of this queue's next ``ring_doorbell`` retired (a
        quiet passed them); then it may be collected, so that it does not keep the array alive.
        """
        pin = (self._qp.index, (self._qp.head + self.depth) & M32)  # until the next doorbell says where
        va, reg = self._qp.udma.registry.va_of(arr, writable, "raw local_va argument", pin=pin)
        if reg is not None:
            self._pinned.append(reg)
        return va

    def describe_va(self, va: int) -> str:
        """An emulated VA in words: ``pe 3 heap +0x1200 ('recv_x'+0x200)``, ``pe 0 amo scratch +0x40``, ..."""
        return self._qp.udma.describe_va(va)

    def build(self, opcode: int, flag: int, rmt_va: int, **fields: int) -> bytes:
        """One WQE (64 or 128 bytes) with this queue's TP, tokenId, EID and token (see ``layout.pack_wqe``)."""
        return self._qp.build(opcode, flag, rmt_va, **fields)

    def build_writes(self, *, rmt_va: np.ndarray | int, sge_len: np.ndarray | int, sge_va: np.ndarray | int,
                     flag: int = 0x20, opcode: int = Opcode.WRITE) -> np.ndarray:
        """``[n, 8] uint64`` one-BB WQEs for this queue's peer in one numpy operation."""
        q = self._qp
        if isinstance(flag, int) and isinstance(opcode, int):  # words 0-4 are the same in every WQE: copy them
            key = (flag, opcode)
            head = self._templates.get(key)
            if head is None:
                head = self._templates[key] = build_write_batch(1, tp_id=q.tpn, rmt_seg_id=q.tid, rmt_eid=q.eid,
                                                                rmt_token_value=q.token, rmt_va=0, sge_len=0,
                                                                sge_va=0, flag=flag, opcode=opcode)[0, :5]
            n = int(np.broadcast(rmt_va, sge_len, sge_va).size)
            out = np.empty((n, 8), np.uint64)
            out[:, :5] = head
            out[:, 5] = rmt_va
            out[:, 6] = np.asarray(sge_len, np.uint64) & np.uint64(0xFFFF_FFFF)
            out[:, 7] = sge_va
            return out
        n = int(np.broadcast(np.asarray(rmt_va), np.asarray(sge_len), np.asarray(sge_va), np.asarray(flag)).size)
        return build_write_batch(n, tp_id=q.tpn, rmt_seg_id=q.tid, rmt_eid=q.eid, rmt_token_value=q.token,
                                 rmt_va=rmt_va, sge_len=sge_len, sge_va=sge_va, flag=flag, opcode=opcode)

    def reserve(self, bbs: int) -> int:
        """Make room for ``bbs`` BBs and return the head to write them at."""
        return self._qp.reserve(int(bbs))

    def write(self, head: int, wqes: np.ndarray | bytes) -> int:
        """Copy WQEs (``[n, 8] uint64``, ``[n, 64] uint8`` or bytes) into the ring from ``head``; returns the new
        head. Wraps at the ring end. Does not ring the doorbell."""
        data = np.frombuffer(wqes, np.uint8) if isinstance(wqes, (bytes, bytearray)) else np.asarray(wqes)
        rows = data.reshape(-1).view(np.uint8).reshape(-1, 64)
        n = len(rows)
        start = head & self._qp.mask
        first = min(n, self.depth - start)
        self.sq[start:start + first] = rows[:first]
        if first < n:
            self.sq[:n - first] = rows[first:]
        return (head + n) & M32

    def ring_doorbell(self, head: int, *, cqes: int = 0) -> None:
        """Store the doorbell: WQEs up to ``head`` may run; ``cqes`` of them produce a CQE (added to cqe_cnt)."""
        self._qp.ring_doorbell(head & M32, cqes=cqes, api=Api.RAW)
        for reg in self._pinned:  # used by WQEs up to this doorbell at most: free once they retired
            reg.uses[self._qp.index] = head & M32
        self._pinned.clear()

    def post(self, wqes: np.ndarray | bytes, *, cqes: int = 0) -> int:
        """``reserve`` + ``write`` + ``ring_doorbell`` of built WQEs in one call (one doorbell); returns the new
        head. A batch of WRITE / READ / WRITE_WITH_NOTIFY WQEs is stored by native code, observed or not (the same
        bytes, sidecar words, counts and events as the three calls); anything else takes them."""
        data = np.frombuffer(wqes, np.uint8) if isinstance(wqes, (bytes, bytearray)) else np.asarray(wqes)
        q = self._qp
        if data.flags.c_contiguous:
            head = q.udma.poster.wqes(q.index, data, cqes, Api.RAW, thread_slot())
            if head >= 0:
                for reg in self._pinned:  # as ring_doorbell: used by WQEs up to this head at most
                    reg.uses[q.index] = head
                self._pinned.clear()
                return head
        bbs = data.nbytes // 64
        head = self.reserve(bbs)
        end = self.write(head, data)
        self.ring_doorbell(end, cqes=cqes)
        return end

    def poll(self, target: int | None = None) -> None:
        """Consume CQEs up to ``target`` (default cqe_cnt): the quiet of this queue."""
        q = self._qp
        q.poll(q.cqe_cnt if target is None else target, "raw poll")


class RawQueues:
    """Many raw queues of this PE used as one batch: the WQEs for all of them built in one numpy operation
    (``build_writes`` / ``build_notifies``, ``which`` = the queue of each WQE, an index into ``queues``) and posted
    with one call (``post``: a segment per queue, a doorbell each). The WQE bytes are those each queue's own
    ``build_writes`` / ``build`` makes, and ``post`` is each segment's ``RawQueue.post`` (same bytes, sidecar words,
    counts, events); the segments are stored by one native call that kicks the engine once, and a segment the
    native path refuses (no room, another submitter, an opcode it does not store) by each queue's ``post``.

        batch = shmemx.RawQueues([shmemx.aclshmemx_udma_raw_queue(pe, 0) for pe in peers])
        wqes = batch.build_writes([0, 0, 1], rmt_va=rmt, sge_len=nbytes, sge_va=src)   # [3, 8] uint64
        batch.post([0, 1], [2, 1], wqes, cqes=[2, 1])                    # 2 WQEs to peers[0], 1 to peers[1]
    """

    def __init__(self, queues: Iterable[RawQueue]):
        self.queues = list(queues)
        if not self.queues:
            raise ValueError("RawQueues needs at least one queue")
        udma = {id(q._qp.udma) for q in self.queues}
        if len(udma) != 1:
            raise ValueError("RawQueues: every queue must belong to this PE's data plane")
        self._udma = self.queues[0]._qp.udma
        self.index = np.array([q._qp.index for q in self.queues], np.int64)  # the queues' slot indices
        self._writes: dict = {}  # (flag, opcode) -> [n_queues, 5] uint64: words 0-4 of each queue's one-BB WQE
        self._notifies: dict = {}  # flag -> [n_queues, 16] uint64: each queue's WRITE_WITH_NOTIFY, fields zero
        self._pinned: dict = {}  # thread -> registrations local_va handed it since its last post (blocks share this)

    def __len__(self) -> int:
        return len(self.queues)

    def local_va(self, arr: np.ndarray, *, writable: bool = False) -> int:
        """Local VA of ``arr`` as a WQE source on any queue of the batch (``RawQueue.local_va``): a registered
        array stays registered until the WQEs of the calling thread's next ``post`` that used it retired."""
        # pinned under a key of the calling thread's own (no queue has it, so it never reads as retired) until its
        # post records the real uses: blocks share the batch and post to different queues
        va, reg = self._udma.registry.va_of(arr, writable, "raw local_va argument", pin=(self._pin_key(), 1))
        if reg is not None:
            self._pinned.setdefault(threading.get_ident(), []).append(reg)
        return va

    @staticmethod
    def _pin_key() -> int:
        return -1 - threading.get_ident()

    def build_writes(self, which: npt.ArrayLike, *, rmt_va: np.ndarray | int, sge_len: np.ndarray | int,
                     sge_va: np.ndarray | int, flag: int = 0x20, opcode: int = Opcode.WRITE) -> np.ndarray:
        """``[n, 8] uint64`` one-BB WQEs, WQE i for ``queues[which[i]]`` (its TP, tokenId, EID and token)."""
        key = (int(flag), int(opcode))
        head = self._writes.get(key)
        if head is None:
            head = self._writes[key] = np.stack([
                q.build_writes(rmt_va=0, sge_len=0, sge_va=0, flag=key[0], opcode=key[1])[0, :5]
                for q in self.queues])
        which = np.asarray(which, np.intp)
        out = np.empty((len(which), 8), np.uint64)
        np.take(head, which, axis=0, out=out[:, :5])
        out[:, 5] = rmt_va
        out[:, 6] = np.asarray(sge_len, np.uint64) & np.uint64(0xFFFF_FFFF)
        out[:, 7] = sge_va
        return out

    def build_notifies(self, which: npt.ArrayLike, *, flag: int, rmt_va: np.ndarray | int, sge_len: np.ndarray | int,
                       sge_va: np.ndarray | int, notify_va: np.ndarray | int,
                       notify_value: np.ndarray | int) -> np.ndarray:
        """``[n, 16] uint64`` WRITE_WITH_NOTIFY WQEs (two BBs each), WQE i for ``queues[which[i]]``, its signal
        on that queue's peer heap (the notify tokenId and token of its ``remote_mem_info``)."""
        key = int(flag)
        tmpl = self._notifies.get(key)
        if tmpl is None:
            rows = []
            for q in self.queues:
                info = q.remote_mem_info
                rows.append(np.frombuffer(q.build(Opcode.WRITE_WITH_NOTIFY, key, 0, sge_len=0, sge_va=0,
                                                  notify_tid=int(info["tid"]),
                                                  notify_token=int(info["rmt_token_value"]), notify_va=0,
                                                  notify_value=0), np.uint64))
            tmpl = self._notifies[key] = np.stack(rows)
        which = np.asarray(which, np.intp)
        out = np.take(tmpl, which, axis=0)
        out[:, 5] = rmt_va
        ctx, sge = NOTIFY_CTX_OFFSET // 8, NOTIFY_SGE_OFFSET // 8
        out[:, ctx + 1] = notify_va
        out[:, ctx + 2] = np.asarray(notify_value, np.int64).astype(np.uint64)
        out[:, sge] = np.asarray(sge_len, np.uint64) & np.uint64(0xFFFF_FFFF)
        out[:, sge + 1] = sge_va
        return out

    def post(self, which: npt.ArrayLike, bbs: npt.ArrayLike, wqes: np.ndarray | bytes, *, cqes: npt.ArrayLike) -> None:
        """Post segment after segment of ``wqes`` (whole BBs, ``[n, 8] uint64`` or bytes): segment i is the next
        ``bbs[i]`` BBs, for ``queues[which[i]]``, ``cqes[i]`` of them with a CQE, with one doorbell: what
        ``queues[which[i]].post`` of it does, in that order."""
        data = np.frombuffer(wqes, np.uint8) if isinstance(wqes, (bytes, bytearray)) else np.asarray(wqes)
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        which = np.asarray(which, np.intp)
        bbs = np.ascontiguousarray(bbs, np.int64)
        cqes = np.ascontiguousarray(cqes, np.int64)
        if not (len(which) == len(bbs) == len(cqes)) or int(bbs.sum()) * 64 != data.nbytes:
            raise ValueError(f"RawQueues.post: {len(which)} queues, {len(bbs)} BB counts, {len(cqes)} CQE counts "
                             f"and {data.nbytes} bytes of WQEs ({int(bbs.sum())} BBs expected) do not match")
        heads = np.zeros(len(which), np.int64)
        done = 0
        if len(which):
            done = self._udma.poster.wqes_many(np.ascontiguousarray(self.index[which]), bbs, cqes, data, heads, Api.RAW,
                                    thread_slot())
        if done < len(which):
            at = int(bbs[:done].sum()) * 64
            for i in range(done, len(which)):
                n = int(bbs[i]) * 64
                heads[i] = self.queues[int(which[i])].post(data[at:at + n], cqes=int(cqes[i]))
                at += n
        pinned = self._pinned.pop(threading.get_ident(), None)  # (after the posts: see local_va)
        if pinned:  # as ring_doorbell: used by WQEs up to each queue's new head at most
            uses = dict(zip(self.index[which].tolist(), heads.tolist()))
            key = self._pin_key()
            with self._udma.registry._lock:  # a collect of another thread may be reading the uses
                for reg in pinned:
                    reg.uses.update(uses)
                    reg.uses.pop(key, None)

    def quiet(self, which: npt.ArrayLike) -> None:
        """``aclshmemx_udma_qp_quiet`` of ``queues[which[0]]``, ``queues[which[1]]``, ... in that order: by one
        native call as long as each queue's CQEs are all in (or come within a quiet's spin) and none failed, with
        one retire step for all of them; any other queue (and those after it) by the quiet call itself, which
        waits asleep and raises on an error CQE. Either way each queue's quiet is one quiet event and one quiet in
        the counters."""
        which = np.asarray(which, np.intp)
        done = 0
        udma = self._udma
        chaos = udma.rt.chaos
        if chaos is not None:
            chaos.jitter()
        if len(which):
            done = udma.quiet_many_fast(np.ascontiguousarray(self.index[which]), WaitCall.QP_QUIET)
        if chaos is not None:
            chaos.jitter()
        if done < len(which):
            for i in which[done:].tolist():
                q = self.queues[i]
                aclshmemx_udma_qp_quiet(q.peer, q.qp_idx)


def aclshmemx_udma_raw_queue(pe: int, qp_idx: int = 0) -> RawQueue:
    """Raw access to this PE's queue pair to ``pe`` / ``qp_idx``."""
    rt = runtime()
    return RawQueue(rt.udma.qp(*check_target(rt, "aclshmemx_udma_raw_queue", pe, qp_idx)))
