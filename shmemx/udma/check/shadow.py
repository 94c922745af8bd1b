"""Shadow memory of the analysis: what is known about every byte range of every PE's heap.

A PE's heap is cut into disjoint intervals, each with one immutable ``State``: the writes that may still be
visible there (a WQE's payload, a get's destination, a kernel thread's store, a signal), the reads since the last
write (a kernel thread, its clock and site), the WQEs that will still read it (a WRITE's pinned source, the
source of a remote get), and whether it is a synchronisation word (waited on, signalled, or the target of an
atomic somewhere in the job). An access to ``[lo, hi)`` splits the intervals at ``lo`` and ``hi``, maps each
distinct old state through one function (states are shared by identity, so a 1 MiB write over one state costs
one call) and merges neighbours that end up with the same state.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

__all__ = ["State", "WriteRec", "ReadRec", "Shadow", "EMPTY"]


@dataclass(eq=False, slots=True)
class WriteRec:
    """A write that may be what a reader of its interval sees.

    ``by``: the Wqe whose execution writes it (``kind`` "wqe": a WRITE or WRITE_WITH_NOTIFY payload, "get": a
    READ's destination, "signal": a signal word or an atomic's target), or (thread index, clock) of a kernel
    thread's store ("store", "direct": through an aclshmem_ptr view or by MTE, "signal_op"). ``op`` for synchronisation words: "set", "add" or "cas";
    ``value`` when known. ``prev``: the write it replaced (slot reuse is a write over one its reader consumed).
    """

    by: object
    kind: str
    site: int
    pe: int  # the writer's PE
    op: str = "set"
    value: int | None = None
    prev: "WriteRec | None" = None
    rel: object = None  # what a plain load of a synchronisation word acquires from a store (analyze.Rel)
    width: int = 0  # an atomic (a WQE's FAA / CAS / fp32 add / signal, or a signal_op): its bytes; 0: a plain write
    at: int = -1  # an atomic's first byte (atomics of one width at one address do not race with each other)

    @property
    def reads_only(self) -> bool:
        """An atomic that changes nothing (an FAA of 0: aclshmemx_udma_atomic_fetch): it races with writes only."""
        return self.width and self.op == "add" and self.value == 0


@dataclass(eq=False, slots=True)
class ReadRec:
    ti: int
    clock: int
    site: int
    pe: int


class State:
    """One interval's state (immutable: shared by every interval that has it)."""

    __slots__ = ("writes", "reads", "pins", "sync")

    def __init__(self, writes: tuple = (), reads: tuple = (), pins: tuple = (), sync: bool = False):
        self.writes = writes
        self.reads = reads
        self.pins = pins  # Wqes that read this memory when they execute
        self.sync = sync

    def replace(self, writes=None, reads=None, pins=None, sync=None) -> "State":
        return State(self.writes if writes is None else writes, self.reads if reads is None else reads,
                     self.pins if pins is None else pins, self.sync if sync is None else sync)



EMPTY = State()
_SYNC = State(sync=True)


@dataclass
class Shadow:
    """The intervals of one PE's heap of ``size`` bytes."""

    size: int
    bounds: list = field(default_factory=list)
    states: list = field(default_factory=list)

    def __post_init__(self):
        self.bounds = [0, self.size]
        self.states = [EMPTY, EMPTY]  # the last one is a sentinel for [size, ...)

    def _split(self, x: int) -> int:
        """Index of the interval that starts at ``x`` (splitting the one that contains it)."""
        bounds = self.bounds
        i = bisect.bisect_right(bounds, x) - 1
        if bounds[i] == x:
            return i
        bounds.insert(i + 1, x)
        self.states.insert(i + 1, self.states[i])
        return i + 1

    def update(self, lo: int, hi: int, fn) -> None:
        """``states = fn(state, start)`` for every interval in ``[lo, hi)`` (once per distinct old state, ``start``
        being the first byte it covers there); ``fn`` returning the state itself changes nothing."""
        lo, hi = max(0, lo), min(self.size, hi)
        if hi <= lo:
            return
        i0 = self._split(lo)
        i1 = self._split(hi)
        states, bounds = self.states, self.bounds
        memo: dict[int, State] = {}
        changed = False
        for i in range(i0, i1):
            s = states[i]
            new = memo.get(id(s))
            if new is None:
                new = memo[id(s)] = fn(s, bounds[i])
            if new is not s:
                states[i] = new
                changed = True
        if changed:
            self._merge(max(i0 - 1, 0), min(i1 + 1, len(states) - 1))

    def _merge(self, i0: int, i1: int) -> None:
        states, bounds = self.states, self.bounds
        i = i1
        while i > i0:
            if states[i] is states[i - 1] and i < len(states) - 1:
                del states[i], bounds[i]
            i -= 1

    def states_in(self, lo: int, hi: int):
        """(start, state) of every interval overlapping ``[lo, hi)`` (no split)."""
        bounds = self.bounds
        i = bisect.bisect_right(bounds, lo) - 1
        while i < len(bounds) - 1 and bounds[i] < hi:
            yield max(bounds[i], lo), self.states[i]
            i += 1

    def mark_sync(self, lo: int, hi: int) -> None:
        self.update(lo, hi, lambda s, _: s if s.sync else (_SYNC if s is EMPTY else s.replace(sync=True)))

    def reset(self, lo: int, hi: int) -> None:
        """Fresh memory (an allocation made or freed): nothing written or read there; sync marks stay."""
        self.update(lo, hi, lambda s, _: (_SYNC if s.sync else EMPTY))
