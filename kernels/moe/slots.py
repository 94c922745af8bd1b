"""Receive slots: where a fresh dispatch's rows land when ``recv_x`` is handed out as it arrived (no copy-out).

By default a dispatch returns ``recv_x`` as an array of its own (DeepEP returns fresh tensors): the rows land in
the workspace's ``x`` region and the receiver copies them out, one more copy of every received row (the copy
lower bound of ``scripts/bench_moe.py`` counts one per row and way). A ``RecvSlots`` is a second symmetric
allocation of ``SLOTS`` regions the size of ``x``: a fresh dispatch of the full mesh picks a slot that no array it
handed out still views, names it in its notify record (``recv_slot``), the senders write its rows there, and
``recv_x`` is a plain array over that slot. The slot is not used again while any view of it lives (the array's
owner is counted, as ``OutputPool`` counts its bases), so the array keeps its rows as long as its holder keeps
it, as a fresh array would. When every slot is still held, when the allocation did not fit the heap, and for
cached dispatches (no notify names a slot), the rows land in ``x`` and are copied out as before.

Slot 0 is the workspace's ``x``; slots 1..SLOTS are this allocation's. Every PE makes the same allocation (or none:
the heap is symmetric, so it fits everywhere or nowhere).
"""

from __future__ import annotations

import sys

import numpy as np

import shmemx

__all__ = ["RecvSlots", "SLOTS"]

SLOTS = 2  # a dispatch/combine loop holds the last dispatch's result while it makes the next: two alternate


class RecvSlots:
    """The spare receive regions of a ``Buffer`` (see the module docstring).

    Args:
        workspace: the Buffer's workspace allocation (offsets are relative to it on every PE).
        x_offset: the byte offset of the workspace's ``x`` region (slot 0).
        nbytes: the size of one slot (the ``x`` region's).
        me: this PE's team rank (for messages).
    """

    def __init__(self, workspace: np.ndarray, x_offset: int, nbytes: int, me: int):
        self.nbytes = int(nbytes)
        self.me = me
        self.owners: list[np.ndarray | None] = [None] * SLOTS
        if _ORPHANS:
            _reclaim()
        try:
            self.block = shmemx.aclshmem_malloc(SLOTS * self.nbytes, name="moe_recv_slots", prefault=False)
        except shmemx.HeapExhaustedError:  # on every PE alike: dispatch copies out of ``x`` as before
            self.block = None
        base = workspace.__array_interface__["data"][0]
        # byte offset of each slot from the workspace's start, the same on every PE (symmetric heap)
        self.offsets = [int(x_offset)]
        if self.block is not None:
            start = self.block.__array_interface__["data"][0] - base
            self.offsets += [start + k * self.nbytes for k in range(SLOTS)]

    @property
    def count(self) -> int:
        """Slots besides ``x`` (0 when the allocation did not fit the heap)."""
        return 0 if self.block is None else SLOTS

    def _free(self, k: int) -> bool:
        """Whether no handed-out array views slot k + 1 any more."""
        # references: the list and getrefcount's argument; more = a caller holds a view
        return self.owners[k] is None or sys.getrefcount(self.owners[k]) == 2

    def pick(self) -> int:
        """A slot no handed-out array still views (1..SLOTS), or 0 (``x``, copied out) when there is none."""
        for k in range(self.count):
            if self._free(k):
                self.owners[k] = None
                return k + 1
        return 0

    def region(self, slot: int) -> np.ndarray:
        """The bytes of slot ``slot`` (1..) as the kernel writes them (a heap view)."""
        lo = (slot - 1) * self.nbytes
        return self.block[lo:lo + self.nbytes]

    def hand_out(self, slot: int, rows: int, cols: int, dtype: np.dtype) -> np.ndarray:
        """``[rows, cols]`` of ``dtype`` over slot ``slot``: a plain array whose owner this object counts."""
        dtype = np.dtype(dtype)
        owner = np.frombuffer(memoryview(self.region(slot)), dtype, count=rows * cols)
        self.owners[slot - 1] = owner  # views of it keep it (its base is a memoryview, not an array)
        return owner.reshape(rows, cols)

    def remote_offsets(self, slots: np.ndarray) -> np.ndarray:
        """``[P] uint64`` workspace offsets of the receive region each PE named (``slots[p]``)."""
        table = np.array([o % (1 << 64) for o in self.offsets], np.uint64)  # a slot below x wraps around
        return table[np.asarray(slots, np.intp)]

    def held(self) -> bool:
        """Whether a handed-out array still views a slot."""
        return not all(self._free(k) for k in range(SLOTS))

    def close(self) -> None:
        """Free the allocation (collective over the job, as the allocation was), unless some PE still holds an
        array over a slot: then it stays allocated, an orphan that a later ``RecvSlots`` (or ``close``) frees
        once no PE holds it (the arrays keep their rows as fresh arrays would)."""
        if self.block is not None:
            _ORPHANS.append(self)
        _reclaim()


_ORPHANS: list[RecvSlots] = []  # closed slots some PE still held; the same list on every PE (collective calls)


def _held_anywhere(slots: RecvSlots) -> bool:
    """Whether any PE of the job still holds an array over one of its ``slots`` (collective over the job)."""
    flags = shmemx.zeros(1, np.int64, name="moe_recv_slots_held")
    flags[0] = int(slots.held())
    shmemx.aclshmem_barrier_all()
    got = np.zeros(1, np.int64)
    held = False
    for pe in range(shmemx.n_pes()):
        shmemx.aclshmem_getmem(got, flags, 8, pe)
        held = held or bool(got[0])
    shmemx.aclshmem_barrier_all()
    shmemx.aclshmem_free(flags)
    return held


def _reclaim() -> None:
    """Free every orphaned slot allocation no PE holds any more (collective over the job)."""
    for slots in list(_ORPHANS):
        if not _held_anywhere(slots):
            shmemx.aclshmem_free(slots.block)
            slots.block = None
            _ORPHANS.remove(slots)
