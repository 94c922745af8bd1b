"""The DMA engine: one native thread per PE that executes the WQEs its kernel threads post.

Who does what: kernel threads own posting (they write WQEs and ring doorbells, ``queues``); the engine owns
execution. The execution is native (``_engine.c``, built by ``pip install``): a thread that holds no interpreter
lock, so a PE's kernel blocks and its engine really run at the same time and a put_signal's signal lands
without waiting for a Python thread to be scheduled. It sleeps on a futex that every post kicks, then asks its
scheduler for the next work (normal policy: the SQs round robin, at most ``BATCH_BBS`` BBs of one SQ per turn,
each SQ strictly in order, so the ordering rules, SO and fence, hold trivially; different SQs are unordered with
respect to each other, as on the hardware).

For each WQE the engine resolves the target before touching memory: the EID must name a PE of the job, the TP
must be this PE's transport to that PE, the tokenId must name the target's heap segment and the token value
match it, the whole remote range must lie inside the segment, and the SGE's local range must be registered
memory of this PE (its heap, its amo scratch, or a local array that ``registry`` handed over with
``set_locals``). Otherwise nothing is written and the queue goes into error: the failing WQE gets an error CQE
(if it asked for one) with a status from ``layout.CqeStatus``, the queue's engine record (``segment.HW_DTYPE``)
names the status, the WQE's position and which check failed (``err_where``, a ``Where``), every later WQE of that
queue is flushed (FLUSHED CQEs), and the next quiet, barrier or finalize raises ``CompletionError``, whose detail
``describe_fault`` rebuilds here from the record, the WQE and the tables.

A CQE is written only after the WQE's effects are in the target memory, its owner word last. WRITE_WITH_NOTIFY
writes the payload, then the 64-bit signal (an atomic exchange), then the CQE. FAA, CAS and the fp32 reduce are
atomic per target word across all engines. When it runs out of rung work (or every ``WAKE_EVERY`` turns while
SQs stay busy) the engine bumps the wake word of every PE it wrote into, and its own when it wrote CQEs.

This module is the engine's Python side: it hands the native engine its layout (every word position, opcode and
status from ``layout`` and ``segment``: one home for each) and its tables, starts and stops it, and keeps the
hooks a test or a debugger needs (``pause`` / ``resume``, ``inject_fault``) and the trace's turn records.
"""

from __future__ import annotations

import array
import enum
from typing import Any

from ..shm.heap import HEAP_VA_BASE, HEAP_VA_STRIDE
from . import _engine
from .layout import (AMO_OPERAND_OFFSET, C_BYTE_CNT, C_DATA, C_EID, C_ENTRY_IDX, C_STATUS, C_TPN, C_USER_DATA,
                     M32, MAX_MSG_BYTES, NOTIFY_CTX_OFFSET, NOTIFY_SGE_OFFSET, OWNER_SHIFT, Q_EID_HI, Q_EID_LO,
                     Q_RMT_VA, Q_SGE_VA, REDUCE_FLAG, REMOTE_JETTY_TYPE, W_DW0, W_DW1, W_REDUCE, W_SEG, W_SGE_LEN,
                     W_TOKEN, W_TP, CqeStatus, Opcode, Wqe)
from .segment import (HW_BYTES, HW_CI, HW_CQ_PI, HW_ERR_ARG, HW_ERR_POS, HW_ERR_STATUS, HW_ERR_SUBSTATUS,
                      HW_ERR_WHERE, HW_EXECUTED, HW_SQ_DB, HW_STATE)

__all__ = ["Engine", "Where", "BATCH_BBS"]

BATCH_BBS = _engine.BATCH_BBS  # BBs of one SQ per turn (round-robin fairness)
WAKE_EVERY = _engine.WAKE_EVERY  # turns between wake-ups of the PEs written into while SQs still have work
_FP32, _REDUCE_ADD = 0x7, 0xA
_CQE_FLAG = 0x20


class Where(enum.IntEnum):
    """Which check a failed WQE failed (the engine record's ``err_where``; ``_engine.c``'s ``enum where``)."""

    NONE = 0
    OPCODE = 1
    MALFORMED = 2
    EID = 3
    TP = 4
    LENGTH = 5
    REMOTE = 6
    LOCAL = 7
    SIGNAL = 8
    SIGNAL_ALIGN = 9
    ATOMIC_SIZE = 10
    REDUCE = 11
    DOORBELL = 12
    INJECTED = 13


def native_layout() -> dict:
    """The word positions, opcodes and statuses the native engine works with, by name (from ``layout`` and
    ``segment``)."""
    st = CqeStatus
    return dict(
        w_dw0=W_DW0, w_dw1=W_DW1, w_tp=W_TP, w_seg=W_SEG, w_token=W_TOKEN, w_reduce=W_REDUCE, w_sge_len=W_SGE_LEN,
        q_eid_lo=Q_EID_LO, q_eid_hi=Q_EID_HI, q_rmt_va=Q_RMT_VA, q_sge_va=Q_SGE_VA, notify_ctx=NOTIFY_CTX_OFFSET,
        notify_sge=NOTIFY_SGE_OFFSET, amo_operand=AMO_OPERAND_OFFSET, c_status=C_STATUS, c_entry_idx=C_ENTRY_IDX,
        c_tpn=C_TPN, c_byte_cnt=C_BYTE_CNT, c_user_data=C_USER_DATA, c_eid=C_EID, c_data=C_DATA,
        owner_shift=OWNER_SHIFT, hw_sq_db=HW_SQ_DB, hw_ci=HW_CI, hw_cq_pi=HW_CQ_PI, hw_state=HW_STATE,
        hw_err_status=HW_ERR_STATUS, hw_err_substatus=HW_ERR_SUBSTATUS, hw_err_pos=HW_ERR_POS,
        hw_err_where=HW_ERR_WHERE, hw_err_arg=HW_ERR_ARG, hw_executed=HW_EXECUTED, hw_bytes=HW_BYTES,
        op_write=Opcode.WRITE, op_notify=Opcode.WRITE_WITH_NOTIFY, op_read=Opcode.READ, op_cas=Opcode.CAS,
        op_faa=Opcode.FAA, op_nop=Opcode.NOP, st_bad_opcode=st.BAD_OPCODE, st_bad_eid=st.BAD_EID,
        st_bad_tp=st.BAD_TP, st_bad_token_id=st.BAD_TOKEN_ID, st_token_mismatch=st.TOKEN_MISMATCH,
        st_out_of_bounds=st.REMOTE_OUT_OF_BOUNDS, st_local_access=st.LOCAL_ACCESS, st_length=st.LENGTH_TOO_LARGE,
        st_bad_atomic=st.BAD_ATOMIC, st_flushed=st.FLUSHED, st_engine_fault=st.ENGINE_FAULT,
        reduce_flag=REDUCE_FLAG, cqe_flag=_CQE_FLAG, jetty_type=REMOTE_JETTY_TYPE, fp32=_FP32,
        reduce_add=_REDUCE_ADD, max_msg=MAX_MSG_BYTES)


class Engine:
    """The DMA engine of one PE (see the module docstring); ``native`` is the thread's handle."""

    def __init__(self, udma: Any):
        rt = udma.rt
        seg = udma.seg
        self.udma = udma
        self.my_pe = udma.my_pe
        self.n_pes = rt.n_pes
        self.qp_num = udma.qp_num
        self.tp_base = udma.tp_base
        self.heap_size = rt.heap.size
        self.peers = udma.peers  # identity dicts of every PE
        self.tids = [p["heap_tid"] for p in self.peers]
        reg = udma.registry
        ctl = rt.ctl
        config = dict(
            seg_addr=seg.segment.addr, sq_off=seg.sq_offset, sq_bytes=seg.sq_bytes, cq_off=seg.cq_offset,
            cq_bytes=seg.cq_bytes, hw_off=seg.hw_offset, amo_off=seg.amo_offset, amo_len=reg.amo_bytes.nbytes,
            amo_va=reg.amo_va, sq_depth=seg.sq_depth, cq_depth=seg.cq_depth, n_slots=seg.n_slots,
            tp_base=self.tp_base, my_pe=self.my_pe, n_pes=self.n_pes, qp_num=self.qp_num, heap_size=self.heap_size,
            heap_va_base=HEAP_VA_BASE, heap_va_stride=HEAP_VA_STRIDE,
            spin_ns=int(rt.spin * 1e9),
            heap_addrs=[0 if s is None else s.addr for s in rt.heap.segments],
            eid_lo=[p["eid_lo"] for p in self.peers], eid_hi=[p["eid_hi"] for p in self.peers],
            tids=self.tids, tokens=[p["heap_token"] for p in self.peers],
            wake_addrs=list(ctl.wake_addrs), sleepers_addrs=list(ctl.sleepers_addrs))
        if rt.hosts.multi:  # the queues to other hosts' PEs are the host NIC's (udma/nic.py), not this engine's
            config["remote_pes"] = [int(not rt.hosts.local(p)) for p in range(self.n_pes)]
        self.native = _engine.Engine(native_layout(), config)
        self.kick = self.native.kick  # after a doorbell store: wake the engine if it sleeps (~60 ns)
        self._trace = None
        tracer = getattr(rt, "tracer", None)  # array('q') of the policy's decision records while tracing:
        self.decisions = tracer.decisions if tracer is not None else None  # (see ``trace``)
        self.running = False
        chaos = getattr(rt, "chaos", None)
        if chaos is not None:  # --chaos SEED drives the kernel threads' jitter and this scheduler alike
            self.set_policy("chaos", chaos.seed)

    # --- lifecycle -----------------------------------------------------------------------------------------

    def start(self) -> None:
        self.running = True
        self.native.start()

    def stop(self) -> None:
        """Execute everything rung, then end the thread (finalize raises a failure among it afterwards)."""
        if self.running:
            self.running = False
            self.native.stop()
            self.drain_trace()

    def pause(self) -> None:
        """Execute nothing until ``resume()``; doorbells still ring and queue up. For tests and debugging: it makes
        posted WQEs stay in their SQs deterministically (``shmemx dump`` shows them; a quiet waits). Returns once
        no turn is running."""
        self.native.pause()

    def resume(self) -> None:
        self.native.resume()

    def notify(self, qp: Any = None) -> None:
        """A doorbell rang (on ``qp``): wake the engine if it sleeps."""
        self.native.kick()

    @property
    def policy(self) -> str:
        """The scheduling policy's name (``round_robin``: the SQs in turn, each in order; ``chaos``)."""
        return self.native.policy

    def set_policy(self, name: str, seed: int = 0) -> None:
        """Install a scheduling policy of the native engine (``_engine.h``, struct policy, says how one plugs in):
        ``round_robin`` (the normal one) or ``chaos``, seeded by ``seed`` and this PE (``_chaos.c``: any WQE the
        ordering rules allow, PCT-style queue priorities, split transfers, held queues and peers)."""
        self.native.set_policy(name, int(seed) & (1 << 64) - 1)

    @property
    def coop_min(self) -> int:
        """WRITEs of at least this many bytes are copied by the engine thread and, at the same time, by a thread of
        this PE spinning in a quiet (``_engine.c``, coop_copy); 0 = never. 1 MiB by default when PEs do not
        outnumber cores (the quiets spin then), else 0."""
        return self.native.coop_min

    def set_coop(self, min_bytes: int) -> None:
        """Set ``coop_min`` (0 turns the cooperative copy off; for A/B measurements)."""
        self.native.set_coop(int(min_bytes))

    def inject_fault(self, count: int = 1) -> None:
        """Make the next ``count`` WQEs that pass their checks fail with ENGINE_FAULT (``Where.INJECTED``): the
        test hook for the engine's handling of its own faults (an error CQE, a queue in error, an engine that
        lives on)."""
        self.native.inject_fault(int(count))

    # --- the trace's engine-turn records --------------------------------------------------------------------

    @property
    def trace(self) -> array.array | None:
        """``array('q')`` of turn records (start ns, end ns, queue index, first BB, BBs), or None when off. An
        out-of-order policy writes one per WQE it completes (BBs = the WQE's) and one per earlier piece of a
        split WQE (BBs = 0); ``decisions`` gets its decision records (6 int64: ns, kind, queue, BB position, a,
        b; ``_chaos.c`` lists the kinds)."""
        self.drain_trace()
        return self._trace

    @trace.setter
    def trace(self, records: array.array | None) -> None:
        self._trace = records
        if records is not None and self.decisions is None:
            self.decisions = array.array("q")
        self.native.set_tracing(records is not None)

    def drain_trace(self) -> None:
        if self._trace is not None:
            self._trace.frombytes(self.native.take_trace())
        if self.decisions is not None:
            self.decisions.frombytes(self.native.take_log())

    # --- faults in words -----------------------------------------------------------------------------------

    def describe_fault(self, status: int, where: int, arg: int, pos: int, w: Wqe) -> str:
        """The detail of a failed WQE ``w`` at BB ``pos``, from its engine record (status, ``Where``, argument)."""
        where = Where(where) if where in Where._value2member_map_ else Where.NONE
        if where is Where.OPCODE:
            return f"opcode {w.opcode:#x} ({w.opcode_name}) is not executed by shmemx"
        if where is Where.MALFORMED:
            return (f"malformed WQE: sge_num {w.sge_num} (must be 1), rmt_jetty_type {w.rmt_jetty_type} "
                    f"(must be 1)")
        pe = w.rmt_eid & M32
        if where is Where.EID:
            return f"remote EID {w.rmt_eid:#034x} names no PE of this job"
        if where is Where.TP:
            tp = w.tp_id - self.tp_base
            owner = f"pe {tp // self.qp_num} qp {tp % self.qp_num}" if 0 <= tp < self.n_pes * self.qp_num else \
                "no transport"
            return f"tp_id {w.tp_id:#x} is {owner} of pe {self.my_pe}, not a transport to pe {pe} (the EID's PE)"
        if where is Where.LENGTH:
            return f"length {w.sge_len} B is over the 256 MiB limit of one request"
        if where is Where.REMOTE:
            return self._segment_fault(status, pe, w.rmt_seg_id, w.rmt_token_value, w.rmt_va, w.sge_len, "remote")
        if where is Where.SIGNAL:
            return self._segment_fault(status, pe, w.notify_tid, w.notify_token, w.notify_va, 8, "signal")
        if where is Where.LOCAL:
            return (f"local range {w.sge_va:#x}..{w.sge_va + w.sge_len:#x} is not registered memory of pe "
                    f"{self.my_pe}")
        if where is Where.SIGNAL_ALIGN:
            return f"signal address {w.notify_va:#x} is not 8-byte aligned"
        if where is Where.ATOMIC_SIZE:
            return f"atomic of {w.sge_len} B at {w.rmt_va:#x}: size must be 4 or 8 and the target aligned to it"
        if where is Where.REDUCE:
            return (f"reduce dtype {w.reduce_dtype:#x} op {w.reduce_op:#x}: only fp32 add (dtype 0x7, op 0xa, "
                    f"4 bytes) is supported")
        if where is Where.DOORBELL:
            depth = self.udma.seg.sq_depth
            return (f"doorbell {arg} is {(arg - pos) & M32} BBs past the consumer index {pos}, more than the ring "
                    f"depth {depth}: the doorbell word was corrupted; the queue's WQEs were dropped")
        if where is Where.INJECTED:
            return "unexpected fault in the DMA engine (a shmemx bug; here one injected by Engine.inject_fault)"
        return ""

    def _segment_fault(self, status: int, pe: int, tid: int, token: int, va: int, length: int, what: str) -> str:
        if status == CqeStatus.BAD_TOKEN_ID:
            return (f"{what} tokenId {tid:#x} is no segment registered on pe {pe} (its heap is tokenId "
                    f"{self.tids[pe]:#x})")
        if status == CqeStatus.TOKEN_MISMATCH:
            return f"{what} token value {token:#010x} does not match segment tid {tid:#x} of pe {pe}"
        base = HEAP_VA_BASE + pe * HEAP_VA_STRIDE
        return (f"{what} range {va:#x}..{va + length:#x} outside segment tid {tid:#x} of pe {pe} "
                f"({base:#x}..{base + self.heap_size:#x}, len {self.heap_size:#x})")

