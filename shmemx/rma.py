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

from .heap import HEAP_VA_BASE, HEAP_VA_STRIDE, data_address
from .layout import (ACLSHMEMX_UDMA_OP_CONFIG_DEFAULT, ACLSHMEMX_UDMA_OP_CONFIG_NO_CQE, MAX_MSG_BYTES, Opcode,
                     OpConfig)
from .queues import Api, M32
from .runtime import runtime

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


def _check_target(rt, what: str, pe, qp_idx) -> None:
    if isinstance(pe, bool) or not isinstance(pe, (int, np.integer)) or not 0 <= pe < rt.n_pes:
        raise ValueError(f"pe {rt.my_pe}: {what} to pe {pe!r} qp {qp_idx!r}: pe {pe!r} out of range "
                         f"0..{rt.n_pes - 1}")
    if pe == rt.my_pe:
        raise ValueError(f"pe {rt.my_pe}: {what} to itself (pe {pe} qp {qp_idx!r}): UDMA to the own PE is not "
                         f"allowed (use a local copy or aclshmemx_mte_put_nbi)")
    if isinstance(qp_idx, bool) or not isinstance(qp_idx, (int, np.integer)) or not 0 <= qp_idx < rt.qp_num:
        raise ValueError(f"pe {rt.my_pe}: {what} to pe {pe}: qp_idx {qp_idx!r} out of range 0..{rt.qp_num - 1} "
                         f"(qp_num is {rt.qp_num}; raise it with aclshmemx_set_qp_num before init)")


def _nbytes(rt, what: str, nelems, arrays: dict, where: str) -> int:
    if isinstance(nelems, bool) or not isinstance(nelems, (int, np.integer)) or nelems < 0:
        raise ValueError(f"pe {rt.my_pe}: {what}{where}: nelems must be a non-negative integer, got {nelems!r}")
    dtypes = set()
    for role, arr in arrays.items():
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"pe {rt.my_pe}: {what}{where}: {role} must be a numpy array, got {type(arr).__name__}")
        if not arr.flags.c_contiguous:
            raise ValueError(f"pe {rt.my_pe}: {what}{where}: {role} must be C-contiguous (one SGE covers one "
                             f"contiguous range); pass a contiguous slice")
        if arr.size < nelems:
            raise ValueError(f"pe {rt.my_pe}: {what}{where}: nelems {nelems} but {role} has only {arr.size} "
                             f"elements")
        dtypes.add(arr.dtype)
    if len(dtypes) > 1:
        listing = ", ".join(f"{role} {arr.dtype}" for role, arr in arrays.items())
        raise TypeError(f"pe {rt.my_pe}: {what}{where}: dtype mismatch ({listing})")
    nbytes = int(nelems) * next(iter(arrays.values())).itemsize
    if nbytes > MAX_MSG_BYTES:
        raise ValueError(f"pe {rt.my_pe}: {what}{where}: {nbytes} B is over the 256 MiB limit of one UDMA request; "
                         f"split it")
    return nbytes


def _remote(rt, what: str, arr: np.ndarray, nbytes: int, pe: int, where: str, role: str) -> int:
    """VA on ``pe`` of the symmetric address ``arr`` (a heap view), checked against the live allocation."""
    try:
        _, off = rt.heap.locate(arr, role)
    except ValueError as exc:
        raise ValueError(f"pe {rt.my_pe}: {what}{where}: {role} must be a heap array (the symmetric address "
                         f"on the peer): {str(exc).split(': ', 1)[-1]}") from None
    rt.heap.check_allocated(off, max(nbytes, 1), f"{what}{where} {role}", pe)
    return HEAP_VA_BASE + pe * HEAP_VA_STRIDE + off


def _pin(qp) -> tuple[int, int]:
    """The ``pin`` for ``LocalRegistry.va_of``: keep a local registration alive while the WQE that uses it is
    being posted (posting may drain the CQ, which collects retired registrations, and other blocks' quiets
    collect too): one ring lap ahead, until the post records its position."""
    return qp.index, (qp.head + qp.depth) & M32


def _config(rt, what: str, config) -> OpConfig:
    if not isinstance(config, OpConfig):
        raise TypeError(f"pe {rt.my_pe}: {what}: config must be an OpConfig (e.g. ACLSHMEMX_UDMA_OP_CONFIG_SO), "
                        f"got {config!r}")
    return config


# --- put / get ---------------------------------------------------------------------------------------------


_CALLS = {api: api.call for api in Api}


def _rw(api: Api, opcode: int, remote_arr, local_arr, nelems, pe, qp_idx, *, config, batch, buf) -> None:
    """Post a WRITE (remote_arr = dst) or READ (remote_arr = src), or stage it in a defer/submit ``batch``.

    The common case is checked in one expression (this runs per token in MoE kernels); anything unusual goes to
    ``_rw_checked``, which checks the same things one by one and names what is wrong.
    """
    rt = runtime()
    if ((batch is None or type(batch) in _BATCH_CALLS) and type(config) is OpConfig and type(pe) is int
            and type(qp_idx) is int and type(nelems) is int and 0 <= qp_idx < rt.qp_num and 0 <= pe < rt.n_pes
            and pe != rt.my_pe and type(remote_arr) is np.ndarray and type(local_arr) is np.ndarray
            and remote_arr.dtype == local_arr.dtype and remote_arr.flags.c_contiguous
            and local_arr.flags.c_contiguous and 0 < nelems <= remote_arr.size and nelems <= local_arr.size):
        heap = rt.heap
        nbytes = nelems * remote_arr.itemsize
        base = heap.base_addr
        off = data_address(remote_arr) - base
        if nbytes <= MAX_MSG_BYTES and 0 <= off and heap.allocated(off, nbytes):
            udma = rt.udma
            qp = udma.qps[pe * rt.qp_num + qp_idx]
            loff = data_address(local_arr) - base
            if 0 <= loff and heap.allocated(loff, nbytes):  # the local side is on this PE's heap: no registration
                local_va, reg = udma.registry.heap_va + loff, None
                if batch is None:
                    qp.post_rw(opcode, config.flag, qp.remote_base + off, nbytes, local_va, api, _CALLS[api])
                    return
            else:
                local_va, reg = udma.registry.va_of(local_arr, opcode == Opcode.READ,
                                                    lambda: f"{_CALLS[api]} to pe {pe} qp {qp_idx} local array",
                                                    pin=(qp.index, (qp.head + qp.depth) & M32), addr=loff + base)
            if batch is not None:
                batch._add(rt, qp, api, opcode, config, buf, f"{_CALLS[api]} to pe {pe} qp {qp_idx}",
                           dict(rmt_va=qp.remote_base + off, sge_len=nbytes, sge_va=local_va), reg)
                return
            pos = qp.post_rw(opcode, config.flag, qp.remote_base + off, nbytes, local_va, api, _CALLS[api])
            if reg is not None:
                reg.uses[qp.index] = (pos + 1) & M32
            return
    _rw_checked(rt, api, opcode, remote_arr, local_arr, nelems, pe, qp_idx, config=config, batch=batch, buf=buf)


def _rw_checked(rt, api: Api, opcode: int, remote_arr, local_arr, nelems, pe, qp_idx, *, config, batch,
                buf) -> None:
    what = api.call
    _check_target(rt, what, pe, qp_idx)
    where = f" to pe {pe} qp {qp_idx}"
    roles = {"dst": remote_arr, "src": local_arr} if opcode == Opcode.WRITE else {"dst": local_arr,
                                                                                   "src": remote_arr}
    nbytes = _nbytes(rt, what, nelems, roles, where)
    remote_role = "dst" if opcode == Opcode.WRITE else "src"
    remote_va = _remote(rt, what, remote_arr, nbytes, pe, where, remote_role)
    udma = rt.udma
    qp = udma.qp(int(pe), int(qp_idx))
    local_va, reg = udma.registry.va_of(local_arr, writable=opcode == Opcode.READ,
                                        what=f"{what}{where} {'src' if opcode == Opcode.WRITE else 'dst'}",
                                        pin=_pin(qp))
    if batch is not None:
        batch._add(rt, qp, api, opcode, config, buf, what + where,
                   dict(rmt_va=remote_va, sge_len=nbytes, sge_va=local_va), reg)
        return
    config = _config(rt, what, config)
    if nbytes == 0:
        return
    pos = qp.post_rw(opcode, config.flag, remote_va, nbytes, local_va, api, what)
    if reg is not None:
        reg.uses[qp.index] = (pos + 1) & M32


def aclshmemx_udma_put_nbi(dst, src, nelems, pe, *, buf=None, sync_id=0, config=ACLSHMEMX_UDMA_OP_CONFIG_DEFAULT,
                           batch=None) -> None:
    """Post a WRITE of ``nelems`` elements from local ``src`` to ``dst`` on PE ``pe``, on QP 0.

    Args:
        dst: heap view (symmetric address), C-contiguous, at least ``nelems`` elements.
        src: this PE's heap view or a C-contiguous local array of the same dtype; must not change before the
            quiet that completes the put.
        pe: target PE (not this one).
    Completes at ``aclshmemx_udma_quiet(pe)``.
    """
    _rw(Api.PUT_NBI, Opcode.WRITE, dst, src, nelems, pe, 0, config=config, batch=batch, buf=buf)


def aclshmemx_udma_qp_put_nbi(dst, src, nelems, pe, qp_idx, *, buf=None, sync_id=0,
                              config=ACLSHMEMX_UDMA_OP_CONFIG_DEFAULT, batch=None) -> None:
    """``aclshmemx_udma_put_nbi`` on QP ``qp_idx`` (< qp_num); completes at ``aclshmemx_udma_qp_quiet``."""
    _rw(Api.QP_PUT_NBI, Opcode.WRITE, dst, src, nelems, pe, qp_idx, config=config, batch=batch, buf=buf)


def aclshmemx_udma_get_nbi(dst, src, nelems, pe, *, buf=None, sync_id=0, config=ACLSHMEMX_UDMA_OP_CONFIG_DEFAULT,
                           batch=None) -> None:
    """Post a READ of ``nelems`` elements of ``src`` on PE ``pe`` (a heap view) into local ``dst``, on QP 0.

    ``dst`` is undefined until ``aclshmemx_udma_quiet(pe)``.
    """
    _rw(Api.GET_NBI, Opcode.READ, src, dst, nelems, pe, 0, config=config, batch=batch, buf=buf)


def aclshmemx_udma_qp_get_nbi(dst, src, nelems, pe, qp_idx, *, buf=None, sync_id=0,
                              config=ACLSHMEMX_UDMA_OP_CONFIG_DEFAULT, batch=None) -> None:
    """``aclshmemx_udma_get_nbi`` on QP ``qp_idx``."""
    _rw(Api.QP_GET_NBI, Opcode.READ, src, dst, nelems, pe, qp_idx, config=config, batch=batch, buf=buf)


# --- put with signal -----------------------------------------------------------------------------------------


def _put_signal(api: Api, dst, src, nelems, sig_addr, signal, pe, qp_idx, config) -> None:
    rt = runtime()
    if (type(config) is OpConfig and type(pe) is int and type(qp_idx) is int and type(nelems) is int
            and type(signal) is int and 0 <= qp_idx < rt.qp_num and 0 <= pe < rt.n_pes and pe != rt.my_pe
            and type(dst) is np.ndarray and type(src) is np.ndarray and type(sig_addr) is np.ndarray
            and dst.dtype == src.dtype and dst.flags.c_contiguous and src.flags.c_contiguous
            and 0 <= nelems <= dst.size and nelems <= src.size and sig_addr.itemsize == 8
            and sig_addr.dtype.kind in "iu" and -(1 << 63) <= signal < 1 << 64):  # the common case, as in _rw
        heap = rt.heap
        base = heap.base_addr
        nbytes = nelems * dst.itemsize
        off = data_address(dst) - base
        sig_off = data_address(sig_addr) - base
        if (nbytes <= MAX_MSG_BYTES and 0 <= off and heap.allocated(off, max(nbytes, 1)) and 0 <= sig_off
                and not sig_off % 8 and heap.allocated(sig_off, 8)):
            udma = rt.udma
            qp = udma.qps[pe * rt.qp_num + qp_idx]
            loff = data_address(src) - base
            if 0 <= loff and nbytes and heap.allocated(loff, nbytes):
                local_va, reg = udma.registry.heap_va + loff, None
            else:
                local_va, reg = udma.registry.va_of(src, False, lambda: f"{_CALLS[api]} to pe {pe} qp {qp_idx} src",
                                                    pin=_pin(qp), addr=loff + base)
            wqe = qp.notify_bytes(config.flag, qp.remote_base + off, nbytes, local_va, qp.remote_base + sig_off,
                                  signal & 0xFFFF_FFFF_FFFF_FFFF)
            pos = qp.post_bytes(wqe, config.flag, api, _CALLS[api])
            if reg is not None:
                reg.uses[qp.index] = (pos + 2) & M32
            return
    what = api.call
    _check_target(rt, what, pe, qp_idx)
    where = f" to pe {pe} qp {qp_idx}"
    config = _config(rt, what, config)
    nbytes = _nbytes(rt, what, nelems, {"dst": dst, "src": src}, where)
    remote_va = _remote(rt, what, dst, nbytes, pe, where, "dst")
    if not isinstance(sig_addr, np.ndarray) or sig_addr.itemsize != 8 or sig_addr.dtype.kind not in "iu":
        raise TypeError(f"pe {rt.my_pe}: {what}{where}: sig_addr must be a heap view of a 64-bit integer word "
                        f"(uint64/int64: the engine writes 8 bytes), got "
                        f"{getattr(sig_addr, 'dtype', type(sig_addr).__name__)}")
    sig_va = _remote(rt, what, sig_addr, 8, pe, where, "sig_addr")
    if sig_va % 8:
        raise ValueError(f"pe {rt.my_pe}: {what}{where}: sig_addr is not 8-byte aligned")
    try:
        value = int(signal) & (2**64 - 1) if -(2**63) <= int(signal) < 2**64 else None
    except (TypeError, ValueError):
        value = None
    if value is None:
        raise ValueError(f"pe {rt.my_pe}: {what}{where}: signal {signal!r} is not a 64-bit integer")
    udma = rt.udma
    qp = udma.qp(int(pe), int(qp_idx))
    local_va, reg = udma.registry.va_of(src, writable=False, what=f"{what}{where} src", pin=_pin(qp))
    wqe = qp.build(Opcode.WRITE_WITH_NOTIFY, config.flag, remote_va, sge_len=nbytes, sge_va=local_va,
                   notify_tid=qp.tid, notify_token=qp.token, notify_va=sig_va, notify_value=value)
    pos = qp.post_bytes(wqe, config.flag, api, what)
    if reg is not None:
        reg.uses[qp.index] = (pos + 2) & M32


def aclshmemx_udma_put_signal_nbi(dst, src, nelems, sig_addr, signal, pe, *,
                                  config=ACLSHMEMX_UDMA_OP_CONFIG_DEFAULT, buf=None, sync_id=0) -> None:
    """One WRITE_WITH_NOTIFY on QP 0: the payload, then the 64-bit ``sig_addr`` word on ``pe`` SET to ``signal``.

    A PE that sees the signal sees this call's payload (without calling quiet itself).
    """
    _put_signal(Api.PUT_SIGNAL_NBI, dst, src, nelems, sig_addr, signal, pe, 0, config)


def aclshmemx_udma_qp_put_signal_nbi(dst, src, nelems, sig_addr, signal, pe, qp_idx, *,
                                     config=ACLSHMEMX_UDMA_OP_CONFIG_DEFAULT, buf=None, sync_id=0) -> None:
    """``aclshmemx_udma_put_signal_nbi`` on QP ``qp_idx``."""
    _put_signal(Api.QP_PUT_SIGNAL_NBI, dst, src, nelems, sig_addr, signal, pe, qp_idx, config)


# --- quiet ---------------------------------------------------------------------------------------------------


def aclshmemx_udma_qp_quiet(pe, qp_idx) -> None:
    """Wait until every CQE-producing WQE posted to (pe, qp_idx) completed; raise ``CompletionError`` on an error
    CQE (after consuming the CQ up to ``cqe_cnt``, so the queue is usable again)."""
    from .control import WaitCall

    rt = runtime()
    _check_target(rt, "aclshmemx_udma_qp_quiet", pe, qp_idx)
    qp = rt.udma.qp(int(pe), int(qp_idx))
    qp.poll(qp.cqe_cnt, "aclshmemx_udma_qp_quiet", call=WaitCall.QP_QUIET)


def aclshmemx_udma_quiet(pe) -> None:
    """Quiet QP 0 of ``pe`` only (as on the hardware; other QPs need ``aclshmemx_udma_qp_quiet``)."""
    from .control import WaitCall

    rt = runtime()
    _check_target(rt, "aclshmemx_udma_quiet", pe, 0)
    qp = rt.udma.qp(int(pe), 0)
    qp.poll(qp.cqe_cnt, "aclshmemx_udma_quiet", call=WaitCall.QUIET)


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

    def _add(self, rt, qp, api: Api, opcode: int, config, buf, what: str, fields: dict, reg) -> None:
        raise TypeError(f"pe {rt.my_pe}: {what}: batch= takes aclshmemx_defer_t(state) or "
                        f"aclshmemx_submit_t(state), not the state itself")


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
        config = _config(rt, what, config)
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


_BATCH_CALLS = (aclshmemx_defer_t, aclshmemx_submit_t)


# --- MTE: direct copies by the calling thread ---------------------------------------------------------------


def _mte(what: str, dst, src, nelems, pe, remote_is_dst: bool) -> None:
    rt = runtime()
    if isinstance(pe, bool) or not isinstance(pe, (int, np.integer)) or not 0 <= pe < rt.n_pes:
        raise ValueError(f"pe {rt.my_pe}: {what}: pe {pe!r} out of range 0..{rt.n_pes - 1}")
    where = f" to pe {pe}" if remote_is_dst else f" from pe {pe}"
    nbytes = _nbytes(rt, what, nelems, {"dst": dst, "src": src}, where)
    sym = dst if remote_is_dst else src
    _remote(rt, what, sym, nbytes, int(pe), where, "dst" if remote_is_dst else "src")
    if nbytes == 0:
        return
    peer = rt.heap.peer_view(sym, int(pe)).reshape(-1)[:nelems]
    if remote_is_dst:
        np.copyto(peer, src.reshape(-1)[:nelems])
        rt.ctl.wake(int(pe))
    else:
        np.copyto(dst.reshape(-1)[:nelems], peer)


def aclshmemx_mte_put_nbi(dst, src, nelems, pe, *, buf=None, ub_size=None, sync_id=0) -> None:
    """Copy ``nelems`` elements of ``src`` into ``dst`` on PE ``pe`` (any PE, this one included) directly.

    Complete when it returns (``aclshmemx_mte_quiet`` is a no-op); the peer's waiters are woken.
    """
    _mte("aclshmemx_mte_put_nbi", dst, src, nelems, pe, True)


def aclshmemx_mte_get_nbi(dst, src, nelems, pe, *, buf=None, ub_size=None, sync_id=0) -> None:
    """Copy ``nelems`` elements of ``src`` on PE ``pe`` (a heap view) into local ``dst`` directly."""
    _mte("aclshmemx_mte_get_nbi", dst, src, nelems, pe, False)


def aclshmemx_mte_quiet() -> None:
    """MTE copies are synchronous here: nothing to wait for."""
    runtime()
