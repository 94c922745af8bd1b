"""Non-contiguous MTE copies: ``repeat`` rows of ``length`` elements, rows ``src_ld`` / ``dst_ld`` elements apart.

CANN's overloads ``aclshmemx_mte_put_nbi(dst, src, buf, ub_size, copy_params, pe, sync_id)`` (and ``_get_nbi``,
and the typed ``aclshmem_<T>_put_nbi(dst, src, copy_params, pe)``) take a ``non_contiguous_copy_param`` in place
of the element count. Here ``aclshmemx_mte_put_nbi(dst, src, copy_params, pe)`` does the same (``api.rma``
passes such calls to ``put``/``get`` below): row r of the source starts at element ``r * src_ld`` of ``src``,
row r of the destination at ``r * dst_ld`` of ``dst`` (both counted from the arrays' first element, in the
arrays' dtype; the arrays are C-contiguous and must hold ``(repeat - 1) * ld + length`` elements). Like the
contiguous MTE copies, the calling thread copies directly and the copy is complete when the call returns; it is
recorded and checked as one MTE copy per row, and the target's waiters are woken once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ..runtime import runtime
from .checks import check_contiguous, check_pe, symmetric_offset

__all__ = ["non_contiguous_copy_param", "put", "get", "rows_needed"]


@dataclass(frozen=True)
class non_contiguous_copy_param:
    """CANN's ``non_contiguous_copy_param``: ``repeat`` rows of ``length`` elements; row r at ``r * src_ld`` of
    the source and ``r * dst_ld`` of the destination (elements)."""

    repeat: int
    length: int
    src_ld: int
    dst_ld: int


def _check(rt, where: str, p) -> tuple[int, int, int, int]:
    if not isinstance(p, non_contiguous_copy_param):
        raise TypeError(f"pe {rt.my_pe}: {where}: copy_params must be a non_contiguous_copy_param, got {p!r}")
    vals = (p.repeat, p.length, p.src_ld, p.dst_ld)
    if any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0 for v in vals):
        raise ValueError(f"pe {rt.my_pe}: {where}: {p} has a field that is not a non-negative integer")
    if p.repeat > 1 and p.dst_ld < p.length:
        raise ValueError(f"pe {rt.my_pe}: {where}: dst_ld {p.dst_ld} < length {p.length}: destination rows would "
                         f"overlap")
    return tuple(int(v) for v in vals)


def rows_needed(repeat: int, length: int, ld: int) -> int:
    """Elements a side of a strided copy spans: ``(repeat - 1) * ld + length`` (0 when it moves nothing)."""
    return 0 if repeat == 0 or length == 0 else (repeat - 1) * ld + length


def _side(rt, where: str, role: str, arr, need: int) -> np.ndarray:
    check_contiguous(rt, where, role, arr, "(rows are counted from its first element)")
    if arr.size < need:
        raise ValueError(f"pe {rt.my_pe}: {where}: {role} has {arr.size} elements, the copy spans {need}")
    return arr.view(np.ndarray).reshape(-1)


def _rows(flat: np.ndarray, repeat: int, length: int, ld: int) -> np.ndarray:
    isz = flat.itemsize
    return as_strided(flat, shape=(repeat, length), strides=(ld * isz, isz), writeable=flat.flags.writeable)


def _copy(what: str, dst, src, params, pe, put: bool) -> None:
    rt = runtime()
    pe = check_pe(rt, what, pe)
    where = f"{what} {'to' if put else 'from'} pe {pe}"
    repeat, length, src_ld, dst_ld = _check(rt, where, params)
    dneed, sneed = rows_needed(repeat, length, dst_ld), rows_needed(repeat, length, src_ld)
    d, s = _side(rt, where, "dst", dst, dneed), _side(rt, where, "src", src, sneed)
    if d.dtype != s.dtype:
        raise TypeError(f"pe {rt.my_pe}: {where}: dtype mismatch (dst {d.dtype}, src {s.dtype})")
    if not dneed:
        return
    isz = d.itemsize
    sym, ld, need = (dst, dst_ld, dneed) if put else (src, src_ld, sneed)
    offset = symmetric_offset(rt, where, sym, need * isz, pe, "dst" if put else "src")
    remote = rt.heap.view(pe, offset, (need,), d.dtype)
    if put:
        d = remote
    else:
        s = remote
    drows, srows = _rows(d, repeat, length, dst_ld), _rows(s, repeat, length, src_ld)
    ev = rt.events
    ck = ev.checker if ev is not None else None
    for r in range(repeat):
        if ev is not None:
            ev.mte(pe, offset + r * ld * isz, length * isz, put, srows[r] if put else None)
        if ck is not None and put:  # a release: recorded before the copy (as the contiguous copies)
            ck.mte(pe, offset + r * ld * isz, length * isz, True, srows[r])
    np.copyto(drows, srows)
    if put:
        rt.ctl.wake(pe)
    elif ck is not None:
        for r in range(repeat):
            ck.mte(pe, offset + r * ld * isz, length * isz, False, drows[r])


def put(what: str, dst, src, params, pe) -> None:
    """The strided MTE put of ``params`` (see the module docstring)."""
    _copy(what, dst, src, params, pe, True)


def get(what: str, dst, src, params, pe) -> None:
    """The strided MTE get of ``params``."""
    _copy(what, dst, src, params, pe, False)
