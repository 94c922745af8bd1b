"""Local memory registered for the data plane: this PE's heap, its atomic fetch scratch, and local arrays.

A put's source or a get's destination may be an ordinary numpy array of the posting process. It is registered as
an URMA segment of its own for the life of the WQEs that use it: a range of local VAs (``LOCAL_VA_BASE`` up) that
the engine resolves back to the array, and a tokenId. Posting threads register; the engine thread resolves.
"""

from __future__ import annotations

import array
import bisect
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ..shm.heap import HEAP_VA_BASE, HEAP_VA_STRIDE, data_address
from ..shm.segment import PAGE_SIZE, align_up
from .segment import LOCAL_VA_BASE, UdmaSegment

__all__ = ["LocalRegistry", "Registration"]


class Registration:
    """Local memory registered as an URMA segment: ``[va, va + nbytes)`` maps to ``data`` (uint8)."""

    __slots__ = ("va", "nbytes", "tid", "data", "address", "uses", "writable", "live", "busy")

    def __init__(self, va: int, data: np.ndarray, tid: int, address: int):
        self.va = va
        self.nbytes = data.nbytes
        self.tid = tid
        self.data = data
        self.address = address
        self.writable = bool(data.flags.writeable)
        self.uses: dict[int, int] = {}  # queue index -> BB position after its last WQE that used this
        self.live = True  # False once collected (the native posting path checks it)
        self.busy: int | None = None  # the queue whose use ``collect`` found not retired last (checked first)


class LocalRegistry:
    """Local VAs of this PE: its heap, its UDMA segment's amo scratch, and registered local buffers.

    Posting threads register; the engine thread resolves. A registration lives while a WQE that uses it may
    still run: ``collect`` drops those whose last WQE every queue has retired (quiet passed it).
    """

    def __init__(self, pe: int, heap: Any, udma: UdmaSegment, amo_tid: int):
        self.pe = pe
        self.heap = heap
        self.heap_va = HEAP_VA_BASE + pe * HEAP_VA_STRIDE
        self.udma = udma
        self.amo_va = udma.va(pe, udma.amo_offset)
        self.amo_bytes = udma.segment.bytes[udma.amo_offset:udma.amo_offset + 64 * udma.n_slots]
        self.amo_tid = amo_tid
        self._next_va = LOCAL_VA_BASE
        self._next_tid = (amo_tid + 1) & 0xFFFFF or 1
        self._by_address: dict[tuple[int, int], Registration] = {}
        self._lock = threading.Lock()
        self.snapshot: tuple[list[int], list[Registration]] = ([], [])  # sorted VAs, replaced on change
        self._last: Registration | None = None  # the registration va_of returned last (a kernel sends its rows)
        self.sink = None  # the engine's set_locals(vas, lengths, addresses): told of every change
        self.seen = None  # the native posting path's Poster.seen(reg): told of every registration va_of returns
        self.watch = None  # --check's Checker.registered(reg): told of every new registration (a REGISTER record)

    def va_of(self, arr: np.ndarray, writable: bool, what: str, pin: tuple[int, int] | None = None,
              addr: int | None = None) -> tuple[int, Registration | None]:
        """Local VA of a C-contiguous array's first byte; registers it when it is not on this PE's heap.

        Returns (va, registration or None for heap memory). ValueError for another PE's heap memory. ``what``
        (a string, or a function making it) names the argument in errors. ``pin`` = (queue index, BB position):
        record that use under the registry's lock, so that a ``collect`` by another thread (a quiet of another
        queue) cannot drop the registration between this lookup and the caller's post. ``addr``: ``arr``'s
        address, when the caller has it.
        """
        if addr is None:
            addr = data_address(arr)
        last = self._last  # rows of the array used last: no heap lookups, no root walk
        if (last is not None and last.address <= addr and addr + arr.nbytes <= last.address + last.nbytes
                and (last.writable or not writable)):
            with self._lock:
                if last is self._last:  # not collected meanwhile
                    if pin is not None:
                        last.uses[pin[0]] = pin[1]
                    if self.seen is not None:
                        self.seen(last)
                    return last.va + (addr - last.address), last
        off = addr - self.heap.base_addr
        if 0 <= off and self.heap.allocated(off, arr.nbytes):
            return self.heap_va + off, None
        if callable(what):
            what = what()
        found = self.heap.locate_address(addr)
        if found is not None:
            pe, off = found
            if pe != self.pe:
                raise ValueError(f"pe {self.pe}: {what} is pe {pe}'s heap memory; it must be local (this PE's "
                                 f"heap or a local array)")
            self.heap.check_allocated(off, arr.nbytes, what, pe)
            return self.heap_va + off, None
        if writable and not arr.flags.writeable:
            raise ValueError(f"pe {self.pe}: {what} is read-only")
        root = arr
        while isinstance(root.base, np.ndarray):
            root = root.base
        if not root.flags.c_contiguous:
            root = arr
        root_addr = data_address(root)
        if not root_addr <= addr <= addr + arr.nbytes <= root_addr + root.nbytes:
            root, root_addr = arr, addr
        with self._lock:
            reg = self._by_address.get((root_addr, root.nbytes))
            if reg is None:
                reg = self._register(root, root_addr)
            if pin is not None:
                reg.uses[pin[0]] = pin[1]
            self._last = reg
            if self.seen is not None:
                self.seen(reg)
        return reg.va + (addr - root_addr), reg

    def _register(self, root: np.ndarray, root_addr: int) -> Registration:
        """A new registration (the caller holds the lock)."""
        data = root.reshape(-1).view(np.uint8) if root.nbytes else np.zeros(0, np.uint8)
        va = self._next_va + root_addr % PAGE_SIZE
        self._next_va = align_up(va + max(data.nbytes, 1), PAGE_SIZE)
        reg = Registration(va, data, self._next_tid, root_addr)
        self._next_tid = (self._next_tid + 1) & 0xFFFFF or 1
        self._by_address[(root_addr, root.nbytes)] = reg
        self._publish()
        if self.watch is not None:
            self.watch(reg)
        return reg

    def _publish(self) -> None:
        regs = sorted(self._by_address.values(), key=lambda r: r.va)
        self.snapshot = ([r.va for r in regs], regs)
        if self.sink is not None:
            self.sink(array.array("Q", [r.va for r in regs]).tobytes(),
                      array.array("Q", [r.nbytes for r in regs]).tobytes(),
                      array.array("Q", [r.address for r in regs]).tobytes())

    def resolve(self, va: int, length: int) -> tuple[np.ndarray, int] | None:
        """(uint8 buffer, offset) of local ``[va, va+length)``, or None when it is not registered memory."""
        off = va - self.heap_va
        if 0 <= off and off + length <= self.heap.size:
            return self.heap.segments[self.pe].bytes, off
        off = va - self.amo_va
        if 0 <= off and off + length <= self.amo_bytes.nbytes:
            return self.amo_bytes, off
        vas, regs = self.snapshot
        i = bisect.bisect_right(vas, va) - 1
        if i >= 0:
            reg = regs[i]
            off = va - reg.va
            if off + length <= reg.nbytes:
                return reg.data, off
        return None

    def collect(self, retired: Callable[[np.ndarray], np.ndarray]) -> None:
        """Drop registrations whose every use is retired (``retired(queue indices)`` = each queue's BB position
        done, ``[n] int64``)."""
        with self._lock:
            dead = [key for key, reg in self._by_address.items() if _all_retired(reg, retired)]
            if dead:
                for key in dead:
                    reg = self._by_address.pop(key)
                    reg.live = False
                    if reg is self._last:
                        self._last = None
                self._publish()

    def __len__(self) -> int:
        return len(self._by_address)


def _all_retired(reg: Registration, retired: Callable[[np.ndarray], np.ndarray]) -> bool:
    """Whether every queue has retired its last WQE that used ``reg``.

    First the queue found busy last time (a kernel that quiets its peers one at a time, a collect per quiet,
    finds the next one busy at once), then every use in one numpy comparison (a quiet of all 255 peers at once
    retires them all: no walk over them)."""
    uses = reg.uses
    q = reg.busy
    if q is not None:
        pos = uses.get(q)
        if pos is not None and _busy(retired(np.array([q], np.int64)), np.array([pos], np.int64))[0]:
            return False
    n = len(uses)
    queues, positions = np.fromiter(uses.keys(), np.int64, n), np.fromiter(uses.values(), np.int64, n)
    busy = np.flatnonzero(_busy(retired(queues), positions))
    if len(busy):
        reg.busy = int(queues[busy[-1]])
        return False
    return True


def _busy(tails: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Whether each tail is still short of its BB position (32-bit wrapping positions)."""
    return ((tails - positions) & 0xFFFF_FFFF) >= 0x8000_0000


class SharedLocals:
    """The registrations of local arrays, published in a segment of their own (``shmemx_<job>_locals<pe>``) for
    the host's NIC (``udma.nic``) in a job of several hosts: a WQE to another host's PE whose local side is such
    an array is carried by the NIC, which reads or writes the array in this process (``process_vm_readv``), as
    a NIC reads host memory the process registered with it.

    Layout: u64 seq (odd while the table changes: a seqlock), u64 count, then ``MAX`` rows of (VA, length,
    address) sorted by VA.
    """

    MAX = 1 << 16

    def __init__(self, job_id: str, pe: int):
        from ..shm.segment import Segment, segment_name

        self.segment = Segment(segment_name(job_id, f"locals{pe}"), 16 + 24 * self.MAX, create=True)
        self.words = self.segment.view("<u8", 0, (2 + 3 * self.MAX,))

    def publish(self, vas: bytes, lens: bytes, addrs: bytes) -> None:
        rows = np.stack([np.frombuffer(b, np.uint64) for b in (vas, lens, addrs)], axis=1)[: self.MAX]
        w = self.words
        w[0] += 1
        w[2:2 + 3 * len(rows)] = rows.reshape(-1)
        w[1] = len(rows)
        w[0] += 1

    @staticmethod
    def lookup(words: np.ndarray, va: int, length: int) -> int | None:
        """The process address of registered local ``[va, va + length)`` from a mapped table, or None."""
        for _ in range(100):
            seq = int(words[0])
            if seq & 1:
                continue
            n = int(words[1])
            rows = words[2:2 + 3 * n].reshape(n, 3)
            i = int(np.searchsorted(rows[:, 0], va, side="right")) - 1
            found = None
            if i >= 0:
                rva, rlen, addr = (int(x) for x in rows[i])
                if va - rva + length <= rlen:
                    found = addr + va - rva
            if int(words[0]) == seq:
                return found
        return None

    def close(self) -> None:
        self.segment.close()
