"""Engine-agnostic put with signal: ``aclshmem_putmem_signal`` (+ ``_nbi``), ``aclshmemx_putmem_signal`` (+
``_nbi``, the host names), the typed ``aclshmem_<T>_put_signal`` (+ ``_nbi``) and ``aclshmem_put<N>_signal``.

The guarantee, on every engine: a PE that sees the signal update sees the payload. ``sig_op`` is
``ACLSHMEM_SIGNAL_SET`` (store ``signal``) or ``ACLSHMEM_SIGNAL_ADD`` (add it atomically); the signal word is a
heap view whose first element is an int32, uint32, int64 or uint64 word on the target. The engine is the one of
``api.engines.engine_for(pe)``, and the call is made of that engine's existing operations:

* MTE: the direct copy, ``aclshmemx_mte_quiet``, then ``aclshmemx_signal_op`` (a store or an atomic add, then the
  target's waiters are woken), as CANN's MTE path (copy, ``aclshmem_quiet``, signal).
* SDMA: the copy on the block's channel, ``aclshmemx_sdma_quiet``, then ``aclshmemx_signal_op``: SDMA is not
  ordered with signal_op, so the payload is quieted first, and the ``_nbi`` forms wait for their payload.
* UDMA, SET of a 64-bit word: one WRITE_WITH_NOTIFY (``aclshmemx_udma_put_signal_nbi``), whose engine writes the
  payload, then the signal.
* UDMA, ADD, or SET of a 32-bit word (UDMA's notify is a 64-bit SET only, so it has no one-WQE form): the payload
  WRITE, then, on the same QP 0, a *fenced* WQE for the signal: an FAA of ``signal`` (ADD) or a 4-byte WRITE of
  it (SET). A fence waits until every earlier WQE of the QP completed, so the signal lands after the payload,
  whatever the engine reorders (chaos mode included). Two WQEs, two CQEs.

The blocking forms then quiet the engine (``aclshmemx_udma_quiet(pe)`` for UDMA); the ``_nbi`` forms over UDMA
complete at that quiet (the signal itself says the payload is there).
"""

from __future__ import annotations


import numpy as np

from ..runtime import runtime
from ..udma.layout import Opcode, OpConfig
from .checks import check_pe
from .elements import RMA_TYPES, SIZE_DTYPES, SIZES, check_type, install
from .engines import Engine, engine_for
from .generic_rma import as_bytes, copy
from .mte_strided import non_contiguous_copy_param
from .rma import aclshmemx_udma_put_nbi, aclshmemx_udma_put_signal_nbi, aclshmemx_udma_quiet
from .signals import ACLSHMEM_SIGNAL_ADD, ACLSHMEM_SIGNAL_SET, aclshmemx_signal_op
from .udma_atomics import _Target

__all__ = ["aclshmem_putmem_signal", "aclshmem_putmem_signal_nbi", "aclshmemx_putmem_signal",
           "aclshmemx_putmem_signal_nbi"]

_FENCED = OpConfig(cqe=1, se=0, fence=1)
_SIG_DTYPES = {np.dtype(t) for t in ("<i4", "<u4", "<i8", "<u8")}


def _sig_word(rt, what: str, sig_addr, signal, pe: int) -> np.ndarray:
    if not isinstance(sig_addr, np.ndarray) or sig_addr.dtype not in _SIG_DTYPES or not sig_addr.size:
        raise TypeError(f"pe {rt.my_pe}: {what} to pe {pe}: sig_addr must be a heap view of an int32, uint32, int64 "
                        f"or uint64 word, got {getattr(sig_addr, 'dtype', type(sig_addr).__name__)}")
    info = np.iinfo(sig_addr.dtype)
    if isinstance(signal, bool) or not isinstance(signal, (int, np.integer)) or not info.min <= signal <= info.max:
        raise ValueError(f"pe {rt.my_pe}: {what} to pe {pe}: signal {signal!r} does not fit the signal word's "
                         f"dtype {sig_addr.dtype}")
    return sig_addr.reshape(-1)[:1]


def put_signal(what: str, dst, src, nelems, sig_addr, signal, sig_op, pe, block: bool) -> None:
    """The put with signal of the module docstring: ``nelems`` elements (or a ``non_contiguous_copy_param``)."""
    rt = runtime()
    pe = check_pe(rt, what, pe)
    if sig_op != ACLSHMEM_SIGNAL_SET and sig_op != ACLSHMEM_SIGNAL_ADD:
        raise ValueError(f"pe {rt.my_pe}: {what} to pe {pe}: sig_op {sig_op!r} is not ACLSHMEM_SIGNAL_SET (0) or "
                         f"ACLSHMEM_SIGNAL_ADD (1)")
    sig = _sig_word(rt, what, sig_addr, signal, pe)
    engine = engine_for(rt, what, pe)
    if engine is not Engine.UDMA:
        copy(what, dst, src, nelems, pe, True, True)  # the engine's quiet, then the signal (as CANN's MTE path)
        aclshmemx_signal_op(sig, int(signal), sig_op, pe)
        return
    try:
        _udma(what, dst, src, nelems, sig, int(signal), sig_op, pe)
        if block:
            aclshmemx_udma_quiet(pe)
    except (ValueError, TypeError) as exc:
        exc.add_note(f"(in {what} to pe {pe}, over UDMA)")
        raise


def _udma(what: str, dst, src, nelems, sig: np.ndarray, signal: int, sig_op: int, pe: int) -> None:
    if sig_op == ACLSHMEM_SIGNAL_SET and sig.itemsize == 8 and not isinstance(nelems, non_contiguous_copy_param):
        aclshmemx_udma_put_signal_nbi(dst, src, nelems, sig, signal, pe)  # one WQE: payload, then the signal
        return
    copy(what, dst, src, nelems, pe, True, False)
    if sig_op == ACLSHMEM_SIGNAL_SET:
        aclshmemx_udma_put_nbi(sig, np.array([signal], sig.dtype), 1, pe, config=_FENCED)
    else:
        t = _Target(what, sig, pe)
        t.post(Opcode.FAA, t.bits(signal), flag=_FENCED.flag)


def _putmem_signal(what: str, wait: bool, dst, src, nbytes: int, sig_addr: np.ndarray, signal: int, sig_op: int,
                   pe: int) -> None:
    """A byte-wise put + signal: ``dst`` and ``src`` checked and viewed as bytes; ``wait``: complete on return."""
    rt = runtime()
    put_signal(what, as_bytes(rt, what, "dst", dst), as_bytes(rt, what, "src", src), nbytes, sig_addr, signal,
               sig_op, pe, wait)


def aclshmem_putmem_signal(dst: np.ndarray, src: np.ndarray, nbytes: int, sig_addr: np.ndarray, signal: int,
                           sig_op: int, pe: int) -> None:
    """Put ``nbytes`` bytes of ``src`` into ``dst`` on ``pe`` and update its signal word; complete on return."""
    _putmem_signal("aclshmem_putmem_signal", True, dst, src, nbytes, sig_addr, signal, sig_op, pe)


def aclshmem_putmem_signal_nbi(dst: np.ndarray, src: np.ndarray, nbytes: int, sig_addr: np.ndarray, signal: int,
                               sig_op: int, pe: int) -> None:
    """``aclshmem_putmem_signal`` without the final quiet."""
    _putmem_signal("aclshmem_putmem_signal_nbi", False, dst, src, nbytes, sig_addr, signal, sig_op, pe)


def aclshmemx_putmem_signal(dst: np.ndarray, src: np.ndarray, elem_size: int, sig_addr: np.ndarray, signal: int,
                            sig_op: int, pe: int) -> None:
    """The host header's name of ``aclshmem_putmem_signal`` (``elem_size``: bytes)."""
    _putmem_signal("aclshmemx_putmem_signal", True, dst, src, elem_size, sig_addr, signal, sig_op, pe)


def aclshmemx_putmem_signal_nbi(dst: np.ndarray, src: np.ndarray, elem_size: int, sig_addr: np.ndarray, signal: int,
                                sig_op: int, pe: int) -> None:
    """The host header's name of ``aclshmem_putmem_signal_nbi``."""
    _putmem_signal("aclshmemx_putmem_signal_nbi", False, dst, src, elem_size, sig_addr, signal, sig_op, pe)


def _typed(t: str, nbi: bool):
    what = f"aclshmem_{t}_put_signal{'_nbi' if nbi else ''}"

    def fn(dst, src, nelems, sig_addr, signal, sig_op, pe):
        check_type(runtime(), what, t, dst=dst, src=src)
        put_signal(what, dst, src, nelems, sig_addr, signal, sig_op, pe, not nbi)

    fn.__doc__ = (f"Put ``nelems`` {t} elements (or the rows of a ``non_contiguous_copy_param``) and update the "
                  f"signal word (see the module docstring){'; non-blocking' if nbi else ''}.")
    return what, fn


def _sized(bits: int, nbi: bool):
    what = f"aclshmem_put{bits}_signal{'_nbi' if nbi else ''}"

    def fn(dst, src, nelems, sig_addr, signal, sig_op, pe):
        rt = runtime()
        put_signal(what, as_bytes(rt, what, "dst", dst, SIZE_DTYPES[bits]),
                   as_bytes(rt, what, "src", src, SIZE_DTYPES[bits]), nelems, sig_addr, signal, sig_op, pe, not nbi)

    fn.__doc__ = f"Put ``nelems`` {bits}-bit elements and update the signal word{'; non-blocking' if nbi else ''}."
    return what, fn


install(__name__, [_typed(t, nbi) for t in RMA_TYPES for nbi in (False, True)]
        + [_sized(bits, nbi) for bits in SIZES for nbi in (False, True)], __all__)
