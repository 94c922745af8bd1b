"""The happens-before state of the analysis (``analyze``): clocks, lanes, WQEs and the writes of flag words.

A kernel thread (PE, AIV block) has a vector clock ``vc`` over the job's threads and lanes: a thread entry counts
that thread's events, a lane entry (a (PE, peer, QP) send queue) the lane's WQEs, in posting order, known complete;
``extras`` holds, per lane, WQEs known complete beyond that prefix (a put_signal's own payload, what an SO WQE waited
for). A release hands on a ``Rel`` (a copy of both). A ``Wqe`` knows what its completion implies on its QP
(``prefix``, ``extra``: a fence every earlier WQE, SO every earlier RO/SO one, NO and RO nothing). A flag word
keeps its writes in time-stamp order (``Word``, ``Entry``) with the running value, for the waits to find the write
that met them.
"""

from __future__ import annotations

import numpy as np

from ..layout import Odr, Opcode

__all__ = ["Rel", "Thread", "Lane", "Wqe", "Word", "Entry", "compact", "same_bytes", "order_matters", "apply_op", "word_value",
           "odr_text", "WRITE", "READ", "NOTIFY", "FAA", "CAS"]

WRITE, READ, NOTIFY, FAA, CAS = (int(Opcode.WRITE), int(Opcode.READ), int(Opcode.WRITE_WITH_NOTIFY), int(Opcode.FAA),
                                 int(Opcode.CAS))


class Rel:
    """What a release hands on: a clock and the per-lane sets of WQEs known complete beyond its prefixes."""

    __slots__ = ("vc", "extras")

    def __init__(self, vc: np.ndarray, extras: dict):
        self.vc = vc
        self.extras = extras


class Thread:
    __slots__ = ("ti", "pe", "block", "vc", "extras", "clock")

    def __init__(self, ti: int, pe: int, block: int, size: int):
        self.ti, self.pe, self.block = ti, pe, block
        self.vc = np.zeros(size, np.int64)
        self.extras: dict[int, set] = {}
        self.clock = 0

    def tick(self) -> int:
        self.clock += 1
        self.vc[self.ti] = self.clock
        return self.clock

    def release(self) -> Rel:
        return Rel(self.vc.copy(), {li: frozenset(s) for li, s in self.extras.items() if s})


class Lane:
    __slots__ = ("li", "pe", "peer", "qp", "wqes", "by_pos", "wraps", "last_raw", "ordered", "last_user", "reaped")

    def __init__(self, li: int, pe: int, peer: int, qp: int):
        self.li, self.pe, self.peer, self.qp = li, pe, peer, qp
        self.wqes: list = []  # by seq - 1
        self.by_pos: dict[int, "Wqe"] = {}
        self.wraps = 0
        self.last_raw = 0
        self.ordered = (0, frozenset())  # what a later SO WQE waits for: (prefix, extra seqs)
        self.last_user = None  # (thread index, clock, site) of the last post or quiet
        self.reaped = 0  # WQEs retired by a quiet of this lane (in posting order)

    def unwrap(self, raw: int) -> int:
        if raw < self.last_raw and self.last_raw - raw > 1 << 31:
            self.wraps += 1
        elif raw > self.last_raw and raw - self.last_raw > 1 << 31:
            return raw + (self.wraps - 1 << 32)
        self.last_raw = raw
        return raw + (self.wraps << 32)


class Wqe:
    __slots__ = ("lane", "seq", "ti", "clock", "ts", "site", "pe", "opcode", "flag", "api", "pos", "end", "target",
                 "dst", "length", "local_heap", "local", "sig_off", "value", "prefix", "extra", "rel", "reaped",
                 "reported", "cqe", "crc", "atomic", "laddr")

    @property
    def odr(self) -> int:
        return self.flag & 7

    @property
    def fence(self) -> bool:
        return bool(self.flag >> 3 & 1)

    @property
    def qp(self) -> int:
        return self.lane.qp

    @property
    def atomic_read(self) -> bool:
        """A READ of an atomic (the CAS loop's read of ``aclshmemx_udma_atomic_set`` and kin): an atomic load."""
        return self.opcode == READ and bool(self.atomic)


class Word:
    """The writes of one synchronisation word, in time-stamp order: (entry, running value)."""

    __slots__ = ("size", "initial", "entries")

    def __init__(self, size: int, initial):
        self.size, self.initial = size, initial
        self.entries: list = []


class Entry:
    __slots__ = ("ts", "op", "value", "by", "rel", "consumed", "site", "pe", "ti", "cur")

    def __init__(self, ts, op, value, by, rel, site, pe, ti):
        self.ts, self.op, self.value, self.by, self.rel, self.site, self.pe, self.ti = ts, op, value, by, rel, site, pe, ti
        self.consumed: dict[int, set] = {}  # thread index -> the (cmp, value) of the waits that consumed it
        self.cur = None


def compact(prefix: int, extra) -> tuple[int, frozenset]:
    """A lane's known-complete set as (prefix, the WQEs beyond it): consecutive WQEs after the prefix join it."""
    if not extra:
        return prefix, frozenset()
    while prefix + 1 in extra:
        prefix += 1
    return prefix, frozenset(x for x in extra if x > prefix)


def same_bytes(a: Wqe, b: Wqe) -> bool:
    """Two WRITEs of the same bytes (equal source checksums) to the same range: their order changes nothing."""
    return (a.crc is not None and a.crc == b.crc and a.dst == b.dst and a.length == b.length
            and a.target == b.target and a.opcode == b.opcode == WRITE)


def order_matters(old, op: str, value=None) -> bool:
    """Whether two unordered writes of a synchronisation word give a timing-dependent result."""
    if old.op in ("add", "cas") and op in ("add", "cas"):
        return False
    if old.op == "set" and op == "set" and old.value is not None and value is not None and old.value == value:
        return False
    return True


def apply_op(cur, op: str, value, size: int):
    if op == "set":
        return None if value is None else word_value(value, size)
    if op == "add" and cur is not None and value is not None:
        return word_value((cur + value) & ((1 << 8 * size) - 1), size)
    return None


def word_value(value, size: int):
    """``value`` (raw bits) as the word's signed int; comparisons use the dtype's signedness upstream, which
    differs only above 2**(8*size-1), where shmemx's flag values never are."""
    if value is None:
        return None
    value &= (1 << 8 * size) - 1
    return value


def odr_text(odr: int) -> str:
    try:
        return Odr(odr).name
    except ValueError:
        return f"odr{odr}"
