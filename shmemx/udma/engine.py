"""The DMA engine: one thread per PE that executes the WQEs its kernel threads post.

Who does what: kernel threads own posting (they write WQEs and ring doorbells, ``queues``); the engine owns
execution. It sleeps on a queue of rung doorbells (a ``SimpleQueue``: no polling, and a post to an already
queued SQ costs one flag test), then serves the SQs round-robin, at most ``BATCH_BBS`` BBs of one SQ per turn.
Within an SQ it executes strictly in order, so the ordering rules (SO, fence) hold trivially; different SQs are
unordered with respect to each other, as on the hardware.

For each WQE the engine resolves the target before touching memory: the EID must name a PE of the job, the TP
must be this PE's transport to that PE, the tokenId must name the target's heap segment and the token value
match it, the whole remote range must lie inside the segment, and the SGE's local range must be registered
memory of this PE. Otherwise nothing is written and the queue goes into error: the failing WQE gets an error CQE
(if it asked for one) with a status from ``layout.CqeStatus``, every later WQE of that queue is flushed (not
executed; FLUSHED CQEs), and the next quiet, barrier or finalize raises ``CompletionError`` with the decoded CQE
and WQE. An unexpected exception while executing a WQE is handled the same way (ENGINE_FAULT, with the
traceback in the message); the engine thread itself never dies silently.

A CQE is written only after the WQE's effects are in the target memory (stores are ordered on x86), and within
a CQE the owner word is written last. WRITE_WITH_NOTIFY writes the payload, then the 64-bit signal (an atomic
exchange), then the CQE. FAA, CAS and the fp32 reduce are atomic per target word across all engines (libatomic).

Speed: runs of one-BB WRITEs or READs are validated and copied with numpy in one go (rows when lengths and
offsets are aligned, else one byte gather/scatter), and their CQEs written in one assignment; the per-WQE path
(``_check`` + ``_run``) is the reference that also produces every error message. A run whose WQEs all carry the
queue's own peer, TP, tokenId and token (what ``post_rw`` writes) needs only its flag, ranges and local buffers
checked (``_vector_own``); its CQEs are built before the copies and stored after them, because large copies evict
the caches and every numpy call after them costs 15-30 us. When it runs out of rung work
(or every ``WAKE_EVERY`` turns while SQs stay busy) the engine bumps the wake word of every PE it wrote into, and
its own when it wrote CQEs: a wake-up of a sleeping thread costs the waker ~20 us, so it is paid once per burst.
"""

from __future__ import annotations

import collections
import queue
import struct
import threading
import time
import traceback

import numpy as np

from ..shm import atomics
from ..shm.heap import HEAP_VA_BASE, HEAP_VA_STRIDE
from ..shm.waits import ENGINE_SLOT, set_thread_slot
from .layout import (C_STATUS, FLAG_BYTE, M32, MAX_MSG_BYTES, OPCODE_BYTE, Q_EID_HI, Q_EID_LO, Q_RMT_VA, Q_SGE_VA,
                     REDUCE_FLAG, REMOTE_JETTY_TYPE, W_DW0, W_DW1, W_SGE_LEN, W_SEG, W_TOKEN, W_TP, CqeStatus, Opcode,
                     Wqe, cqe_owner, cqe_rows, cqe_status_word, cqe_words, decode_wqe, flag_of, jetty_type_of, opcode_of,
                     seg_id_of, sge_num_of, tp_id_of, tp_word, wqe_bbs)
from .segment import HW_CI, HW_CQ_PI, HW_SQ_DB, HW_STATE

__all__ = ["Engine", "BATCH_BBS"]

BATCH_BBS = 4096  # BBs of one SQ per turn (round-robin fairness)
WAKE_EVERY = 8  # turns between wake-ups of the PEs written into, while SQs still have work (a wake costs ~20 us)
VEC_MIN = 8  # shorter runs take the per-WQE path
_WRITE, _READ, _NOP = int(Opcode.WRITE), int(Opcode.READ), int(Opcode.NOP)
_FP32, _REDUCE_ADD = 0x7, 0xA
_EXECUTED = {Opcode.WRITE, Opcode.READ, Opcode.WRITE_WITH_NOTIFY, Opcode.FAA, Opcode.CAS, Opcode.NOP}


class _Fault(Exception):
    def __init__(self, status: CqeStatus, detail: str, substatus: int = 0):
        super().__init__(detail)
        self.status = status
        self.substatus = substatus
        self.detail = detail


class Engine:
    """The DMA engine of one PE (see the module docstring)."""

    def __init__(self, udma):
        self.udma = udma
        self.rt = udma.rt
        self.my_pe = udma.my_pe
        self.n_pes = udma.rt.n_pes
        self.heap = udma.rt.heap
        self.heap_size = self.heap.size
        self.registry = udma.registry
        self.tp_base = udma.tp_base
        self.qp_num = udma.qp_num
        self.peers = udma.peers  # identity dicts of every PE
        self.eid_lo = np.array([p["eid_lo"] for p in self.peers], np.uint64)
        self.eid_hi = np.array([p["eid_hi"] for p in self.peers], np.uint64)
        self.tids = np.array([p["heap_tid"] for p in self.peers], np.uint32)
        self.tokens = np.array([p["heap_token"] for p in self.peers], np.uint32)
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.touched: set[int] = set()
        self.thread = threading.Thread(target=self._main, name=f"shmemx-engine-pe{self.my_pe}", daemon=True)
        self.running = False
        self.trace = None  # array('q'): (start ns, end ns, queue index, first BB, BBs) per turn (observe.trace)
        self._gate = threading.Event()  # cleared by pause(): a debugging hook that stalls every queue
        self._gate.set()

    # --- lifecycle -----------------------------------------------------------------------------------------

    def start(self) -> None:
        self.running = True
        self.thread.start()

    def stop(self) -> None:
        if self.running:
            self.running = False
            self._gate.set()
            self.q.put(None)
            self.thread.join(timeout=10)

    def pause(self) -> None:
        """Execute nothing until ``resume()``; doorbells still ring and queue up. For tests and debugging: it makes
        posted WQEs stay in their SQs deterministically (``shmemx dump`` shows them; a quiet waits)."""
        self._gate.clear()

    def resume(self) -> None:
        self._gate.set()

    def notify(self, qp) -> None:
        """A doorbell rang on ``qp`` (called by the posting thread after it stored the doorbell)."""
        if not qp.queued:
            qp.queued = True
            self.q.put(qp)

    def _main(self) -> None:
        set_thread_slot(ENGINE_SLOT)
        try:
            self._loop()
        except BaseException as exc:  # never die silently: every waiter of this PE learns of it
            self.udma.dead = (exc, traceback.format_exc())
            self.rt.ctl.wake(self.my_pe)

    def _loop(self) -> None:
        active: collections.deque = collections.deque()
        stopping = False
        turns = 0
        while True:
            if not active:
                if stopping:
                    return
                try:
                    item = self.q.get(timeout=0.5)
                except queue.Empty:
                    self._scan(active)
                    continue
                if item is None:
                    stopping = True
                    continue
                active.append(item)
            while True:
                try:
                    item = self.q.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stopping = True
                else:
                    active.append(item)
            if not self._gate.is_set():
                self._gate.wait()
            qp = active.popleft()
            qp.queued = False
            if self._service(qp) and not qp.queued:
                qp.queued = True
                active.append(qp)
            turns += 1
            if not active or turns >= WAKE_EVERY:
                self._flush_wakes()
                turns = 0

    def _scan(self, active) -> None:
        """Backstop for doorbells stored without ``notify`` (a raw store into the doorbell word)."""
        hw = self.udma.seg.hw32
        for i in np.flatnonzero(hw[:, HW_SQ_DB] != hw[:, HW_CI]):
            qp = self.udma.qps.get(int(i))
            if qp is not None and not qp.queued:
                qp.queued = True
                active.append(qp)

    def _flush_wakes(self) -> None:
        touched, self.touched = self.touched, set()
        for pe in touched:
            self.rt.ctl.wake(pe)

    # --- one turn on one SQ --------------------------------------------------------------------------------

    def _service(self, qp) -> bool:
        """Execute up to BATCH_BBS rung BBs of ``qp``; True when more remain."""
        db = int(qp.hw32[HW_SQ_DB])
        n = (db - qp.ci) & M32
        if n == 0:
            return False
        if n > qp.depth:
            self._fail(qp, qp.ci, CqeStatus.ENGINE_FAULT,
                       f"doorbell {db} is {n} BBs past the consumer index {qp.ci}, more than the ring depth "
                       f"{qp.depth}: the doorbell word was corrupted; the queue's WQEs were dropped")
            qp.ci = db
            qp.hw32[HW_CI] = db
            return False
        n = min(n, BATCH_BBS)
        ci = qp.ci
        start = time.perf_counter_ns() if self.trace is not None else 0
        first = ci & qp.mask
        if first + n <= qp.depth:  # no wrap: a view (slots stay put until the engine retires them)
            hdr = qp.sq32[first:first + n]
        else:
            hdr = qp.sq32[(ci + np.arange(n)) & qp.mask]
        ops = opcode_of(hdr[:, W_DW1])
        reduce = flag_of(hdr[:, W_DW0]) & REDUCE_FLAG
        i = 0
        while i < n:
            if qp.error is not None:
                i += self._flush(qp, ci + i, n - i)
                break
            op = int(ops[i])
            if op in (_WRITE, _READ) and not reduce[i]:
                same = (ops[i:] == op) & (reduce[i:] == 0)
                j = n if same.all() else i + int(np.argmin(same))
                if j - i >= VEC_MIN:
                    try:
                        i += self._vector_rw(qp, ci + i, hdr[i:j], op)
                    except Exception:  # a shmemx bug: an error CQE and a queue in error, not a dead engine
                        self._fail(qp, (ci + i) & M32, CqeStatus.ENGINE_FAULT, "unexpected exception in the DMA "
                                   "engine's vectorised path (a shmemx bug):\n" + traceback.format_exc())
                        i += 1  # that WQE failed; the loop flushes the rest of the turn
                    continue
            bbs = wqe_bbs(op)
            if i + bbs > n:
                break  # the rest of this WQE is not rung yet
            self._scalar(qp, (ci + i) & M32)
            i += bbs
        qp.ci = (ci + i) & M32
        qp.hw32[HW_CI] = qp.ci
        if start:
            self.trace.extend((start, time.perf_counter_ns(), qp.index, ci, i))
        return qp.ci != (int(qp.hw32[HW_SQ_DB]) & M32)

    def _flush(self, qp, pos: int, n: int) -> int:
        """Complete ``n`` rung BBs from ``pos`` without executing them (the queue is in error)."""
        i = 0
        while i < n:
            raw = qp.wqe_at((pos + i) & M32)
            bbs = wqe_bbs(raw[OPCODE_BYTE])
            if i + bbs > n:
                break
            if raw[FLAG_BYTE] >> 5 & 1:
                w = decode_wqe(raw)
                self._cqe(qp, (pos + i) & M32, bbs, w.opcode, CqeStatus.FLUSHED, 0, 0, w.rmt_eid)
            i += bbs
        return i

    # --- the per-WQE path (the reference) -----------------------------------------------------------------

    def _scalar(self, qp, pos: int) -> None:
        w = decode_wqe(qp.wqe_at(pos))
        try:
            target = self._check(qp, w)
            byte_cnt, data = self._run(w, target)
        except _Fault as f:
            self._fail(qp, pos, f.status, f.detail, f.substatus, w)
            return
        except Exception:
            self._fail(qp, pos, CqeStatus.ENGINE_FAULT,
                       "unexpected exception in the DMA engine (a shmemx bug):\n" + traceback.format_exc(), 0, w)
            return
        self._account(qp, 1, byte_cnt)
        if w.flag >> 5 & 1:
            self._cqe(qp, pos, w.bbs, w.opcode, 0, 0, byte_cnt, w.rmt_eid, data)

    def _fail(self, qp, pos: int, status: CqeStatus, detail: str, substatus: int = 0, w: Wqe | None = None) -> None:
        first = qp.error is None
        if first:
            qp.error = {"pos": pos, "status": int(status), "substatus": substatus, "detail": detail}
            qp.hw32[HW_STATE] = 1
            hw = qp.udma.seg.hw[qp.index]
            hw["err_status"], hw["err_substatus"], hw["err_pos"] = int(status), substatus, pos
        if w is None:
            w = decode_wqe(qp.wqe_at(pos))
        if w.flag >> 5 & 1:
            self._cqe(qp, pos, w.bbs, w.opcode, int(status), substatus, 0, w.rmt_eid)
        if first:  # published after the CQE, so a barrier that sees the failure also finds its CQE
            self.udma.errors.add(qp.index)
        self.touched.add(self.my_pe)

    def _check(self, qp, w: Wqe) -> dict:
        """Resolve a WQE's target and local ranges; raise ``_Fault`` naming what is wrong."""
        if w.opcode not in _EXECUTED:
            raise _Fault(CqeStatus.BAD_OPCODE, f"opcode {w.opcode:#x} ({w.opcode_name}) is not executed by shmemx")
        if w.opcode == _NOP:
            return {}
        if w.sge_num != 1 or w.rmt_jetty_type != 1:
            raise _Fault(CqeStatus.BAD_OPCODE, f"malformed WQE: sge_num {w.sge_num} (must be 1), rmt_jetty_type "
                                               f"{w.rmt_jetty_type} (must be 1)")
        pe = w.rmt_eid & M32
        if pe >= self.n_pes or int(self.eid_lo[pe]) | int(self.eid_hi[pe]) << 64 != w.rmt_eid:
            raise _Fault(CqeStatus.BAD_EID, f"remote EID {w.rmt_eid:#034x} names no PE of this job")
        tp = w.tp_id - self.tp_base
        if not 0 <= tp < self.n_pes * self.qp_num or tp // self.qp_num != pe:
            owner = f"pe {tp // self.qp_num} qp {tp % self.qp_num}" if 0 <= tp < self.n_pes * self.qp_num else \
                "no transport"
            raise _Fault(CqeStatus.BAD_TP, f"tp_id {w.tp_id:#x} is {owner} of pe {self.my_pe}, not a transport to "
                                           f"pe {pe} (the EID's PE)")
        if w.sge_len > MAX_MSG_BYTES:
            raise _Fault(CqeStatus.LENGTH_TOO_LARGE, f"length {w.sge_len} B is over the 256 MiB limit of one request")
        self._check_segment(pe, w.rmt_seg_id, w.rmt_token_value, w.rmt_va, w.sge_len, "remote")
        local = self.registry.resolve(w.sge_va, w.sge_len)
        if local is None:
            raise _Fault(CqeStatus.LOCAL_ACCESS, f"local range {w.sge_va:#x}..{w.sge_va + w.sge_len:#x} is not "
                                                 f"registered memory of pe {self.my_pe}")
        target = {"pe": pe, "off": w.rmt_va - HEAP_VA_BASE - pe * HEAP_VA_STRIDE, "local": local}
        if w.opcode == Opcode.WRITE_WITH_NOTIFY:
            self._check_segment(pe, w.notify_tid, w.notify_token, w.notify_va, 8, "signal")
            if w.notify_va % 8:
                raise _Fault(CqeStatus.BAD_ATOMIC, f"signal address {w.notify_va:#x} is not 8-byte aligned")
            target["sig_off"] = w.notify_va - HEAP_VA_BASE - pe * HEAP_VA_STRIDE
        elif w.opcode in (Opcode.FAA, Opcode.CAS) or w.flag & REDUCE_FLAG:
            if w.sge_len not in (4, 8) or w.rmt_va % w.sge_len:
                raise _Fault(CqeStatus.BAD_ATOMIC, f"atomic of {w.sge_len} B at {w.rmt_va:#x}: size must be 4 or 8 "
                                                   f"and the target aligned to it")
            if w.flag & REDUCE_FLAG and (w.reduce_dtype, w.reduce_op, w.sge_len) != (_FP32, _REDUCE_ADD, 4):
                raise _Fault(CqeStatus.BAD_ATOMIC, f"reduce dtype {w.reduce_dtype:#x} op {w.reduce_op:#x}: only fp32 "
                                                   f"add (dtype 0x7, op 0xa, 4 bytes) is supported")
        return target

    def _check_segment(self, pe: int, tid: int, token: int, va: int, length: int, what: str) -> None:
        if tid != int(self.tids[pe]):
            raise _Fault(CqeStatus.BAD_TOKEN_ID, f"{what} tokenId {tid:#x} is no segment registered on pe {pe} "
                                                 f"(its heap is tokenId {int(self.tids[pe]):#x})")
        if token != int(self.tokens[pe]):
            raise _Fault(CqeStatus.TOKEN_MISMATCH, f"{what} token value {token:#010x} does not match segment tid "
                                                   f"{tid:#x} of pe {pe}")
        base = HEAP_VA_BASE + pe * HEAP_VA_STRIDE
        if not (base <= va and va + length <= base + self.heap_size):
            raise _Fault(CqeStatus.REMOTE_OUT_OF_BOUNDS,
                         f"{what} range {va:#x}..{va + length:#x} outside segment tid {tid:#x} of pe {pe} "
                         f"({base:#x}..{base + self.heap_size:#x}, len {self.heap_size:#x})")

    def _run(self, w: Wqe, t: dict) -> tuple[int, int]:
        """Execute a checked WQE; returns (byte count, fetched value)."""
        op, n = w.opcode, w.sge_len
        if op == _NOP:
            return 0, 0
        pe, off = t["pe"], t["off"]
        remote = self.heap.segments[pe].bytes
        local, loff = t["local"]
        if op == _READ:
            local[loff:loff + n] = remote[off:off + n]
            self.touched.add(self.my_pe)
            return n, 0
        self.touched.add(pe)
        addr = self.heap.segments[pe].addr + off
        if op == _WRITE and w.flag & REDUCE_FLAG:
            (operand,) = struct.unpack_from("<f", local, loff)
            old = _fp32_add(addr, operand)
            return n, old
        if op == _WRITE:
            remote[off:off + n] = local[loff:loff + n]
            return n, 0
        if op == Opcode.WRITE_WITH_NOTIFY:
            remote[off:off + n] = local[loff:loff + n]
            atomics.exchange(self.heap.segments[pe].addr + t["sig_off"], w.notify_value, 8)
            return n, 0
        fmt = "<Q" if n == 8 else "<I"
        if op == Opcode.FAA:
            old = atomics.fetch_op("add", addr, w.operand, n)
        else:
            old = atomics.compare_exchange(addr, w.compare, w.operand, n)
        struct.pack_into(fmt, local, loff, old)
        self.touched.add(self.my_pe)
        return n, old

    # --- the vector path: a run of one-BB WRITEs or READs -------------------------------------------------

    def _vector_rw(self, qp, pos: int, rows: np.ndarray, op: int) -> int:
        """Validate and execute a run; stops before the first WQE that fails (the per-WQE path takes it)."""
        if (rows[:, W_TP:W_TOKEN + 1] == self._own_words(qp)).all():
            done = self._vector_own(qp, pos, rows, op)
            if done:
                return done
        k = len(rows)
        w64 = rows.view(np.uint64)
        eid_lo, eid_hi, rva, lva = w64[:, Q_EID_LO], w64[:, Q_EID_HI], w64[:, Q_RMT_VA], w64[:, Q_SGE_VA]
        length = rows[:, W_SGE_LEN].astype(np.int64)
        pe = (eid_lo & np.uint64(M32)).astype(np.int64)
        known = pe < self.n_pes
        pec = np.where(known, pe, 0)
        tp = tp_id_of(rows[:, W_TP]).astype(np.int64) - self.tp_base
        base = HEAP_VA_BASE + pec * HEAP_VA_STRIDE
        roff = rva.astype(np.int64) - base
        ok = (known & (self.eid_lo[pec] == eid_lo) & (self.eid_hi[pec] == eid_hi)
              & (sge_num_of(rows[:, W_TP]) == 1) & (jetty_type_of(rows[:, W_DW0]) == REMOTE_JETTY_TYPE)
              & (tp >= 0) & (tp // self.qp_num == pec)
              & (seg_id_of(rows[:, W_SEG]) == self.tids[pec]) & (rows[:, W_TOKEN] == self.tokens[pec])
              & (roff >= 0) & (roff + length <= self.heap_size) & (length <= MAX_MSG_BYTES))
        bufs, loff, lok = self._resolve_local(lva, length)
        ok &= lok
        good = k if ok.all() else int(np.argmin(ok))
        if good == 0:
            return 0 if k == 0 else self._scalar_count(qp, pos)
        sl = slice(0, good)
        return self._execute(qp, pos, rows[sl], op, length[sl], eid_lo[sl], eid_hi[sl],
                             lambda: self._copy_groups(op, pec[sl], roff[sl], bufs[sl], loff[sl], length[sl]))

    def _own_words(self, qp) -> np.ndarray:
        """Words 2-8 (TP and sge_num, tokenId, EID, token value) of a WQE to ``qp``'s peer through ``qp``'s own
        TP, from this engine's tables (not from the queue's remote_mem_info, which a test may corrupt)."""
        words = qp.own_words
        if words is None:
            pe = qp.peer
            tp = self.tp_base + pe * self.qp_num + qp.qp_idx
            lo, hi = int(self.eid_lo[pe]), int(self.eid_hi[pe])
            words = qp.own_words = np.array([tp_word(tp), int(self.tids[pe]), lo & M32, lo >> 32, hi & M32,
                                             hi >> 32, int(self.tokens[pe])], np.uint32)
        return words

    def _vector_own(self, qp, pos: int, rows: np.ndarray, op: int) -> int:
        """The common run: every WQE went to ``qp``'s own peer through ``qp``'s own TP (what ``post_rw`` writes),
        so only the flag, ranges and local buffers are left to check, and one copy group does the run. Returns
        how many WQEs it executed: 0 when any WQE needs the general checks (``_vector_rw`` then does them).

        Fewer numpy calls than the general path: each costs 15-30 us when a large copy has just evicted the
        caches (a 1 MiB put loop runs this cold once per quiet)."""
        pe = qp.peer
        length = rows[:, W_SGE_LEN].astype(np.int64)
        w64 = rows.view(np.uint64)
        roff = w64[:, Q_RMT_VA].astype(np.int64) - (HEAP_VA_BASE + pe * HEAP_VA_STRIDE)
        ok = ((jetty_type_of(rows[:, W_DW0]) == REMOTE_JETTY_TYPE) & (roff >= 0) & (roff + length <= self.heap_size)
              & (length <= MAX_MSG_BYTES))
        if not ok.all():
            return 0
        bufs, loff, lok = self._resolve_local(w64[:, Q_SGE_VA], length)
        if not lok.all() or bufs[0] != bufs[-1] or (len(bufs) > 2 and not (bufs == bufs[0]).all()):
            return 0
        return self._execute(qp, pos, rows, op, length, self.eid_lo[pe:pe + 1], self.eid_hi[pe:pe + 1],
                             lambda: self._copy_group(op, pe, int(bufs[0]), roff, loff, length))

    def _execute(self, qp, pos: int, rows: np.ndarray, op: int, length: np.ndarray, eid_lo, eid_hi, copy) -> int:
        """Execute a validated run of ``len(rows)`` one-BB WQEs from BB ``pos``: ``copy()`` does their copies; the
        CQEs of the signaled ones are built before it (the caches are still warm) and stored after it (effects
        before CQEs). ``eid_lo`` / ``eid_hi``: per WQE, or one for all. Returns the number of WQEs."""
        signaled = np.flatnonzero(rows[:, W_DW0] & (0x20 << 16))
        if len(eid_lo) > 1:
            eid_lo, eid_hi = eid_lo[signaled], eid_hi[signaled]
        cqes = cqe_rows((pos + signaled) & M32, qp.tpn, length[signaled], eid_lo, eid_hi) if len(signaled) else None
        nbytes = int(length.sum())
        copy()
        if cqes is not None:
            self._store_cqes(qp, cqes, op)
        self._account(qp, len(rows), nbytes)
        return len(rows)

    def _scalar_count(self, qp, pos: int) -> int:
        self._scalar(qp, pos & M32)
        return 1

    def _resolve_local(self, lva: np.ndarray, length: np.ndarray):
        """Vectorised ``LocalRegistry.resolve``: (buffer id per WQE, offset, ok). Buffer ids: -1 heap, -2 amo,
        else an index into the registry snapshot."""
        reg = self.registry
        lv = lva.astype(np.int64)
        off = lv - reg.heap_va
        in_heap = (off >= 0) & (off + length <= self.heap_size)
        bufs = np.full(len(lv), -1, np.int64)
        if in_heap.all():
            return bufs, off, in_heap
        amo_off = lv - reg.amo_va
        in_amo = ~in_heap & (amo_off >= 0) & (amo_off + length <= reg.amo_bytes.nbytes)
        bufs[in_amo] = -2
        off = np.where(in_amo, amo_off, off)
        vas, regs = reg.snapshot
        ok = in_heap | in_amo
        if regs:
            starts = np.array(vas, np.int64)
            sizes = np.array([r.nbytes for r in regs], np.int64)
            j = np.searchsorted(starts, lv, side="right") - 1
            jc = np.maximum(j, 0)
            roff = lv - starts[jc]
            in_reg = ~ok & (j >= 0) & (roff + length <= sizes[jc])
            bufs[in_reg] = jc[in_reg]
            off = np.where(in_reg, roff, off)
            ok |= in_reg
        return bufs, off, ok

    def _local_buffer(self, buf_id: int) -> np.ndarray:
        if buf_id == -1:
            return self.heap.segments[self.my_pe].bytes
        if buf_id == -2:
            return self.registry.amo_bytes
        return self.registry.snapshot[1][buf_id].data

    def _copy_groups(self, op: int, pe, roff, bufs, loff, length) -> None:
        keys = pe * (1 << 20) + (bufs + 2)
        if keys.min() == keys.max():
            self._copy_group(op, int(pe[0]), int(bufs[0]), roff, loff, length)
            return
        for key in np.unique(keys):
            sel = np.flatnonzero(keys == key)
            self._copy_group(op, int(pe[sel[0]]), int(bufs[sel[0]]), roff[sel], loff[sel], length[sel])

    def _copy_group(self, op: int, tpe: int, buf_id: int, roff, loff, length) -> None:
        """The copies of WQEs that all target PE ``tpe``'s heap and all use local buffer ``buf_id``."""
        remote = self.heap.segments[tpe].bytes
        local = self._local_buffer(buf_id)
        same = tpe == self.my_pe and buf_id == -1
        if op == _WRITE:
            self.touched.add(tpe)
            _copy_many(remote, roff, local, loff, length, same=same)
        else:
            self.touched.add(self.my_pe)
            _copy_many(local, loff, remote, roff, length, same=same)

    # --- completions ---------------------------------------------------------------------------------------

    def _account(self, qp, wqes: int, nbytes: int) -> None:
        hw64 = qp.udma.hw64[qp.index]
        hw64[4] += wqes
        hw64[5] += nbytes

    def _cqe(self, qp, pos: int, bbs: int, opcode: int, status: int, substatus: int, byte_cnt: int, eid: int,
             data: int = 0) -> None:
        """Write one CQE: words 1-15, then word 0 with the owner bit (a poller that sees it sees the rest)."""
        pi = qp.cq_pi
        row = qp.cq32[pi % qp.cq_depth]
        row[1:] = cqe_words(pos=pos, bbs=bbs, tpn=qp.tpn, byte_cnt=byte_cnt, eid=eid, data=data)
        row[C_STATUS] = cqe_status_word(cqe_owner(pi, qp.cq_depth), opcode, status, substatus)
        qp.cq_pi = (pi + 1) & M32
        qp.hw32[HW_CQ_PI] = qp.cq_pi
        self.touched.add(self.my_pe)

    def _store_cqes(self, qp, rows: np.ndarray, opcode: int) -> None:
        """Append successful CQEs (``layout.cqe_rows``) to ``qp``'s CQ: words 1-15 of each, then its status word."""
        m = len(rows)
        pi, depth = qp.cq_pi, qp.cq_depth
        first = pi % depth
        if first + m <= depth:  # one lap of the CQ ring: slices, one status word for all
            qp.cq32[first:first + m, 1:] = rows[:, 1:]
            qp.cq32[first:first + m, C_STATUS] = cqe_status_word(cqe_owner(pi, depth), opcode)
        else:
            cpos = pi + np.arange(m, dtype=np.int64)
            slots = cpos % depth
            qp.cq32[slots, 1:] = rows[:, 1:]
            qp.cq32[slots, C_STATUS] = cqe_status_word(cqe_owner(cpos, depth), opcode).astype(np.uint32)
        qp.cq_pi = (pi + m) & M32
        qp.hw32[HW_CQ_PI] = qp.cq_pi
        self.touched.add(self.my_pe)


def _copy_many(dst: np.ndarray, dst_off, src: np.ndarray, src_off, length, *, same: bool) -> None:
    """``dst[dst_off[i]:+length[i]] = src[src_off[i]:+length[i]]`` for every i, in program order when it matters."""
    k = len(length)
    size = int(length[0]) if k else 0
    if k > 4 and not same and size > 0 and (length == size).all():
        steps = np.arange(k, dtype=np.int64) * size
        if (dst_off - int(dst_off[0]) == steps).all() and _gather_rows(dst, int(dst_off[0]), src, src_off, size):
            return  # one WQE per row into consecutive rows (a dispatch without aggregation): one numpy gather
    if k <= 4 or same or int(length.sum()) >= 4096 * k:
        for d, s, n in zip(dst_off.tolist(), src_off.tolist(), length.tolist()):
            dst[d:d + n] = src[s:s + n]
        return
    order = np.argsort(dst_off, kind="stable")
    d_sorted, l_sorted = dst_off[order], length[order]
    if (d_sorted[1:] < d_sorted[:-1] + l_sorted[:-1]).any():  # overlapping destinations: keep program order
        for d, s, n in zip(dst_off.tolist(), src_off.tolist(), length.tolist()):
            dst[d:d + n] = src[s:s + n]
        return
    size = int(length[0])
    if size > 0 and (length == size).all() and not (dst_off % size).any() and not (src_off % size).any():
        dst_rows = dst[: dst.size // size * size].reshape(-1, size)
        src_rows = src[: src.size // size * size].reshape(-1, size)
        dst_rows[dst_off // size] = src_rows[src_off // size]
        return
    starts = np.repeat(np.cumsum(length) - length, length)
    within = np.arange(int(length.sum()), dtype=np.int64) - starts
    dst[np.repeat(dst_off, length) + within] = src[np.repeat(src_off, length) + within]


def _gather_rows(dst: np.ndarray, d0: int, src: np.ndarray, src_off, size: int) -> bool:
    """``dst[d0 + i*size : +size] = src[src_off[i] : +size]`` as one ``np.take`` when the source offsets are
    whole rows apart (they are when every row comes from one array); False when they are not."""
    base = int(src_off.min())
    rel = src_off - base
    if (rel % size).any():
        return False
    rows = rel // size
    n_rows = (src.size - base) // size
    src_rows = src[base:base + n_rows * size].reshape(n_rows, size)
    np.take(src_rows, rows, axis=0, out=dst[d0:d0 + len(rows) * size].reshape(len(rows), size), mode="clip")
    return True


def _fp32_add(addr: int, operand: float) -> int:
    """Atomic ``*(float*)addr += operand`` by a CAS loop on the u32; returns the old bits."""
    pack, unpack = struct.Struct("<f"), struct.Struct("<I")
    while True:
        old_bits = atomics.fetch_op("or", addr, 0, 4)
        (old,) = struct.unpack("<f", unpack.pack(old_bits))
        (new_bits,) = unpack.unpack(pack.pack(np.float32(old + operand)))
        if atomics.compare_exchange(addr, old_bits, new_bits, 4) == old_bits:
            return old_bits
