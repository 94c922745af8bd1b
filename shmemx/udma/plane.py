"""The UDMA data plane of one PE, wired together: its URMA identity, queue pairs, local registry and DMA engine.

``create`` (before init's barrier) makes the identity and the UDMA segment and publishes the identity in the
control segment; ``start`` (after the barrier) reads every peer's identity, fills the tables, makes the queue
pairs and starts the engine; ``stop`` stops the engine. The runtime calls these; kernels use the API (``api.rma``,
``api.udma_atomics``, ``api.raw``).
"""

from __future__ import annotations

import os
import threading

import numpy as np

from .describe import VaNames
from .engine import Engine
from .queues import QueuePair
from .registry import LocalRegistry
from .segment import DEFAULT_DEPTH, HW_STATE, UdmaSegment, make_identity

__all__ = ["DataPlane", "create", "start", "stop"]


def _depth(name: str, value) -> int:
    depth = int(value)
    if depth < 16 or depth > 65536 or depth & (depth - 1):
        raise ValueError(f"{name} must be a power of two in 16..65536, got {value!r}")
    return depth


class DataPlane:
    """This PE's data plane (one per process; ``rt.udma``)."""

    def __init__(self, rt, sq_depth: int, cq_depth: int):
        self.rt = rt
        self.my_pe = rt.my_pe
        self.qp_num = rt.qp_num
        self.identity = make_identity(rt.my_pe)
        self.seg = UdmaSegment.create(rt.job_id, rt.my_pe, rt.n_pes, rt.qp_num, sq_depth, cq_depth,
                                      self.identity, rt.heap.size)
        self.tp_base = self.identity["tp_base"]
        self.va_names = VaNames(rt.n_pes, rt.ctl.describe_offset, self.seg.layout())
        self.hw64 = self.seg.hw32.view(np.uint64)
        self.words = memoryview(self.seg.segment.mm).cast("I")  # the whole segment as u32 words
        self.qps: dict[int, QueuePair] = {}
        self.peers: list[dict] = []
        self.registry: LocalRegistry | None = None
        self.engine = None
        self._threads: dict[int, threading.Thread] = {}
        me = rt.ctl.pes[rt.my_pe]
        me["eid"] = (self.identity["eid_lo"], self.identity["eid_hi"])
        me["heap_tid"], me["heap_token"] = self.identity["heap_tid"], self.identity["heap_token"]
        me["sq_depth"], me["cq_depth"] = sq_depth, cq_depth

    def start(self) -> None:
        rt = self.rt
        for p in range(rt.n_pes):
            e = rt.ctl.pes[p]
            lo, hi = (int(x) for x in e["eid"])
            self.peers.append({"eid_lo": lo, "eid_hi": hi, "heap_tid": int(e["heap_tid"]),
                               "heap_token": int(e["heap_token"])})
        self.seg.fill_tables(rt.my_pe, self.peers, rt.heap.size)
        self.registry = LocalRegistry(rt.my_pe, rt.heap, self.seg, int(self.seg.header["amo_tid"]))
        self.engine = Engine(self)
        self.registry.sink = self.engine.native.set_locals  # the engine resolves local VAs through the registrations
        for peer in range(rt.n_pes):
            if peer != rt.my_pe:
                for qp in range(self.qp_num):
                    q = QueuePair(self, peer, qp)
                    self.qps[q.index] = q
        if rt.tracer is not None:
            for q in self.qps.values():
                q.trace = rt.tracer.queue(q.index)
            self.engine.trace = rt.tracer.engine
        self.engine.start()

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.stop()  # kept: a failure found afterwards is described through it

    # --- lookups -------------------------------------------------------------------------------------------

    def qp(self, pe: int, qp_idx: int) -> QueuePair:
        return self.qps[pe * self.qp_num + qp_idx]

    def thread_alive(self, ident: int) -> bool:
        for t in threading.enumerate():
            if t.ident == ident:
                return True
        return False

    def describe_va(self, va: int) -> str:
        """``pe 3 heap +0x1200 ('recv_x'+0x200)`` for any emulated VA (``describe.VaNames``)."""
        return self.va_names.describe(va, self.my_pe)

    # --- completion bookkeeping ----------------------------------------------------------------------------

    def retired(self, qp: QueuePair) -> None:
        """A poller advanced ``qp``'s tail: registrations only it used may go."""
        if self.registry is not None and len(self.registry):
            self.registry.collect({i: q.tail for i, q in self.qps.items()})

    def publish_counts(self, mine_only: bool = False) -> None:
        """Publish every queue's posted counts into the stats (``mine_only``: the queues this thread owns)."""
        me = threading.get_ident()
        for q in self.qps.values():
            if q.n_posted and (not mine_only or q.owner == me):
                q.publish()

    def check_errors(self) -> None:
        """Raise a failure nobody has quieted yet (called by barriers and finalize): a queue whose engine record
        says it is in error."""
        for index in np.flatnonzero(self.seg.hw32[:, HW_STATE]).tolist():
            qp = self.qps.get(index)
            if qp is not None and qp.error is not None:
                qp.poll(qp.cq_pi, "barrier")  # consume what the engine completed; raises with the error CQE


def create(rt) -> None:
    # as for the heap size: an argument of init beats the environment, which beats the default
    sq = _depth("sq_depth", rt.sq_depth or os.environ.get("SHMEMX_SQ_DEPTH") or DEFAULT_DEPTH)
    cq = _depth("cq_depth", rt.cq_depth or os.environ.get("SHMEMX_CQ_DEPTH") or sq)
    if cq < sq:
        raise ValueError(f"cq_depth {cq} must be at least sq_depth {sq}")
    rt.udma = DataPlane(rt, sq, cq)


def start(rt) -> None:
    rt.udma.start()


def stop(rt) -> None:
    if rt.udma is not None:
        rt.udma.stop()
