"""The words waits watch, in virtual time: their values as the modelled writes arrive, and the waits on them.

Only what a recording knows the value of is modelled: WRITE_WITH_NOTIFY signals, FAA and CAS, ``signal_op``
SET and ADD, and small payloads (WRITE, notify and MTE payloads of at most 32 bytes: flags and generation
numbers written as data, recorded with their bytes). Every word starts at 0 (a fresh heap is zero-filled). A
larger payload (or a READ) whose range covers a watched word makes the word *unknown* (its bytes were not
recorded): a wait treats an unknown word as met, at the payload's arrival, and the replay warns. Plain stores by the CPU (numpy into a heap view) are not
recorded at all; a kernel that resets its flags with them, instead of moving to the next sequence number or
using ``signal_op``, replays with stale values (the waits then release at the wrong time, and the replay warns
where a recorded result disagrees).
"""

from __future__ import annotations

import bisect
import operator
from typing import Any

import numpy as np

from ...shm.control import WaitCall

__all__ = ["Memory"]

_OPS = (operator.eq, operator.ne, operator.gt, operator.ge, operator.lt, operator.le)
_M64 = (1 << 64) - 1
_SIGNAL_WAIT_UNTIL, _ANY = WaitCall.SIGNAL_WAIT_UNTIL, WaitCall.WAIT_UNTIL_ANY
_ALL_CALLS = frozenset({WaitCall.WAIT_UNTIL, WaitCall.SIGNAL_WAIT_UNTIL, WaitCall.WAIT_UNTIL_ALL})  # every word


class Memory:
    """Sparse 64-bit words per PE: ``{pe: {offset // 8 * 8: u64}}``, and the unknown ones."""

    def __init__(self, n_pes: int):
        self.words: list[dict[int, int]] = [{} for _ in range(n_pes)]
        self.unknown: list[set[int]] = [set() for _ in range(n_pes)]
        self.waiters: list[dict[int, list]] = [{} for _ in range(n_pes)]  # key -> [thread, ...]
        self.last_write: list[dict[int, float]] = [{} for _ in range(n_pes)]

    def read(self, pe: int, offset: int, size: int, signed: bool) -> int:
        v = self.words[pe].get(offset & ~7, 0)
        if size < 8:
            v = v >> 8 * (offset & 7) & ((1 << 8 * size) - 1)
        if signed and v >> (8 * size - 1):
            v -= 1 << 8 * size
        return v

    def is_unknown(self, pe: int, offset: int) -> bool:
        return (offset & ~7) in self.unknown[pe]

    def write(self, pe: int, offset: int, size: int, value: int, t: float) -> int:
        """Store ``size`` bytes of ``value`` at ``offset``; returns the key (for ``wake``)."""
        key = offset & ~7
        words = self.words[pe]
        if size >= 8:
            words[key] = value & _M64
        else:
            shift, mask = 8 * (offset & 7), (1 << 8 * size) - 1
            words[key] = words.get(key, 0) & ~(mask << shift) & _M64 | (value & mask) << shift
        self.unknown[pe].discard(key)
        self.last_write[pe][key] = t
        return key

    def add(self, pe: int, offset: int, size: int, value: int, t: float) -> int:
        return self.write(pe, offset, size, self.read(pe, offset, size, False) + value, t)

    def cas(self, pe: int, offset: int, size: int, compare: int, swap: int, t: float) -> int:
        mask = (1 << 8 * size) - 1
        if self.read(pe, offset, size, False) == compare & mask:
            return self.write(pe, offset, size, swap, t)
        key = offset & ~7
        self.last_write[pe][key] = t
        return key

    def store(self, pe: int, offset: int, data: bytes, t: float) -> list[int]:
        """A payload whose bytes are known (a small one, recorded): store them; returns the keys touched."""
        keys = []
        for key in range(offset & ~7, offset + len(data), 8):
            old = self.words[pe].get(key, 0).to_bytes(8, "little")
            lo, hi = max(offset, key), min(offset + len(data), key + 8)
            new = old[:lo - key] + data[lo - offset:hi - offset] + old[hi - key:]
            self.words[pe][key] = int.from_bytes(new, "little")
            self.unknown[pe].discard(key)
            self.last_write[pe][key] = t
            keys.append(key)
        return keys

    def cover(self, pe: int, start: int, end: int, watched: list, t: float) -> list[int]:
        """A payload write of ``[start, end)`` at ``pe``: the watched words in it become unknown; returns their
        keys. ``watched`` is the sorted offsets of the watched words at ``pe``."""
        keys = []
        i = bisect.bisect_left(watched, start - 7)  # (a word starting up to 7 bytes before may overlap: generous)
        while i < len(watched) and watched[i] < end:
            key = watched[i] & ~7
            self.unknown[pe].add(key)
            self.last_write[pe][key] = t
            keys.append(key)
            i += 1
        return keys

    def met(self, w: Any) -> tuple[bool, int, bool]:
        """Whether wait/test ``w`` (a ``program.Words``) holds now; its result as the call would return it (the
        value, the first index met, the number met, or 1/0); and whether an unknown word counted as met."""
        op = _OPS[w.cmp]
        hits = []
        unknown = False
        for i, off in enumerate(w.offsets):
            if not w.active[i]:
                continue
            if self.is_unknown(w.pe, off):
                unknown = True
                hits.append(i)
            elif op(self._value(w, off), w.values[i]):
                hits.append(i)
        n_active = sum(1 for a in w.active if a)
        if w.call in _ALL_CALLS:
            ok = len(hits) == n_active
            if w.call == _SIGNAL_WAIT_UNTIL and w.offsets:
                return ok, self.read(w.pe, w.offsets[0], w.size, w.signed), unknown
            return ok, int(ok), unknown
        if w.call == _ANY:
            return bool(hits) or n_active == 0, hits[0] if hits else -1, unknown
        return bool(hits) or n_active == 0, len(hits), unknown

    def _value(self, w, off: int):
        """The word at ``off`` as wait ``w`` compares it (a float32 word as a float)."""
        v = self.read(w.pe, off, w.size, w.signed)
        return float(np.array(v, "<u4").view("<f4")) if w.floating else v

    def watch(self, w: Any, thread: Any) -> None:
        for off in w.offsets:
            self.waiters[w.pe].setdefault(off & ~7, []).append(thread)

    def unwatch(self, w: Any, thread: Any) -> None:
        for off in w.offsets:
            lst = self.waiters[w.pe].get(off & ~7)
            if lst and thread in lst:
                lst.remove(thread)

    def last_write_to(self, w: Any) -> float:
        times = [self.last_write[w.pe].get(off & ~7) for off in w.offsets]
        return max((t for t in times if t is not None), default=0.0)
