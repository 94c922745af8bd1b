"""The typed atomics ``aclshmem_<T>_atomic_*`` for CANN's types: MTE atomics for the own PE and the PEs of the
server, UDMA atomics across servers.

The engine: the server of the target (``api.engines``' servers of ``ranks_per_server()`` PEs) decides, whatever
the job's ``data_op_engine_type``, since SDMA has no atomics and UDMA none to the own PE:

* the own PE and the PEs of its server: ``api.mte_atomics`` (host atomics on the target's heap word: complete
  on return);
* a PE of another server: the UDMA atomics of ``api.udma_atomics`` on QP 0 of the target (needs UDMA in the
  mask) (``add``/``inc`` complete at ``aclshmemx_udma_quiet(pe)``, the others return after their quiet).
  UDMA atomics take 4- and 8-byte integer words (and float32 add); a float32 ``set``/``swap`` goes as the
  word's uint32 bits (CANN's "CAST" forms). int8/int16/half/bfloat16 adds have no UDMA form: to a PE of another
  server they raise, naming both servers.

Types and operations follow ``include/device/gm2gm/shmem_device_amo.h``: ``add`` for int8, int16, half, bfloat16,
int32, float, uint32, int64, uint64; ``set``/``swap`` also for float; the others for int32, int64, uint32, uint64.
Every call returns the old value (a numpy scalar of the type) where CANN's does; the atomicity guarantees are
those of the two engines (``api.mte_atomics`` says what is atomic with respect to what).
"""

from __future__ import annotations


import numpy as np

from ..runtime import runtime
from . import udma_atomics as udma
from .checks import check_pe
from .elements import check_type, install
from .engines import engine_for, ranks_per_server
from .mte_atomics import mte_atomic

__all__: list[str] = []

_INT4 = ("int32", "int64", "uint32", "uint64")
# each operation: (its CANN types, the MTE kind, does it take a value, a compare value, does it return)
_OPS = {
    "add": (("bfloat16", "float", "half", "int16", "int32", "int64", "int8", "uint32", "uint64"), "add", 1, 0, 0),
    "fetch_add": (_INT4, "add", 1, 0, 1),
    "inc": (_INT4, "add", 0, 0, 0),
    "fetch_inc": (_INT4, "add", 0, 0, 1),
    "and": (_INT4, "and", 1, 0, 0), "or": (_INT4, "or", 1, 0, 0), "xor": (_INT4, "xor", 1, 0, 0),
    "fetch_and": (_INT4, "and", 1, 0, 1), "fetch_or": (_INT4, "or", 1, 0, 1), "fetch_xor": (_INT4, "xor", 1, 0, 1),
    "fetch": (_INT4, "fetch", 0, 0, 1),
    "set": (("float",) + _INT4, "set", 1, 0, 0),
    "swap": (("float",) + _INT4, "swap", 1, 0, 1),
    "compare_swap": (_INT4, "cas", 1, 1, 1),
}
_UDMA = {"add": udma.aclshmemx_udma_atomic_add, "fetch_add": udma.aclshmemx_udma_atomic_fetch_add,
         "inc": udma.aclshmemx_udma_atomic_inc, "fetch_inc": udma.aclshmemx_udma_atomic_fetch_inc,
         "and": udma.aclshmemx_udma_atomic_and, "or": udma.aclshmemx_udma_atomic_or,
         "xor": udma.aclshmemx_udma_atomic_xor, "fetch_and": udma.aclshmemx_udma_atomic_fetch_and,
         "fetch_or": udma.aclshmemx_udma_atomic_fetch_or, "fetch_xor": udma.aclshmemx_udma_atomic_fetch_xor,
         "fetch": udma.aclshmemx_udma_atomic_fetch, "set": udma.aclshmemx_udma_atomic_set,
         "swap": udma.aclshmemx_udma_atomic_swap, "compare_swap": udma.aclshmemx_udma_atomic_compare_swap}
_UDMA_DTYPES = {np.dtype(t) for t in ("<i4", "<u4", "<i8", "<u8")}


def _over_udma(what: str, op: str, dst, pe: int, args: tuple):
    """The UDMA atomic of ``op`` (float32 set/swap as uint32 bits); ValueError for a type UDMA cannot update."""
    rt = runtime()
    f32 = dst.dtype == np.float32
    if dst.dtype not in _UDMA_DTYPES and not (f32 and op in ("add", "set", "swap")):
        rps = ranks_per_server()
        raise ValueError(f"pe {rt.my_pe}: {what} to pe {pe}: a {dst.dtype} atomic has no UDMA form (UDMA atomics "
                         f"take 4- and 8-byte integer words, and float32 add); pe {pe} is on server {pe // rps}, "
                         f"this PE on server {rt.my_pe // rps}: {dst.dtype} atomics reach only the own server")
    if f32 and op in ("set", "swap"):
        bits = int(np.float32(args[0]).view(np.uint32))
        old = _UDMA[op](dst.view(np.uint32), bits, pe)
        return None if old is None else np.array(old, np.uint32).view(np.float32)[()]
    try:
        return _UDMA[op](dst, *args, pe)
    except (ValueError, TypeError) as exc:
        exc.add_note(f"(in {what} to pe {pe}, over UDMA)")
        raise


def _make(t: str, op: str):
    types, kind, has_value, has_cond, returns = _OPS[op]
    what = f"aclshmem_{t}_atomic_{op}"

    def run(dst, args: tuple, pe):
        rt = runtime()
        check_type(rt, what, t, **{"src" if op == "fetch" else "dst": dst})
        pe = check_pe(rt, what, pe)
        rps = ranks_per_server()
        if pe // rps == rt.my_pe // rps:
            cond, value = (args[0], args[1]) if has_cond else (0, args[0] if args else 1 if kind == "add" else 0)
            old = mte_atomic(what, kind, dst, pe, value, cond)
        else:
            engine_for(rt, what, pe)  # (raises unless UDMA is enabled)
            old = _over_udma(what, op, dst, pe, args)
        return old if returns else None

    if has_cond:
        def fn(dest, cond, value, pe):
            return run(dest, (cond, value), pe)
    elif has_value:
        def fn(dest, value, pe):
            return run(dest, (value,), pe)
    else:
        def fn(dest, pe):
            return run(dest, (), pe)
    fn.__doc__ = (f"CANN's ``{what}``: {op.replace('_', ' ')} on the {t} word ``dest[0]`` of PE ``pe``"
                  f"{', returning the old value' if returns else ''} (see the module docstring for the engine).")
    return what, fn


install(__name__, (_make(t, op) for op, (types, *_) in _OPS.items() for t in types), __all__)
