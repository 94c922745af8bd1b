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

    def close(self, peers) -> None:
        """Free the allocation (collective), unless some PE still holds an array over a slot: then none frees
        it (the arrays keep their rows for the rest of the job, as fresh arrays would)."""
        if self.block is None:
            return
        flags = shmemx.zeros(1, np.int64, name="moe_recv_slots_held")
        flags[0] = int(self.held())
        peers.barrier()
        got = np.zeros(1, np.int64)
        held = False
        for p in range(peers.n_pes):
            shmemx.aclshmem_getmem(got, flags, 8, peers.pe(p))
            held = held or bool(got[0])
        peers.barrier()
        shmemx.aclshmem_free(flags)
        if not held:
            shmemx.aclshmem_free(self.block)
        self.block = None
