"""Engine-agnostic RMA: ``aclshmem_putmem``/``getmem`` (+ ``_nbi``), the typed ``aclshmem_<T>_put/get/p/g/iput/
iget/put_nbi/get_nbi`` and the sized ``aclshmem_put<N>/get<N>/iput<N>/iget<N>`` (+ ``_nbi``).

A thin mapping onto the engines, not a data path of its own: each call picks the engine for its target PE
(``api.engines.engine_for``: MTE for the own PE and, when enabled, the PEs of its server; SDMA inside the server
when enabled; UDMA across servers) and calls that engine's function: ``aclshmemx_mte_put_nbi`` (a direct copy),
``aclshmemx_udma_put_nbi`` (a WRITE on QP 0 of the target) or ``aclshmemx_sdma_put_nbi`` (the calling block's
channel), and the gets likewise. What each engine guarantees is what the call guarantees:

* the blocking forms (``putmem``, ``<T>_put``, ``<T>_p``, ``<T>_g``, ``iput`` ...) add the engine's quiet
  (``aclshmemx_mte_quiet``; ``aclshmemx_udma_quiet(pe)``; ``aclshmemx_sdma_quiet()``), so the data is in place on
  return, as CANN's do;
* the ``_nbi`` forms return once posted: over UDMA they complete at ``aclshmemx_udma_quiet(pe)``, over SDMA at the
  block's ``aclshmemx_sdma_quiet``, over MTE at once (MTE copies are synchronous here); ``aclshmem_quiet`` does not
  complete UDMA or SDMA work (it does not in CANN either).

Arrays replace pointers: the remote side (a put's ``dst``, a get's ``src``) is a heap view, the symmetric
address; counts are elements of the named type (``putmem``/``getmem``: bytes, any dtypes; ``put<N>``: elements of
N bits). The strided forms take element strides ``dst``/``sst`` (``iput``) or a ``non_contiguous_copy_param``
in place of the count (``<T>_put_nbi(dst, src, copy_params, pe)``): over MTE one strided copy, over UDMA/SDMA one
request per row. Refusals are the engines' (``ValueError``/``TypeError`` naming the PE, peer and argument), with
a note naming the high-level call and the engine.
"""

from __future__ import annotations


import numpy as np

from ..runtime import runtime
from . import mte_strided
from .checks import check_pe
from .elements import RMA_TYPES, SIZE_DTYPES, SIZES, check_type, install
from .engines import Engine, engine_for
from .mte_strided import non_contiguous_copy_param
from .rma import (aclshmemx_mte_get_nbi, aclshmemx_mte_put_nbi, aclshmemx_mte_quiet, aclshmemx_udma_get_nbi,
                  aclshmemx_udma_put_nbi, aclshmemx_udma_quiet)
from .sdma import aclshmemx_sdma_get_nbi, aclshmemx_sdma_put_nbi, aclshmemx_sdma_quiet

__all__ = ["aclshmem_putmem", "aclshmem_putmem_nbi", "aclshmem_getmem", "aclshmem_getmem_nbi",
           "non_contiguous_copy_param", "copy", "as_bytes"]

_PUT = {Engine.MTE: aclshmemx_mte_put_nbi, Engine.UDMA: aclshmemx_udma_put_nbi, Engine.SDMA: aclshmemx_sdma_put_nbi}
_GET = {Engine.MTE: aclshmemx_mte_get_nbi, Engine.UDMA: aclshmemx_udma_get_nbi, Engine.SDMA: aclshmemx_sdma_get_nbi}


def _quiet(engine: Engine, pe: int) -> None:
    if engine is Engine.UDMA:
        aclshmemx_udma_quiet(pe)
    elif engine is Engine.SDMA:
        aclshmemx_sdma_quiet()
    else:
        aclshmemx_mte_quiet()


def copy(what: str, dst, src, nelems, pe, put: bool, block: bool) -> Engine:
    """Move ``nelems`` elements (or the rows of a ``non_contiguous_copy_param``) between ``src`` and ``dst`` with
    the engine of ``pe``; ``block``: then that engine's quiet. Returns the engine."""
    rt = runtime()
    pe = check_pe(rt, what, pe)
    engine = engine_for(rt, what, pe)
    try:
        if isinstance(nelems, non_contiguous_copy_param):
            _strided(engine, what, dst, src, nelems, pe, put)
        else:
            (_PUT if put else _GET)[engine](dst, src, nelems, pe)
        if block:
            _quiet(engine, pe)
    except (ValueError, TypeError) as exc:
        exc.add_note(f"(in {what} {'to' if put else 'from'} pe {pe}, over {engine.name})")
        raise
    return engine


def _strided(engine: Engine, what: str, dst, src, p: non_contiguous_copy_param, pe: int, put: bool) -> None:
    """A strided copy: one MTE copy, or one UDMA/SDMA request per row (one for all when the rows touch)."""
    if engine is Engine.MTE:
        (mte_strided.put if put else mte_strided.get)(what, dst, src, p, pe)
        return
    rt = runtime()
    d, s = _flat(rt, what, "dst", dst), _flat(rt, what, "src", src)
    fn = (_PUT if put else _GET)[engine]
    if p.length == p.src_ld == p.dst_ld or p.repeat <= 1:
        fn(d, s, p.repeat * p.length, pe)
        return
    for r in range(p.repeat):
        fn(d[r * p.dst_ld:r * p.dst_ld + p.length], s[r * p.src_ld:r * p.src_ld + p.length], p.length, pe)


def _flat(rt, what: str, role: str, arr) -> np.ndarray:
    if not isinstance(arr, np.ndarray) or not arr.flags.c_contiguous:
        raise TypeError(f"pe {rt.my_pe}: {what}: {role} must be a C-contiguous numpy array")
    return arr.reshape(-1)


def as_bytes(rt, what: str, role: str, arr, dtype=np.uint8) -> np.ndarray:
    """A C-contiguous array's bytes as a flat array of ``dtype`` (whose size must divide them)."""
    flat = _flat(rt, what, role, arr)
    dtype = np.dtype(dtype)
    if flat.nbytes % dtype.itemsize:
        raise ValueError(f"pe {rt.my_pe}: {what}: {role} has {flat.nbytes} B, not a whole number of "
                         f"{dtype.itemsize}-byte elements")
    return flat.view(np.uint8).view(dtype)


def _mem(what: str, dst, src, nbytes, pe, put: bool, block: bool) -> None:
    rt = runtime()
    copy(what, as_bytes(rt, what, "dst", dst), as_bytes(rt, what, "src", src), nbytes, pe, put, block)


def aclshmem_putmem(dst, src, nbytes, pe) -> None:
    """Copy ``nbytes`` bytes of local ``src`` into ``dst`` (a heap view) on PE ``pe``; complete on return."""
    _mem("aclshmem_putmem", dst, src, nbytes, pe, True, True)


def aclshmem_putmem_nbi(dst, src, nbytes, pe) -> None:
    """``aclshmem_putmem`` without the quiet (see the module docstring for when it completes)."""
    _mem("aclshmem_putmem_nbi", dst, src, nbytes, pe, True, False)


def aclshmem_getmem(dst, src, nbytes, pe) -> None:
    """Copy ``nbytes`` bytes of ``src`` (a heap view) on PE ``pe`` into local ``dst``; complete on return."""
    _mem("aclshmem_getmem", dst, src, nbytes, pe, False, True)


def aclshmem_getmem_nbi(dst, src, nbytes, pe) -> None:
    """``aclshmem_getmem`` without the quiet."""
    _mem("aclshmem_getmem_nbi", dst, src, nbytes, pe, False, False)


# --- the typed and sized families, made from the type tables ------------------------------------------------


def _stride(rt, what: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"pe {rt.my_pe}: {what}: stride {name} must be an integer >= 1, got {value!r}")
    return int(value)


def _typed(t: str, op: str):
    """The function ``aclshmem_<t>_<op>``."""
    what = f"aclshmem_{t}_{op}"
    put, block = op in ("put", "put_nbi", "p", "iput"), not op.endswith("_nbi")
    dtype = RMA_TYPES[t]

    def transfer(dst, src, nelems, pe):
        check_type(runtime(), what, t, dst=dst, src=src)
        copy(what, dst, src, nelems, pe, put, block)

    def strided(dest, source, dst, sst, nelems, pe):
        rt = runtime()
        check_type(rt, what, t, dest=dest, source=source)
        n = int(nelems) if isinstance(nelems, (int, np.integer)) and not isinstance(nelems, bool) else -1
        if n < 0:
            raise ValueError(f"pe {rt.my_pe}: {what}: nelems must be a non-negative integer, got {nelems!r}")
        params = non_contiguous_copy_param(n, 1, _stride(rt, what, "sst", sst), _stride(rt, what, "dst", dst))
        copy(what, dest, source, params, pe, put, True)

    def p(dst, value, pe):
        check_type(runtime(), what, t, dst=dst)
        copy(what, dst, np.array([value], dtype), 1, pe, True, True)

    def g(src, pe):
        check_type(runtime(), what, t, src=src)
        out = np.empty(1, src.dtype)
        copy(what, out, src, 1, pe, False, True)
        return out[0]

    fn = {"p": p, "g": g, "iput": strided, "iget": strided}.get(op, transfer)
    fn.__doc__ = {"p": f"Store ``value`` ({t}) into ``dst[0]`` on PE ``pe``; complete on return.",
                  "g": f"The {t} ``src[0]`` of PE ``pe``.",
                  "iput": f"``dest[i * dst] = source[i * sst]`` on PE ``pe`` for ``i < nelems`` ({t}); blocking.",
                  "iget": f"``dest[i * dst] = source[i * sst]`` of PE ``pe`` for ``i < nelems`` ({t}); blocking."
                  }.get(op, f"``{'aclshmem_putmem' if put else 'aclshmem_getmem'}{'_nbi' if not block else ''}`` "
                            f"of ``nelems`` {t} elements (or the rows of a ``non_contiguous_copy_param``).")
    return what, fn


def _sized(bits: int, op: str):
    """The function ``aclshmem_<op-with-bits>``: elements of ``bits`` bits, any dtypes."""
    base, nbi = op.removesuffix("_nbi"), op.endswith("_nbi")
    what = f"aclshmem_{base}{bits}{'_nbi' if nbi else ''}"
    put = base in ("put", "iput")
    dtype = SIZE_DTYPES[bits]

    def transfer(dst, src, nelems, pe):
        rt = runtime()
        copy(what, as_bytes(rt, what, "dst", dst, dtype), as_bytes(rt, what, "src", src, dtype), nelems, pe,
             put, not nbi)

    def strided(dest, source, dst, sst, nelems, pe):
        rt = runtime()
        params = non_contiguous_copy_param(int(nelems), 1, _stride(rt, what, "sst", sst), _stride(rt, what, "dst",
                                                                                                   dst))
        copy(what, as_bytes(rt, what, "dest", dest, dtype), as_bytes(rt, what, "source", source, dtype), params,
             pe, put, True)

    fn = strided if base.startswith("i") else transfer
    fn.__doc__ = f"``{'put' if put else 'get'}`` of ``nelems`` {bits}-bit elements{' (non-blocking)' if nbi else ''}."
    return what, fn


install(__name__, [_typed(t, op) for t in RMA_TYPES
                   for op in ("put", "put_nbi", "get", "get_nbi", "p", "g", "iput", "iget")]
        + [_sized(bits, op) for bits in SIZES for op in ("put", "put_nbi", "get", "get_nbi", "iput", "iget")],
        __all__)
