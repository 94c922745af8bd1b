"""The UDMA data plane of one PE, wired together: its URMA identity, queue pairs, local registry and DMA engine.

``create`` (before init's barrier) makes the identity and the UDMA segment and publishes the identity in the
control segment; ``start`` (after the barrier) reads every peer's identity, fills the tables, makes the queue
pairs and starts the engine; ``stop`` stops the engine. The runtime calls these; kernels use the API (``api.rma``,
``api.udma_atomics``, ``api.raw``).
"""

from __future__ import annotations

import array
import os
import threading
import time
from collections.abc import ItemsView, Iterable, ValuesView
from typing import Any

import numpy as np

from ..errors import InternalError
from ..shm.waits import thread_slot
from . import _engine
from .describe import VaNames
from .engine import Engine
from .events import EventLog
from .layout import DW0
from .queues import QUIET_SPIN_FACTOR, QueuePair
from .registry import LocalRegistry, SharedLocals
from .segment import (CQ_TAIL, CREDIT_GUARD, HW_CI, HW_CQ_DB, HW_SQ_DB, HW_STATE, WQ_CQE_CNT, WQ_HEAD, WQ_TAIL,
                      UdmaSegment, default_depth, make_identity)

__all__ = ["DataPlane", "create", "start", "stop"]


def _depth(name: str, value) -> int:
    depth = int(value)
    if depth < 16 or depth > 65536 or depth & (depth - 1):
        raise ValueError(f"{name} must be a power of two in 16..65536, got {value!r}")
    return depth


class DataPlane:
    """This PE's data plane (one per process; ``rt.udma``)."""

    def __init__(self, rt: Any, sq_depth: int, cq_depth: int):
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
        self.qstate = np.zeros((self.seg.n_slots, _engine.ST_WORDS), np.int64)  # posting state (QueuePair, _post.c)
        self.qstate[:, _engine.ST_OWNER_BLOCK] = -1  # no submitter

        self.qwords = memoryview(self.qstate).cast("B").cast("q")
        self.poster = None  # the native posting path (_post.c), made at start
        self.array_type = None  # the heap arrays' ndarray subclass, if any (check.array.CheckedArray under --check)
        self.quiet_spin_ns = int(QUIET_SPIN_FACTOR * rt.spin * 1e9)
        self.qps = QueuePairs(self)  # made on first use
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
        if rt.hosts.multi:  # and the host's NIC too, for WQEs to other hosts' PEs
            self.shared_locals = SharedLocals(rt.job_id, rt.my_pe)
            engine_sink = self.registry.sink

            def sink(vas, lens, addrs):
                engine_sink(vas, lens, addrs)
                self.shared_locals.publish(vas, lens, addrs)

            self.registry.sink = sink
        self.poster = self._make_poster()
        self.observe(rt.events)
        if rt.tracer is not None:  # the engine's own records of its turns, for the trace
            self.engine.trace = rt.tracer.engine
        self.engine.start()

    def observe(self, events: EventLog | None) -> None:
        """Write posts and quiets into ``events`` (an ``events.EventLog``), or nothing (None). Observation never
        changes which code runs: the native path writes the events itself."""
        self.poster.set_events(None if events is None else events.native)

    def quiet_fast(self, pe: int, qp_idx: int, call: int) -> bool:
        """The quiet of (pe, qp_idx) by the native path (``Poster.quiet``) when every CQE is in (or comes within
        a quiet's spin) and none failed; False when ``QueuePair.poll`` must do it (waiting asleep, raising)."""
        start = time.perf_counter_ns()
        slot = thread_slot()
        bits = self.poster.quiet(pe, qp_idx, self.quiet_spin_ns, call, slot & 0xFF)
        if bits < 0:
            return False
        qp = self.qps[pe * self.qp_num + qp_idx]
        if bits & 1:
            self.retired(qp)
        if bits & 2:
            qp.release()  # publishes the counts
        elif qp.owner == threading.get_ident():
            qp.publish()
        self.rt.stats.add_quiet(slot, time.perf_counter_ns() - start)
        return True

    def quiet_many_fast(self, indices: np.ndarray, call: int) -> int:
        """``quiet_fast`` of the queues ``indices`` (int64 slot indices) in turn by one native call
        (``Poster.quiet_many``): one retire hook for all of them, the retired queues released together. Returns
        how many were quieted (a prefix; the caller quiets the rest through ``QueuePair.poll``); each counts as one
        quiet in the stats, as each quiet call does."""
        start = time.perf_counter_ns()
        slot = thread_slot()
        bits = np.zeros(len(indices), np.int64)
        done = self.poster.quiet_many(indices, bits, self.quiet_spin_ns, call, slot & 0xFF)
        if not done:
            return 0
        idx, bits = indices[:done], bits[:done]
        if (bits & 1).any():
            self.retired(None)
        self._publish_many(idx[(bits & 2) != 0], release=True)
        self._publish_many(idx[(bits & 2) == 0], release=False)
        self.rt.stats.add_quiet(slot, time.perf_counter_ns() - start, done)
        return done

    def claims(self, ident: int) -> np.ndarray:
        """The queues thread ``ident`` holds as their submitter (queue indices)."""
        return np.flatnonzero(self.qstate[:, _engine.ST_OWNER] == ident)

    def release_claims(self, idents: Iterable[int], ident: int = 0, kept: np.ndarray | None = None) -> None:
        """``QueuePair.release`` of every queue a thread of ``idents`` holds, and of those thread ``ident`` holds
        but for ``kept`` (its claims from before a launch), in one pass over the state block."""
        owners = self.qstate[:, _engine.ST_OWNER]
        mask = np.isin(owners, np.fromiter(idents, np.int64))
        if ident:
            mine = owners == ident
            if kept is not None:
                mine[kept] = False
            mask |= mine
        self._publish_many(np.flatnonzero(mask), release=True)

    def _publish_many(self, queues: np.ndarray, release: bool) -> None:
        """``QueuePair.publish`` of many queues at once (``release``: and ``QueuePair.release``: no owner); only
        queues the calling thread owns unless released (the quiet retired them to their heads)."""
        if not len(queues):
            return
        st, E = self.qstate, _engine
        if not release:
            queues = queues[st[queues, E.ST_OWNER] == threading.get_ident()]
        n, b, block = st[queues, E.ST_N_POSTED], st[queues, E.ST_B_POSTED], st[queues, E.ST_OWNER_BLOCK]
        d, c = st[queues, E.ST_DOORBELLS], st[queues, E.ST_CQES]
        st[queues, E.ST_N_POSTED] = st[queues, E.ST_B_POSTED] = st[queues, E.ST_DOORBELLS] = st[queues, E.ST_CQES] = 0
        if release:
            st[queues, E.ST_OWNER] = 0
            st[queues, E.ST_OWNER_BLOCK] = -1
        for slot in np.unique(block).tolist():
            sel = block == slot
            self.rt.stats.add_posted_many(max(slot, 0), queues[sel], n[sel], b[sel])
            self.rt.stats.add_counts(max(slot, 0), int(d[sel].sum()), int(c[sel].sum()))

    def _make_poster(self):
        """The native posting path (its reading of numpy arrays checked against this numpy's own answers)."""
        rt = self.rt
        seg = self.seg
        n = seg.n_slots
        rmi = seg.remote_mem_info
        eid = np.array(rmi["eid"], np.uint64).reshape(n, 2)
        config = dict(
            wq_off=seg.wq32.ctypes.data - seg.segment.addr, sidecar_off=seg.sidecar_offset,
            heap_va=self.registry.heap_va, state_addr=self.qstate.ctypes.data, credit_guard=CREDIT_GUARD,
            dw0_base=DW0[0], wq_head=WQ_HEAD, wq_cqe_cnt=WQ_CQE_CNT, wq_tail_word=WQ_TAIL,
            cq_ctx_off=seg.cq32.ctypes.data - seg.segment.addr, cq_tail_word=CQ_TAIL, hw_cq_db=HW_CQ_DB,
            tpn=[int(x) for x in rmi["tpn"]], tid=[int(x) for x in rmi["tid"]],
            token=[int(x) for x in rmi["rmt_token_value"]], eid_lo=[int(x) for x in eid[:, 0]],
            eid_hi=[int(x) for x in eid[:, 1]])
        poster = _engine.Poster(self.engine.native, np.ndarray, self.registry, self.qstate,
                                (np.dtype("<i8"), np.dtype("<u8")), config)
        if not _reads_arrays(poster):
            raise InternalError(f"pe {rt.my_pe}: the native posting path does not read numpy {np.__version__}'s "
                                f"arrays as numpy does (shmemx/udma/_post.c, NpArray): shmemx needs updating")
        if self.array_type is not None:
            poster.accept(self.array_type)
        heap = rt.heap

        def allocations(heap) -> None:
            starts = heap._alloc_starts
            poster.set_allocations(array.array("q", starts).tobytes(),
                                   array.array("q", [s + heap.allocations[s][0] for s in starts]).tobytes())

        heap.on_change = allocations
        allocations(heap)
        self.registry.seen = poster.seen
        return poster

    def stop(self) -> None:
        if self.rt.hosts.multi and self.engine is not None:
            self._drain_remote()
        if self.engine is not None:
            self.engine.stop()  # kept: a failure found afterwards is described through it

    def _drain_remote(self) -> None:
        """Wait until the host's NIC executed everything rung on the queues to other hosts' PEs (finalize's
        promise: the engine executes everything rung before the last barrier)."""
        remote = [q.index for q in self.qps.values() if not self.rt.hosts.local(q.peer)]
        if not remote:
            return
        hw = self.seg.hw32
        deadline = time.monotonic() + self.rt.timeout
        while (hw[remote, HW_CI] != hw[remote, HW_SQ_DB]).any() and time.monotonic() < deadline:
            time.sleep(0.0005)

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
            self.registry.collect(_Tails(self.qstate))

    def publish_counts(self, mine_only: bool = False) -> None:
        """Publish every queue's posted counts into the stats (``mine_only``: the queues this thread owns)."""
        me = threading.get_ident()
        for q in self.qps.values():
            if (q.n_posted or q.doorbells or q.cqes) and (not mine_only or q.owner == me):
                q.publish()

    def check_errors(self) -> None:
        """Raise a failure nobody has quieted yet (called by barriers and finalize): a queue whose engine record
        says it is in error."""
        for index in np.flatnonzero(self.seg.hw32[:, HW_STATE]).tolist():
            qp = self.qps.get(index)
            if qp is not None and qp.error is not None:
                qp.poll(qp.cq_pi, "barrier")  # consume what the engine completed; raises with the error CQE


class QueuePairs(dict):
    """This PE's ``QueuePair`` objects by queue index (peer * qp_num + qp_idx), each made when first asked for: a
    PE of a 256-PE job that talks to a few peers holds a few, not 255 x qp_num (their views and words cost ~3 KB
    and ~0.5 ms of start-up each). A queue's state lives in the plane's state block and the segment, not in the
    object, so one made late sees what the native posting path did on it. Iterating (``values``, ``items``) makes
    the object of every queue whose state block row shows use first, so that no used queue is missed."""

    def __init__(self, plane: DataPlane):
        super().__init__()
        self.plane = plane

    def __missing__(self, index: int) -> QueuePair:
        plane = self.plane
        if not isinstance(index, (int, np.integer)) or not 0 <= index < plane.seg.n_slots \
                or index // plane.qp_num == plane.my_pe:
            raise KeyError(index)
        q = self[int(index)] = QueuePair(plane, int(index) // plane.qp_num, int(index) % plane.qp_num)
        return q

    def get(self, index: int, default: QueuePair | None = None) -> QueuePair | None:
        try:
            return self[index]
        except KeyError:
            return default

    def _used(self) -> None:
        rows = self.plane.qstate.copy()
        rows[:, _engine.ST_OWNER_BLOCK] = 0
        for index in np.flatnonzero(rows.any(axis=1)).tolist():
            if index not in self:
                self[index]

    def values(self) -> ValuesView[QueuePair]:
        self._used()
        return super().values()

    def items(self) -> ItemsView[int, QueuePair]:
        self._used()
        return super().items()

    def __bool__(self) -> bool:
        return self.plane.seg.n_slots > self.plane.qp_num  # a PE with peers has queues, made or not


class _Tails:
    """Every queue's retired tail, read from the posting state block when asked (``LocalRegistry.collect`` asks
    for the queues its registrations used, at 256 PEs 255 of them at once): ``tails(queue indices)``, 0 for a
    key that is no queue (a pin of a thread's own, ``RawQueues.local_va``: never retired)."""

    __slots__ = ("column",)

    def __init__(self, qstate: np.ndarray):
        self.column = qstate[:, _engine.ST_TAIL]  # a view: the words as they are at the call

    def __call__(self, queues: np.ndarray) -> np.ndarray:
        column = self.column
        if len(queues) and 0 <= queues.min() and queues.max() < len(column):
            return column[queues]
        known = (queues >= 0) & (queues < len(column))
        return np.where(known, column[np.where(known, queues, 0)], 0)


def _reads_arrays(poster) -> bool:
    """Whether the native posting path reads numpy arrays as numpy does (data, shape, contiguity, dtype)."""
    base = np.arange(48, dtype=np.int64).reshape(6, 8)
    for arr in (base, base[2], base[1:, 3:], base[:, 1], np.zeros(0, np.uint8), np.frombuffer(bytes(64), np.uint16)):
        if poster.probe(arr) != (arr.__array_interface__["data"][0], arr.ndim, arr.shape,
                                 bool(arr.flags.c_contiguous), id(arr.dtype)):
            return False
    return True


def create(rt: Any) -> None:
    # as for the heap size: an argument of init beats the environment, which beats the default
    sq = _depth("sq_depth", rt.sq_depth or os.environ.get("SHMEMX_SQ_DEPTH") or default_depth(rt.n_pes, rt.qp_num))
    cq = _depth("cq_depth", rt.cq_depth or os.environ.get("SHMEMX_CQ_DEPTH") or sq)
    if cq < sq:
        raise ValueError(f"cq_depth {cq} must be at least sq_depth {sq}")
    rt.udma = DataPlane(rt, sq, cq)


def start(rt: Any) -> None:
    rt.udma.start()


def stop(rt: Any) -> None:
    if rt.udma is not None:
        rt.udma.stop()
