"""The symmetric heap: one shared-memory segment per PE, the same allocations at the same offsets on every PE.

Each PE creates its own heap segment (``shmemx_<job>_heap<pe>``) at init and maps every peer's, so a heap array
is a plain numpy view, and any view (slice) of it maps back to (pe, offset) by its address. Allocation is
collective: every PE runs the same deterministic first-fit allocator, and each call is checked, not assumed, to
be symmetric: every PE logs (op, size, alignment, the offset it computed) in its control block, all PEs meet in a
barrier, and each compares its entry with every peer's before anything is committed. A mismatch raises
``SymmetryError`` on every PE and leaves every heap as it was.

Pages are pre-faulted when an allocation is made, in the owning process (``Segment.prefault``), rather than all
at init: windows that a kernel never touches (HCCL-style communication windows of hundreds of MB) then cost
nothing, while every allocation a kernel uses is warm. See the README's design section.

Emulated device addresses: PE p's heap occupies ``[HEAP_VA_BASE + p * HEAP_VA_STRIDE, ... + heap_size)`` in the
job-wide VA map that WQEs carry.
"""

from __future__ import annotations

from collections.abc import Iterable

import bisect
import ctypes

import numpy as np
import numpy.typing as npt

from ..errors import HeapExhaustedError, OtherHostError
from .segment import SHM_DIR, Segment, describe_shm_space, segment_name, shm_space

__all__ = ["Heap", "HEAP_VA_BASE", "HEAP_VA_STRIDE", "DEFAULT_ALIGN", "OtherHostError", "data_address", "extent"]

HEAP_VA_BASE = 0x1000_0000_0000
HEAP_VA_STRIDE = 1 << 36  # 64 GiB of VA per PE
DEFAULT_ALIGN = 64


_addressof = ctypes.addressof
_from_buffer = ctypes.c_char.from_buffer
_pointer_at = ctypes.c_void_p.from_address
# PyArrayObject (numpy's public C struct) starts with PyObject_HEAD, then ``char *data``: reading that pointer
# costs 0.2 us against 0.5 us for a ctypes buffer import. Checked against __array_interface__ at import.
_DATA_FIELD = object.__basicsize__


def _data_pointer(arr: np.ndarray) -> int:
    return _pointer_at(id(arr) + _DATA_FIELD).value or 0


def _slow_address(arr: np.ndarray) -> int:
    try:
        return _addressof(_from_buffer(arr))
    except (TypeError, ValueError, BufferError):
        return arr.__array_interface__["data"][0]


def _layout_known() -> bool:
    probe = np.arange(24, dtype=np.int64).reshape(4, 6)[1:, 2:]
    frozen = np.frombuffer(bytes(64), np.uint8)[8:]
    derived = probe.view(type("Sub", (np.ndarray,), {}))[1:]  # a subclass's instance (it gets a __dict__)
    return all(_data_pointer(a) == a.__array_interface__["data"][0] for a in (probe, probe[2], frozen, derived))


def data_address(arr: np.ndarray) -> int:
    """Address of ``arr``'s first element in this process (runs twice per posted WQE, hence the struct read; a
    subclass's instances, check mode's heap views, start with the same struct)."""
    if isinstance(arr, np.ndarray):
        return _data_pointer(arr)
    return _slow_address(arr)


if not _layout_known():  # an unusual numpy / Python build: use the portable (slower) way
    data_address = _slow_address  # noqa: F811


def extent(arr: np.ndarray) -> tuple[int, int]:
    """Byte range ``[lo, hi)`` that ``arr`` spans, relative to its first element (handles negative strides)."""
    lo = hi = 0
    for n, s in zip(arr.shape, arr.strides):
        if n == 0:
            return 0, 0
        if s < 0:
            lo += (n - 1) * s
        else:
            hi += (n - 1) * s
    return lo, hi + arr.itemsize


class Heap:
    """This PE's view of every PE's heap segment, and the allocator (identical on every PE).

    Args:
        job_id, my_pe, n_pes: the job.
        size: heap bytes per PE.
    """

    def __init__(self, job_id: str, my_pe: int, n_pes: int, size: int):
        self.job_id = job_id
        self.my_pe = my_pe
        self.n_pes = n_pes
        self.size = size
        total, _ = shm_space()
        if size > total:  # sparse files of any size can be made, but touching a page past the limit is SIGBUS
            raise HeapExhaustedError(f"pe {my_pe}: a heap of {size} B ({size / 2**30:.1f} GiB) per PE cannot be backed "
                                     f"by {SHM_DIR} ({describe_shm_space()}): give a smaller --heap-size")
        self.segments: list[Segment | None] = [None] * n_pes
        self.segments[my_pe] = Segment(segment_name(job_id, f"heap{my_pe}"), size, create=True)
        self.base_addr = self.segments[my_pe].addr  # this process's address of its own heap
        self._free: list[tuple[int, int]] = [(0, size)]  # sorted (offset, length) holes
        self.allocations: dict[int, tuple[int, str]] = {}  # offset -> (size, name)
        self._alloc_starts: list[int] = []  # sorted keys of allocations
        self._last_hit = (0, 0)  # [start, end) of the allocation ``allocated`` found last
        self.on_change = None  # called with the heap after every commit and release (the native posting path)
        self._starts: list[int] = []  # sorted mapping addresses, for locate()
        self._pes: list[int] = []

    def attach_peers(self, local: Iterable[int] | None = None) -> None:
        """Map every peer's heap (they exist once every PE passed init's barrier); with ``local`` (the PEs of this
        host, a job of several hosts), only those: another host's heap is reached through its NIC only."""
        for pe in range(self.n_pes) if local is None else local:
            if self.segments[pe] is None:
                self.segments[pe] = Segment(segment_name(self.job_id, f"heap{pe}"))
        pairs = sorted((seg.addr, pe) for pe, seg in enumerate(self.segments) if seg is not None)
        self._starts = [a for a, _ in pairs]
        self._pes = [p for _, p in pairs]

    def close(self) -> None:
        for seg in self.segments:
            if seg is not None:
                seg.close()
        self.segments = []
        self._starts = []

    # --- addresses -----------------------------------------------------------------------------------------

    @staticmethod
    def va(pe: int, offset: int) -> int:
        """Emulated device VA of byte ``offset`` of PE ``pe``'s heap."""
        return HEAP_VA_BASE + pe * HEAP_VA_STRIDE + offset

    def locate_address(self, addr: int) -> tuple[int, int] | None:
        """(pe, offset) of a process address inside some heap mapping, else None."""
        mine = self.segments[self.my_pe]
        off = addr - mine.addr
        if 0 <= off < self.size:
            return self.my_pe, off
        i = bisect.bisect_right(self._starts, addr) - 1
        if i >= 0:
            off = addr - self._starts[i]
            if off < self.size:
                return self._pes[i], off
        return None

    def locate(self, arr: np.ndarray, what: str = "array") -> tuple[int, int]:
        """(pe, heap offset of the first element) of a heap view; ValueError for memory not on the heap."""
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"pe {self.my_pe}: {what} must be a numpy array view of the symmetric heap, "
                            f"got {type(arr).__name__}")
        found = self.locate_address(data_address(arr))
        if found is None:
            raise ValueError(f"pe {self.my_pe}: {what} is not on the symmetric heap "
                             f"(allocate it with shmemx.zeros/empty/aclshmem_malloc)")
        pe, off = found
        lo, hi = extent(arr)
        if off + lo < 0 or off + hi > self.size:
            raise ValueError(f"pe {self.my_pe}: {what} spans heap bytes {off + lo:#x}..{off + hi:#x}, "
                             f"outside the heap of pe {pe} (size {self.size:#x})")
        self.check_allocated(off + lo, hi - lo, what, pe)
        return pe, off

    def allocated(self, offset: int, nbytes: int) -> bool:
        """True when ``[offset, offset+nbytes)`` lies inside one live allocation (runs twice per posted WQE:
        the last allocation hit is checked first)."""
        lo, hi = self._last_hit
        if lo <= offset and offset + nbytes <= hi:
            return True
        starts = self._alloc_starts
        i = bisect.bisect_right(starts, offset) - 1
        if i >= 0 and offset + nbytes <= starts[i] + self.allocations[starts[i]][0]:
            self._last_hit = (starts[i], starts[i] + self.allocations[starts[i]][0])
            return True
        return False

    def allocation_start(self, offset: int) -> int:
        """Start offset of the live allocation holding heap byte ``offset``, or -1."""
        starts = self._alloc_starts
        i = bisect.bisect_right(starts, offset) - 1
        if i >= 0 and offset < starts[i] + max(self.allocations[starts[i]][0], 1):
            return starts[i]
        return -1

    def check_allocated(self, offset: int, nbytes: int, what: str, pe: int) -> None:
        """Raise ValueError unless ``[offset, offset+nbytes)`` lies inside one live allocation."""
        starts = self._alloc_starts
        i = bisect.bisect_right(starts, offset) - 1
        if i >= 0:
            start = starts[i]
            size, _ = self.allocations[start]
            if offset + nbytes <= start + size:
                return
        raise ValueError(f"pe {self.my_pe}: {what} (pe {pe} heap {offset:#x}..{offset + nbytes:#x}) is not "
                         f"inside a live heap allocation (freed, or never allocated)")

    def segment(self, pe: int) -> Segment:
        """PE ``pe``'s heap segment as mapped here; OtherHostError for a PE of another host (not mapped)."""
        seg = self.segments[pe]
        if seg is None:
            raise OtherHostError(f"pe {self.my_pe}: pe {pe} is on another host: its heap is not mapped here, so "
                                 f"direct loads and stores and MTE copies cannot reach it (as on the hardware); "
                                 f"use the UDMA calls (aclshmemx_udma_*), which go through the host's NIC")
        return seg

    def view(self, pe: int, offset: int, shape: int | tuple[int, ...], dtype: npt.DTypeLike,
             strides: tuple[int, ...] | None = None) -> np.ndarray:
        """An ndarray over PE ``pe``'s heap at ``offset`` (the first element's offset)."""
        seg = self.segments[pe]
        if seg is None:
            seg = self.segment(pe)  # raises
        return np.ndarray(shape, dtype=dtype, buffer=seg.mm, offset=offset, strides=strides)

    def peer_view(self, arr: np.ndarray, pe: int, what: str = "array") -> np.ndarray:
        """The same-shaped view of ``arr`` in PE ``pe``'s copy of the heap."""
        _, off = self.locate(arr, what)
        return self.view(pe, off, arr.shape, arr.dtype, arr.strides)

    # --- the allocator (identical on every PE; the collective checking lives in memory.py) -----------------

    def plan(self, size: int, align: int) -> int:
        """Offset where ``size`` bytes aligned to ``align`` would go, or -1 when nothing fits."""
        for hole_off, hole_len in self._free:
            start = -(-hole_off // align) * align
            if start + size <= hole_off + hole_len:
                return start
        return -1

    def largest_hole(self) -> int:
        return max((length for _, length in self._free), default=0)

    def commit(self, offset: int, size: int, name: str) -> None:
        """Carve ``[offset, offset+size)`` out of its hole (``offset`` came from ``plan``)."""
        for i, (hole_off, hole_len) in enumerate(self._free):
            if hole_off <= offset and offset + size <= hole_off + hole_len:
                pieces = []
                if offset > hole_off:
                    pieces.append((hole_off, offset - hole_off))
                if offset + size < hole_off + hole_len:
                    pieces.append((offset + size, hole_off + hole_len - offset - size))
                self._free[i:i + 1] = pieces
                self.allocations[offset] = (size, name)
                bisect.insort(self._alloc_starts, offset)
                if self.on_change is not None:
                    self.on_change(self)
                return
        raise HeapExhaustedError(f"pe {self.my_pe}: internal: no hole holds {offset:#x}+{size:#x}")

    def release(self, offset: int) -> None:
        size, _ = self.allocations.pop(offset)
        self._alloc_starts.remove(offset)
        self._last_hit = (0, 0)
        if self.on_change is not None:
            self.on_change(self)
        if size == 0:
            return
        bisect.insort(self._free, (offset, size))
        merged: list[tuple[int, int]] = []
        for off, length in self._free:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((off, length))
        self._free = merged

    @property
    def used(self) -> int:
        return sum(size for size, _ in self.allocations.values())
