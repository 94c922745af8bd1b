"""Collective allocation on the symmetric heap: aclshmem_malloc / calloc / align / free and numpy helpers.

Every call is collective (every PE calls it, in the same order, with the same size) and checked: each PE logs
the request and the offset its allocator would give in its control block, all PEs meet in one barrier, and each
compares its entry with every peer's before committing anything. A mismatch raises ``SymmetryError`` on every PE,
and exhaustion raises ``HeapExhaustedError`` on every PE, both with the heap unchanged.

Initial contents (zeros, full, array) are written into the new block before that barrier, so when any PE
returns, every PE's copy is initialised and a peer's first put cannot be overwritten by a late memset. Zeros are
not written but punched out of the heap file, whole pages at a time (``Segment.zero``): a large zeroed window
costs memory only where it is later used.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np
import numpy.typing as npt

from ..errors import HeapExhaustedError, SymmetryError
from ..runtime import runtime
from ..shm.barrier import barrier
from ..shm.control import COLL_LOG, WaitCall
from ..shm.heap import DEFAULT_ALIGN, extent
from ..udma.check.array import wrap
from .checks import check_pe

__all__ = [
    "aclshmem_malloc",
    "aclshmem_calloc",
    "aclshmem_align",
    "aclshmem_free",
    "aclshmem_ptr",
    "empty",
    "zeros",
    "full",
    "array",
    "free",
    "prefault",
    "heap_info",
    "HeapInfo",
    "HOST_SIDE",
    "DEVICE_SIDE",
    "aclshmemx_malloc",
    "aclshmemx_calloc",
    "aclshmemx_align",
    "aclshmemx_free",
    "aclshmemx_get_heap_base",
]

# aclshmem_mem_type_t. Every PE has one symmetric heap here (all of it is host memory), so both kinds come from
# it; which kind an allocation was made as is kept, and aclshmemx_free checks it.
HOST_SIDE, DEVICE_SIDE = 0, 1
_mem_types: dict[tuple[int, int], int] = {}  # (id of the heap, offset) -> the mem_type of an aclshmemx_ allocation


class HeapInfo(NamedTuple):
    """This PE's symmetric heap: ``size`` bytes, ``used`` by live allocations, ``largest_free`` the largest block
    an ``aclshmem_malloc`` could still get (the same on every PE: the allocator is symmetric)."""

    size: int
    used: int
    largest_free: int


def heap_info() -> HeapInfo:
    """The heap's size and what is left of it, so that a library can check a size it was given (e.g.
    ``shmemx.deep_ep.Buffer``'s ``num_nvl_bytes``) before a collective allocation fails."""
    heap = runtime().heap
    return HeapInfo(heap.size, heap.used, heap.largest_hole())


def _op_name(op: WaitCall) -> str:
    return {WaitCall.MALLOC: "aclshmem_malloc", WaitCall.FREE: "aclshmem_free"}[op]


def _agree(rt, op: WaitCall, size: int, align: int, offset: int, name: str) -> int:
    """Log this PE's request, meet every PE, and check that all logged the same; returns the call's number."""
    me = rt.ctl.pes[rt.my_pe]
    seq = int(me["coll_seq"]) + 1
    entry = me["coll"][seq % COLL_LOG]
    entry["seq"], entry["op"], entry["size"], entry["align"], entry["offset"] = seq, op, size, align, offset
    entry["name"] = name.encode()[:31]
    me["coll_seq"] = seq
    barrier(rt, call=op)
    mine = (seq, int(op), size, align, offset)
    for p in range(rt.n_pes):
        e = rt.ctl.pes[p]["coll"][seq % COLL_LOG]
        theirs = (int(e["seq"]), int(e["op"]), int(e["size"]), int(e["align"]), int(e["offset"]))
        if theirs != mine:
            raise SymmetryError(f"pe {rt.my_pe}: {_op_name(op)} call #{seq}: PEs disagree: "
                                f"pe {rt.my_pe} has {_describe(mine)}, pe {p} has {_describe(theirs)}; "
                                f"the heap is unchanged")
    return seq


def _describe(entry: tuple) -> str:
    seq, op, size, align, offset = entry
    if op == WaitCall.FREE:
        return f"free(heap+{offset:#x}) as call #{seq}"
    if op == WaitCall.MALLOC:
        return f"malloc({size} B, align {align}) -> heap+{offset:#x} as call #{seq}"
    return f"call #{seq} {WaitCall(op).name.lower()}"


def _record(rt, offset: int, size: int, name: str) -> None:
    allocs = rt.ctl.pes[rt.my_pe]["allocs"]
    free_slots = np.flatnonzero(allocs["live"] == 0)
    if len(free_slots):  # the table only serves dumps: a full table loses names, not memory
        slot = allocs[int(free_slots[0])]
        slot["offset"], slot["size"], slot["name"] = offset, size, name.encode()[:39]
        slot["live"] = 1
    rt.ctl.pes[rt.my_pe]["heap_used"] = rt.heap.used


def _allocate(size: int, align: int, name: str, fill: Callable[[np.ndarray], None] | None,
              prefault: bool, zero: bool = False) -> np.ndarray:
    rt = runtime()
    heap = rt.heap
    offset = heap.plan(size, align)
    if offset >= 0:
        block = heap.view(rt.my_pe, offset, (size,), np.uint8)
        if zero:  # whole pages are punched out, not written: a large zeroed window costs only what is used
            heap.segments[rt.my_pe].zero(offset, size)
        if prefault:
            heap.segments[rt.my_pe].prefault(offset, size)
        if fill is not None:
            fill(block)
    if rt.events is not None and offset >= 0:  # before the barrier: a peer may write into it right after
        rt.events.alloc(offset, size, name, zero)
    seq = _agree(rt, WaitCall.MALLOC, size, align, offset, name)
    if offset < 0:
        raise HeapExhaustedError(
            f"pe {rt.my_pe}: aclshmem_malloc call #{seq} of {size} B (align {align}, '{name}'): heap exhausted: "
            f"{heap.used} of {heap.size} B in use, largest free block {heap.largest_hole()} B; "
            f"start the job with a larger --heap-size")
    heap.commit(offset, size, name)
    _record(rt, offset, size, name)
    return wrap(heap.view(rt.my_pe, offset, (size,), np.uint8))  # a CheckedArray under --check


def _check_size(what: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{what}: size must be a non-negative integer, got {value!r}")
    return int(value)


def aclshmem_malloc(size: int, *, name: str = "", prefault: bool = True) -> np.ndarray | None:
    """Allocate ``size`` bytes on every PE's heap (collective). Returns a uint8 array, or None for size 0.

    Args:
        size: bytes; the same on every PE (checked).
        name: a label shown by dumps and diagnoses ("allocation 'recv_x' +0x200").
        prefault: map the pages now (default); pass False for large windows that may stay mostly untouched.
    """
    size = _check_size("aclshmem_malloc", size)
    if size == 0:
        return None
    return _allocate(size, DEFAULT_ALIGN, name or "malloc", None, prefault)


def aclshmem_calloc(nmemb: int, size: int, *, name: str = "", prefault: bool = True) -> np.ndarray | None:
    """Allocate ``nmemb * size`` zeroed bytes on every PE (collective)."""
    total = _check_size("aclshmem_calloc", nmemb) * _check_size("aclshmem_calloc", size)
    if total == 0:
        return None
    return _allocate(total, DEFAULT_ALIGN, name or "calloc", None, prefault, zero=True)


def aclshmem_align(alignment: int, size: int, *, name: str = "", prefault: bool = True) -> np.ndarray | None:
    """Allocate ``size`` bytes aligned to ``alignment`` (a power of two) on every PE (collective)."""
    alignment = _check_size("aclshmem_align", alignment)
    if alignment == 0 or alignment & (alignment - 1):
        raise ValueError(f"aclshmem_align: alignment must be a power of two, got {alignment}")
    size = _check_size("aclshmem_align", size)
    if size == 0:
        return None
    return _allocate(size, max(alignment, 1), name or "align", None, prefault)


def aclshmem_free(arr: np.ndarray | None) -> None:
    """Free a heap allocation on every PE (collective); ``arr`` is what the allocation call returned.

    None is a no-op, as NULL is. Freeing a view that does not start an allocation raises ValueError.
    """
    if arr is None:
        return
    rt = runtime()
    pe, offset = rt.heap.locate(arr, "aclshmem_free argument")
    if pe != rt.my_pe or offset not in rt.heap.allocations:
        raise ValueError(f"pe {rt.my_pe}: aclshmem_free: pe {pe} heap+{offset:#x} is not the start of a live "
                         f"allocation of this PE")
    size, _ = rt.heap.allocations[offset]
    _agree(rt, WaitCall.FREE, size, 0, offset, "")
    _mem_types.pop((id(rt.heap), offset), None)
    if rt.events is not None:
        rt.events.free(offset, size)
    rt.heap.release(offset)
    allocs = rt.ctl.pes[rt.my_pe]["allocs"]
    hits = np.flatnonzero((allocs["live"] != 0) & (allocs["offset"] == offset))
    for i in hits:
        allocs[int(i)]["live"] = 0
    rt.ctl.pes[rt.my_pe]["heap_used"] = rt.heap.used


free = aclshmem_free


def _mem_type(what: str, mem_type) -> int:
    if mem_type not in (HOST_SIDE, DEVICE_SIDE) or isinstance(mem_type, bool):
        raise ValueError(f"pe {runtime().my_pe}: {what}: mem_type {mem_type!r} is not HOST_SIDE (0) or "
                         f"DEVICE_SIDE (1)")
    return int(mem_type)


def _typed(block: np.ndarray | None, mem_type: int) -> np.ndarray | None:
    if block is not None:
        rt = runtime()
        _mem_types[(id(rt.heap), rt.heap.locate(block)[1])] = mem_type
    return block


def aclshmemx_malloc(size: int, mem_type: int = DEVICE_SIDE, *, name: str = "") -> np.ndarray | None:
    """``aclshmem_malloc`` of ``mem_type`` memory (HOST_SIDE or DEVICE_SIDE: the same heap here; collective)."""
    mem_type = _mem_type("aclshmemx_malloc", mem_type)
    return _typed(aclshmem_malloc(size, name=name or "xmalloc"), mem_type)


def aclshmemx_calloc(count: int, size: int, mem_type: int = DEVICE_SIDE, *, name: str = "") -> np.ndarray | None:
    """``aclshmem_calloc`` of ``mem_type`` memory (collective)."""
    mem_type = _mem_type("aclshmemx_calloc", mem_type)
    return _typed(aclshmem_calloc(count, size, name=name or "xcalloc"), mem_type)


def aclshmemx_align(alignment: int, size: int, mem_type: int = DEVICE_SIDE, *, name: str = "") -> np.ndarray | None:
    """``aclshmem_align`` of ``mem_type`` memory (collective)."""
    mem_type = _mem_type("aclshmemx_align", mem_type)
    return _typed(aclshmem_align(alignment, size, name=name or "xalign"), mem_type)


def aclshmemx_free(ptr: np.ndarray | None, mem_type: int = DEVICE_SIDE) -> None:
    """Free an ``aclshmemx_malloc/calloc/align`` allocation (collective); ValueError when ``mem_type`` is not
    the one it was made with."""
    mem_type = _mem_type("aclshmemx_free", mem_type)
    if ptr is None:
        return
    rt = runtime()
    _, offset = rt.heap.locate(ptr, "aclshmemx_free argument")
    made = _mem_types.get((id(rt.heap), offset), DEVICE_SIDE)
    if made != mem_type:
        kinds = ("HOST_SIDE", "DEVICE_SIDE")
        raise ValueError(f"pe {rt.my_pe}: aclshmemx_free: heap+{offset:#x} was allocated as {kinds[made]}, freed "
                         f"as {kinds[mem_type]}")
    aclshmem_free(ptr)


def aclshmemx_get_heap_base(mem_type: int = DEVICE_SIDE) -> np.ndarray:
    """This PE's whole symmetric heap as a ``[heap size] uint8`` array (CANN returns its base address; here a
    view starting there, local to this PE). Both mem types are the one heap."""
    _mem_type("aclshmemx_get_heap_base", mem_type)
    rt = runtime()
    return wrap(rt.heap.view(rt.my_pe, 0, (rt.heap.size,), np.uint8))


def aclshmem_ptr(arr: np.ndarray, pe: int) -> np.ndarray:
    """The same-shaped view of ``arr`` (any view of a heap array) in PE ``pe``'s copy of the heap.

    Loads and stores through it are direct accesses to the peer's memory (as MTE on the device); a store does
    not wake the peer's waiters, use ``aclshmemx_signal_op`` or the UDMA API for anything a peer waits on.
    """
    rt = runtime()
    return wrap(rt.heap.peer_view(arr, check_pe(rt, "aclshmem_ptr", pe), "aclshmem_ptr argument"), direct=True)


def prefault(arr: np.ndarray) -> None:
    """Map the pages of a heap view into this process now: this PE's memory or a peer's (an ``aclshmem_ptr``
    view), so that the first loads and stores into it in a timed loop pay no page faults.

    Allocations are pre-faulted by their owner when made (unless ``prefault=False``); a peer's memory is mapped
    into this process page by page on first touch, which costs ~1 us per 4 KiB page. Kernels that store straight
    into peers' windows (MTE, HCCL window mode) warm the parts they will write with this. Pages of a region never
    written before get memory here, so prefault only what the kernel will touch.
    """
    rt = runtime()
    pe, offset = rt.heap.locate(arr, "prefault argument")
    lo, hi = extent(arr)
    if hi > lo:
        rt.heap.segment(pe).prefault(offset + lo, hi - lo)


def _shaped(shape, dtype, name, fill, prefault, zero: bool = False) -> np.ndarray:
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    block = _allocate(max(nbytes, 1), max(DEFAULT_ALIGN, dtype.alignment), name or "array",
                      None if fill is None else lambda b: fill(b[:nbytes].view(dtype).reshape(shape)), prefault,
                      zero)
    return block[:nbytes].view(dtype).reshape(shape)


def empty(shape: int | tuple[int, ...], dtype: npt.DTypeLike = np.float64, *, name: str = "",
          prefault: bool = True) -> np.ndarray:
    """An uninitialised heap array on every PE (collective). Any numpy dtype, including ml_dtypes ones."""
    return _shaped(shape, dtype, name, None, prefault)


def zeros(shape: int | tuple[int, ...], dtype: npt.DTypeLike = np.float64, *, name: str = "",
          prefault: bool = True) -> np.ndarray:
    """A zeroed heap array on every PE (collective)."""
    return _shaped(shape, dtype, name, None, prefault, zero=True)


def full(shape: int | tuple[int, ...], fill_value: object, dtype: npt.DTypeLike = None, *, name: str = "",
         prefault: bool = True) -> np.ndarray:
    """A heap array filled with ``fill_value`` on every PE (collective)."""
    dtype = np.asarray(fill_value).dtype if dtype is None else dtype
    return _shaped(shape, dtype, name, lambda a: a.fill(fill_value), prefault)


def array(obj: npt.ArrayLike, dtype: npt.DTypeLike = None, *, name: str = "", prefault: bool = True) -> np.ndarray:
    """A heap array holding a copy of ``obj`` (collective; ``obj`` may differ per PE, its shape may not)."""
    src = np.asarray(obj, dtype=dtype)
    return _shaped(src.shape, src.dtype, name, lambda a: np.copyto(a, src), prefault)
