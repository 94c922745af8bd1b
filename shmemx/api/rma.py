"""Remote memory access over UDMA: put, get, put_signal, quiet, defer/submit batching, and the MTE copies.

Every ``aclshmemx_udma_*`` call checks its arguments, builds a 64-byte WQE (EID, TP, tokenId, token value,
remote VA, SGE) from ``remote_mem_info[pe * qp_num + qp_idx]``, stores it in that queue's SQ ring and rings the
doorbell; it returns before anything moved (``_nbi``). Completion is only what a UDMA quiet says:
``aclshmemx_udma_quiet(pe)`` polls the CQ of (pe, QP 0) only, as on the hardware, and
``aclshmemx_udma_qp_quiet(pe, qp_idx)`` one QP. ``aclshmem_quiet()`` and ``aclshmem_fence()`` do NOT complete
UDMA work (in CANN SHMEM they flush caches and pipes only); they complete MTE copies, which are synchronous here.

Arguments: arrays replace pointers and counts are elements of the arrays' dtype (at most 256 MiB per request).
Put destinations and get sources are heap views (the symmetric address; the same offset on ``pe`` is used);
put sources and get destinations are this PE's heap views or C-contiguous local arrays (registered for the life
of the WQE). Bad input raises ``ValueError``/``TypeError`` naming the PE, peer, QP and range before anything is
posted. Keyword options: ``config`` (an ``OpConfig``: CQE, fence, ordering), ``batch`` (defer/submit),
``buf`` (UB scratch; the staging area of a defer batch), ``sync_id`` (accepted for fidelity; no pipes here).
"""

from __future__ import annotations

import numpy as np

from ..shm.control import WaitCall
from ..shm.heap import data_address
from ..shm.waits import thread_slot
from ..udma.layout import (ACLSHMEMX_UDMA_OP_CONFIG_DEFAULT, ACLSHMEMX_UDMA_OP_CONFIG_NO_CQE, M32, MAX_MSG_BYTES,
                           Opcode, OpConfig)
from ..udma.check.array import CheckedArray
from ..udma.rings import Api
from ..runtime import runtime
from . import mte_strided
from .checks import check_config, check_pe, check_target, symmetric_offset, transfer_bytes

__all__ = [
    "aclshmemx_udma_put_nbi",
    "aclshmemx_udma_get_nbi",
    "aclshmemx_udma_qp_put_nbi",
    "aclshmemx_udma_qp_get_nbi",
    "aclshmemx_udma_put_signal_nbi",
    "aclshmemx_udma_qp_put_signal_nbi",
    "aclshmemx_udma_quiet",
    "aclshmemx_udma_qp_quiet",
    "aclshmemx_submit_state_t",
    "aclshmemx_defer_t",
    "aclshmemx_submit_t",
    "aclshmem_quiet",
    "aclshmem_fence",
    "aclshmemx_mte_put_nbi",
    "aclshmemx_mte_get_nbi",
    "aclshmemx_mte_quiet",
]


# --- argument checks ---------------------------------------------------------------------------------------

_CALLS = {api: api.call for api in Api}
_READ = int(Opcode.READ)
_FAST = True  # the inline sufficient conditions (tests turn them off to run every case through the checks)
_ARRAYS = (np.ndarray, CheckedArray)  # heap arrays are CheckedArray under --check


def _transfer(rt, api: Api, opcode: int, remote_arr, local_arr, nelems, pe, qp_idx) -> tuple:
    """Check and resolve the arguments of a put, get or put_signal: (queue, remote heap offset, bytes, local VA,
    local registration or None).

    The checks are those of ``checks`` (target, bytes, symmetric address) and of ``LocalRegistry.va_of`` (the
    local side), in that order; each is skipped only when the inline condition before it holds, a plain case
    that the check accepts. This runs once per token in MoE kernels.
    """
    if not (_FAST and type(pe) is int and type(qp_idx) is int and 0 <= pe < rt.n_pes and pe != rt.my_pe
            and 0 <= qp_idx < rt.qp_num):
        pe, qp_idx = check_target(rt, _CALLS[api], pe, qp_idx)
    if (_FAST and type(nelems) is int and type(remote_arr) in _ARRAYS and type(local_arr) in _ARRAYS
            and 0 <= nelems <= remote_arr.size and nelems <= local_arr.size and remote_arr.dtype == local_arr.dtype
            and remote_arr.flags.c_contiguous and local_arr.flags.c_contiguous
            and nelems * remote_arr.itemsize <= MAX_MSG_BYTES):
        nbytes = nelems * remote_arr.itemsize
    else:
        roles = {"dst": local_arr, "src": remote_arr} if opcode == _READ else {"dst": remote_arr, "src": local_arr}
        nbytes = transfer_bytes(rt, f"{_CALLS[api]} to pe {pe} qp {qp_idx}", nelems, roles)
    heap = rt.heap
    base = heap.base_addr
    off = data_address(remote_arr) - base
    if not (0 <= off and heap.allocated(off, nbytes or 1)):  # not in this PE's own copy: any PE's, or an error
        off = symmetric_offset(rt, f"{_CALLS[api]} to pe {pe} qp {qp_idx}", remote_arr, nbytes, pe,
                               "src" if opcode == _READ else "dst")
    udma = rt.udma
    qp = udma.qps[pe * rt.qp_num + qp_idx]
    laddr = data_address(local_arr)
    loff = laddr - base
    if 0 <= loff and nbytes and heap.allocated(loff, nbytes):  # this PE's heap: no registration
        return qp, off, nbytes, udma.registry.heap_va + loff, None
    local_va, reg = udma.registry.va_of(local_arr, opcode == _READ,
                                        lambda: f"{_CALLS[api]} to pe {pe} qp {qp_idx} local array",
                                        pin=_pin(qp), addr=laddr)
    return qp, off, nbytes, local_va, reg


def _pin(qp) -> tuple[int, int]:
    """The ``pin`` for ``LocalRegistry.va_of``: keep a local registration alive while the WQE that uses it is
    being posted (posting may drain the CQ, which collects retired registrations, and other blocks' quiets
    collect too): one ring lap ahead, until the post records its position."""
    return qp.index, (qp.head + qp.depth) & M32


# --- put / get ---------------------------------------------------------------------------------------------


def _rw(api: Api, opcode: int, remote_arr, local_arr, nelems, pe, qp_idx, *, config, batch, buf) -> None:
    """Post a WRITE (remote_arr = dst) or READ (remote_arr = src), or stage it in a defer/submit ``batch``.

    The plain case (no batch, an OpConfig, arguments the checks accept at a glance, the calling block already the
    queue's submitter, room in the ring) is posted by the native path (``_post.c``) in a few hundred ns, observed
    or not (it writes the events itself); every other case takes the checked path below, which writes the same
    WQE bytes and events."""
    rt = runtime()
    if (batch is None and type(config) is OpConfig
            and rt.udma.poster.rw(remote_arr, local_arr, nelems, pe, qp_idx, opcode, config.flag, api,
                                  thread_slot()) >= 0):
        return
    qp, off, nbytes, local_va, reg = _transfer(rt, api, opcode, remote_arr, local_arr, nelems, pe, qp_idx)
    if batch is not None:
        if not isinstance(batch, _BatchCall):
            raise TypeError(f"pe {rt.my_pe}: {_CALLS[api]} to pe {qp.peer} qp {qp.qp_idx}: batch= takes "
                            f"aclshmemx_defer_t(state) or aclshmemx_submit_t(state), not {batch!r}")
        batch._add(rt, qp, api, opcode, config, buf, f"{_CALLS[api]} to pe {qp.peer} qp {qp.qp_idx}",
                   dict(rmt_va=qp.remote_base + off, sge_len=nbytes, sge_va=local_va), reg)
        return
    if type(config) is not OpConfig:
        config = check_config(rt, _CALLS[api], config)
    if nbytes == 0:
        return
    pos = qp.post_rw(opcode, config.flag, qp.remote_base + off, nbytes, local_va, api, _CALLS[api])
    if reg is not None:
        reg.uses[qp.index] = (pos + 1) & M32


def aclshmemx_udma_put_nbi(dst: np.ndarray, src: np.ndarray, nelems: int, pe: int, *, buf: np.ndarray | None = None,
                           sync_id: int = 0, config: OpConfig = ACLSHMEMX_UDMA_OP_CONFIG_DEFAULT,
                           batch: aclshmemx_defer_t | aclshmemx_submit_t | None = None) -> None:
    """Post a WRITE of ``nelems`` elements from local ``src`` to ``dst`` on PE ``pe``, on QP 0.

    Args:
        dst: heap view (symmetric address), C-contiguous, at least ``nelems`` elements.
        src: this PE's heap view or a C-contiguous local array of the same dtype; must not change before the
            quiet that completes the put.
        pe: target PE (not this one).
    Completes at ``aclshmemx_udma_quiet(pe)``.
    """
    _rw(Api.PUT_NBI, Opcode.WRITE, dst, src, nelems, pe, 0, config=config, batch=batch, buf=buf)


def aclshmemx_udma_qp_put_nbi(dst: np.ndarray, src: np.ndarray, nelems: int, pe: int, qp_idx: int, *,
                              buf: np.ndarray | None = None, sync_id: int = 0,
                              config: OpConfig = ACLSHMEMX_UDMA_OP_CONFIG_DEFAULT,
                              batch: aclshmemx_defer_t | aclshmemx_submit_t | None = None) -> None:
    """``aclshmemx_udma_put_nbi`` on QP ``qp_idx`` (< qp_num); completes at ``aclshmemx_udma_qp_quiet``."""
    _rw(Api.QP_PUT_NBI, Opcode.WRITE, dst, src, nelems, pe, qp_idx, config=config, batch=batch, buf=buf)


def aclshmemx_udma_get_nbi(dst: np.ndarray, src: np.ndarray, nelems: int, pe: int, *, buf: np.ndarray | None = None,
                           sync_id: int = 0, config: OpConfig = ACLSHMEMX_UDMA_OP_CONFIG_DEFAULT,
                           batch: aclshmemx_defer_t | aclshmemx_submit_t | None = None) -> None:
    """Post a READ of ``nelems`` elements of ``src`` on PE ``pe`` (a heap view) into local ``dst``, on QP 0.

    ``dst`` is undefined until ``aclshmemx_udma_quiet(pe)``.
    """
    _rw(Api.GET_NBI, Opcode.READ, src, dst, nelems, pe, 0, config=config, batch=batch, buf=buf)


def aclshmemx_udma_qp_get_nbi(dst: np.ndarray, src: np.ndarray, nelems: int, pe: int, qp_idx: int, *,
                              buf: np.ndarray | None = None, sync_id: int = 0,
                              config: OpConfig = ACLSHMEMX_UDMA_OP_CONFIG_DEFAULT,
                              batch: aclshmemx_defer_t | aclshmemx_submit_t | None = None) -> None:
    """``aclshmemx_udma_get_nbi`` on QP ``qp_idx``."""
    _rw(Api.QP_GET_NBI, Opcode.READ, src, dst, nelems, pe, qp_idx, config=config, batch=batch, buf=buf)


# --- put with signal -----------------------------------------------------------------------------------------


def _put_signal(api: Api, dst, src, nelems, sig_addr, signal, pe, qp_idx, config) -> None:
    rt = runtime()
    if (type(config) is OpConfig
            and rt.udma.poster.notify(dst, src, nelems, sig_addr, signal, pe, qp_idx, config.flag, api,
                                      thread_slot()) >= 0):
        return  # the plain case, posted natively (see _rw)
    what = _CALLS[api]
    if type(config) is not OpConfig:
        config = check_config(rt, what, config)
    qp, off, nbytes, local_va, reg = _transfer(rt, api, Opcode.WRITE, dst, src, nelems, pe, qp_idx)
    sig_off = _signal_word(rt, what, qp, sig_addr)
    if not (type(signal) is int and -(1 << 63) <= signal < 1 << 64):
        signal = _signal_value(rt, what, qp, signal)
    wqe = qp.notify_bytes(config.flag, qp.remote_base + off, nbytes, local_va, qp.remote_base + sig_off,
                          signal & 0xFFFF_FFFF_FFFF_FFFF)
    pos = qp.post_bytes(wqe, config.flag, api, what)
    if reg is not None:
        reg.uses[qp.index] = (pos + 2) & M32


def _signal_word(rt, what: str, qp, sig_addr) -> int:
    """Heap offset of a put_signal's signal word: a heap view of a 64-bit integer word (the engine writes 8
    aligned bytes)."""
    if type(sig_addr) is np.ndarray and sig_addr.itemsize == 8 and sig_addr.dtype.kind in "iu":
        off = data_address(sig_addr) - rt.heap.base_addr
        if 0 <= off and not off % 8 and rt.heap.allocated(off, 8):
            return off
    where = f"{what} to pe {qp.peer} qp {qp.qp_idx}"
    if not isinstance(sig_addr, np.ndarray) or sig_addr.itemsize != 8 or sig_addr.dtype.kind not in "iu":
        raise TypeError(f"pe {rt.my_pe}: {where}: sig_addr must be a heap view of a 64-bit integer word "
                        f"(uint64/int64: the engine writes 8 bytes), got "
                        f"{getattr(sig_addr, 'dtype', type(sig_addr).__name__)}")
    off = symmetric_offset(rt, where, sig_addr, 8, qp.peer, "sig_addr")
    if off % 8:
        raise ValueError(f"pe {rt.my_pe}: {where}: sig_addr is not 8-byte aligned")
    return off


def _signal_value(rt, what: str, qp, signal) -> int:
    try:
        value = int(signal)
    except (TypeError, ValueError):
        value = None
    if value is None or not -(1 << 63) <= value < 1 << 64:
        raise ValueError(f"pe {rt.my_pe}: {what} to pe {qp.peer} qp {qp.qp_idx}: signal {signal!r} is not a "
                         f"64-bit integer")
    return value


def aclshmemx_udma_put_signal_nbi(dst: np.ndarray, src: np.ndarray, nelems: int, sig_addr: np.ndarray, signal: int,
                                  pe: int, *, config: OpConfig = ACLSHMEMX_UDMA_OP_CONFIG_DEFAULT,
                                  buf: np.ndarray | None = None, sync_id: int = 0) -> None:
    """One WRITE_WITH_NOTIFY on QP 0: the payload, then the 64-bit ``sig_addr`` word on ``pe`` SET to ``signal``.

    A PE that sees the signal sees this call's payload (without calling quiet itself).
    """
    _put_signal(Api.PUT_SIGNAL_NBI, dst, src, nelems, sig_addr, signal, pe, 0, config)


def aclshmemx_udma_qp_put_signal_nbi(dst: np.ndarray, src: np.ndarray, nelems: int, sig_addr: np.ndarray, signal: int,
                                     pe: int, qp_idx: int, *, config: OpConfig = ACLSHMEMX_UDMA_OP_CONFIG_DEFAULT,
                                     buf: np.ndarray | None = None, sync_id: int = 0) -> None:
    """``aclshmemx_udma_put_signal_nbi`` on QP ``qp_idx``."""
    _put_signal(Api.QP_PUT_SIGNAL_NBI, dst, src, nelems, sig_addr, signal, pe, qp_idx, config)


# --- quiet ---------------------------------------------------------------------------------------------------


def aclshmemx_udma_qp_quiet(pe: int, qp_idx: int) -> None:
    """Wait until every CQE-producing WQE posted to (pe, qp_idx) completed; raise ``CompletionError`` on an error
    CQE (after consuming the CQ up to ``cqe_cnt``, so the queue is usable again)."""
    _quiet(runtime(), "aclshmemx_udma_qp_quiet", pe, qp_idx, WaitCall.QP_QUIET)


def _quiet(rt, what: str, pe, qp_idx, call: WaitCall) -> None:
    """The quiet of (pe, qp_idx): natively when every CQE is in (or comes within a quiet's spin) and none failed,
    else by ``QueuePair.poll`` (which sleeps, and raises on an error CQE). Chaos jitters the thread around it."""
    chaos = rt.chaos
    if chaos is not None:
        chaos.jitter()
    if rt.udma.quiet_fast(pe, qp_idx, call):  # all in, none failed: native
        if chaos is not None:
            chaos.jitter()
        return
    qp = rt.udma.qp(*check_target(rt, what, pe, qp_idx))
    qp.poll(qp.cqe_cnt, what, call=call)


def aclshmemx_udma_quiet(pe: int) -> None:
    """Quiet QP 0 of ``pe`` only (as on the hardware; other QPs need ``aclshmemx_udma_qp_quiet``)."""
    _quiet(runtime(), "aclshmemx_udma_quiet", pe, 0, WaitCall.QUIET)


def aclshmem_quiet() -> None:
    """Generic quiet: completes MTE copies (already complete here). Does NOT complete UDMA work, as in CANN SHMEM,
    where it is a pipe barrier plus a cache flush: use ``aclshmemx_udma_quiet`` / ``_qp_quiet``."""
    runtime()


def aclshmem_fence() -> None:
    """Generic fence: the same as ``aclshmem_quiet`` in CANN SHMEM; does not order or complete UDMA work."""
    runtime()


# --- defer / submit batching --------------------------------------------------------------------------------


class aclshmemx_submit_state_t:
    """State of one defer/submit batch (``pending_count`` as in CANN).

    Deferred calls write their WQE into the staging area (``buf`` if given, at ``64 * pending_count``) without a
    CQE; the submit call adds its own WQE with a CQE and copies the batch into the SQ in chunks (at most
    ``depth - 10`` BBs, split at the ring end), one doorbell per chunk, one CQE for the whole batch. Every call of
    a batch must use the same op kind, PE, QP and staging buffer.
    """

    def __init__(self):
        self.pending_count = 0
        self.reserved = 0
        self._wqes: list[bytes] = []
        self._regs: list = []
        self._key = None

    def __repr__(self) -> str:
        return f"aclshmemx_submit_state_t(pending_count={self.pending_count})"


class _BatchCall:
    submit = False

    def __init__(self, state: aclshmemx_submit_state_t):
        if not isinstance(state, aclshmemx_submit_state_t):
            raise TypeError(f"{type(self).__name__} takes an aclshmemx_submit_state_t, got {state!r}")
        self.state = state

    def _add(self, rt, qp, api: Api, opcode: int, config, buf, what: str, fields: dict, reg) -> None:
        st = self.state
        default = ACLSHMEMX_UDMA_OP_CONFIG_DEFAULT if self.submit else ACLSHMEMX_UDMA_OP_CONFIG_NO_CQE
        if config is ACLSHMEMX_UDMA_OP_CONFIG_DEFAULT and not self.submit:
            config = default
        config = check_config(rt, what, config)
        if config.cqe != int(self.submit):
            kind = "submit" if self.submit else "defer"
            raise ValueError(f"pe {rt.my_pe}: {what}: a {kind} call needs a config with cqe={int(self.submit)} "
                             f"(got {config})")
        key = (opcode, qp.index, None if buf is None else id(buf))
        if st._key is not None and st._key != key:
            raise ValueError(f"pe {rt.my_pe}: {what}: every call of a defer/submit batch must use the same op "
                             f"kind, PE, QP and buf (this batch started with "
                             f"{Opcode(st._key[0]).name} to pe {st._key[1] // rt.qp_num} qp "
                             f"{st._key[1] % rt.qp_num})")
        n = st.pending_count + 1
        if n + 10 >= qp.depth:
            raise ValueError(f"pe {rt.my_pe}: {what}: {n} WQEs in one batch do not fit an SQ of depth {qp.depth} "
                             f"(a batch, submit included, must leave the 10-BB credit guard free)")
        wqe = qp.rw_bytes(opcode, config.flag, fields["rmt_va"], fields["sge_len"], fields["sge_va"])
        if buf is not None:
            if not isinstance(buf, np.ndarray) or buf.dtype != np.uint8 or buf.nbytes < 64 * n:
                raise ValueError(f"pe {rt.my_pe}: {what}: buf must be a uint8 array of at least 64 * {n} bytes "
                                 f"for a batch of {n} WQEs")
            buf.reshape(-1)[64 * (n - 1):64 * n] = np.frombuffer(wqe, np.uint8)
        st._key = key
        st._wqes.append(wqe)
        st._regs.append(reg)
        st.pending_count = n
        if rt.events is not None and rt.events.checker is not None:
            rt.events.checker.batch(st, qp, n, self.submit)
        if self.submit:
            try:
                _submit(qp, st, _CALLS[api])
            finally:
                st.pending_count, st._wqes, st._regs, st._key = 0, [], [], None


def _submit(qp, st: aclshmemx_submit_state_t, what: str) -> None:
    """Copy a batch into the SQ (split at the ring end: one chunk and doorbell per contiguous piece)."""
    n = len(st._wqes)
    head = qp.reserve(n, what)
    data = np.frombuffer(b"".join(st._wqes), np.uint8).reshape(-1, 64)
    start = 0
    while start < n:
        slot = (head + start) & qp.mask
        count = min(n - start, qp.depth - slot)
        qp.sq[slot:slot + count] = data[start:start + count]
        last = start + count == n
        qp.ring_doorbell((head + start + count) & M32, cqes=1 if last else 0, api=Api.SUBMIT if last else Api.DEFER)
        start += count
    for i, reg in enumerate(st._regs):
        if reg is not None:
            reg.uses[qp.index] = (head + i + 1) & M32


class aclshmemx_defer_t(_BatchCall):
    """``batch=aclshmemx_defer_t(state)``: stage this WQE (no CQE) in the batch."""


class aclshmemx_submit_t(_BatchCall):
    """``batch=aclshmemx_submit_t(state)``: add this WQE (with the batch's one CQE) and post the whole batch."""

    submit = True



# --- MTE: direct copies by the calling thread ---------------------------------------------------------------


def _mte(what: str, dst, src, nelems, pe, remote_is_dst: bool) -> None:
    rt = runtime()
    pe = check_pe(rt, what, pe)
    where = f"{what} to pe {pe}" if remote_is_dst else f"{what} from pe {pe}"
    nbytes = transfer_bytes(rt, where, nelems, {"dst": dst, "src": src})
    sym = dst if remote_is_dst else src
    offset = symmetric_offset(rt, where, sym, nbytes, pe, "dst" if remote_is_dst else "src")
    if nbytes == 0:
        return
    ev = rt.events
    if ev is not None and remote_is_dst:  # a release: recorded before the copy
        ev.mte(pe, offset, nbytes, True, src)
    peer = rt.heap.peer_view(sym, pe).reshape(-1)[:nelems]
    ck = ev.checker if ev is not None else None
    if remote_is_dst:
        if ck is not None:  # a release (a flag stored by MTE): recorded before the copy
            ck.mte(pe, rt.heap.locate(sym)[1], nbytes, True, src.reshape(-1)[:nelems])
        np.copyto(peer, src.reshape(-1)[:nelems])
        rt.ctl.wake(pe)
    else:
        np.copyto(dst.reshape(-1)[:nelems], peer)
        if ev is not None:  # an acquire: recorded after the copy
            ev.mte(pe, offset, nbytes, False)
        if ck is not None:
            ck.mte(pe, rt.heap.locate(sym)[1], nbytes, False, dst)


def aclshmemx_mte_put_nbi(dst: np.ndarray, src: np.ndarray, nelems: int, pe: int, *, buf: np.ndarray | None = None,
                          ub_size: int | None = None, sync_id: int = 0) -> None:
    """Copy ``nelems`` elements of ``src`` into ``dst`` on PE ``pe`` (any PE, this one included) directly.

    Complete when it returns (``aclshmemx_mte_quiet`` is a no-op); the peer's waiters are woken. With a
    ``non_contiguous_copy_param`` in place of ``nelems``: the strided copy of ``api.mte_strided``.
    """
    if isinstance(nelems, mte_strided.non_contiguous_copy_param):
        return mte_strided.put("aclshmemx_mte_put_nbi", dst, src, nelems, pe)
    _mte("aclshmemx_mte_put_nbi", dst, src, nelems, pe, True)


def aclshmemx_mte_get_nbi(dst: np.ndarray, src: np.ndarray, nelems: int, pe: int, *, buf: np.ndarray | None = None,
                          ub_size: int | None = None, sync_id: int = 0) -> None:
    """Copy ``nelems`` elements of ``src`` on PE ``pe`` (a heap view) into local ``dst`` directly (or, with a
    ``non_contiguous_copy_param``, the strided copy of ``api.mte_strided``)."""
    if isinstance(nelems, mte_strided.non_contiguous_copy_param):
        return mte_strided.get("aclshmemx_mte_get_nbi", dst, src, nelems, pe)
    _mte("aclshmemx_mte_get_nbi", dst, src, nelems, pe, False)


def aclshmemx_mte_quiet() -> None:
    """MTE copies are synchronous here: nothing to wait for (a recording notes the call: the replay models the
    copies as non-blocking, complete at this quiet)."""
    rt = runtime()
    if rt.events is not None:
        rt.events.mte_quiet()
