"""Reading one job from outside: its control segment, heaps and UDMA segments, who waits on what, and what its
heap offsets are called.

Used by the launcher's failure reports and ``shmemx dump``. ``JobReader`` maps a job's control segment, and on
demand each PE's heap and UDMA segment, all read-only: it never stops, wakes or slows the job beyond the reads
themselves. ``Allocations`` names heap offsets from the allocation tables alone, so that a saved dump describes
addresses exactly as a live one does (through ``udma.describe.VaNames``).
"""

from __future__ import annotations

import time

import numpy as np

from ..shm.control import BARRIER_WAIT_NAMES, CMP_SYMBOLS, Control, PeStatus, WaitCall, find_allocation, \
    format_heap_offset
from ..shm.segment import Segment, segment_name
from ..udma.describe import VaNames
from ..udma.segment import UdmaSegment

__all__ = ["JobReader", "Allocations"]


class Allocations:
    """Every PE's live heap allocations, ``{pe: [(name, offset, size), ...]}``, and what a heap offset lies in."""

    def __init__(self, tables: dict):
        self.tables = {int(pe): sorted(((n, int(o), int(sz)) for n, o, sz in allocs), key=lambda a: a[1])
                       for pe, allocs in tables.items()}

    def describe_offset(self, pe: int, offset: int) -> str:
        """``'recv_x'+0x200`` inside a named allocation, else ``heap+0x1200``."""
        return format_heap_offset(find_allocation(self.tables.get(pe, []), offset), offset)


class JobReader:
    """Read-only access to a live or stopped job's control segment, heaps and UDMA segments."""

    def __init__(self, ctl: Control):
        self.ctl = ctl
        self.job_id = ctl.job_id
        self.n_pes = ctl.n_pes
        self._heaps: dict[int, Segment | None] = {}
        self._udma: dict[int, UdmaSegment | None] = {}

    @classmethod
    def attach(cls, job_id: str) -> "JobReader":
        return cls(Control.attach(job_id, readonly=True))

    def heap(self, pe: int) -> Segment | None:
        if pe not in self._heaps:
            try:
                self._heaps[pe] = Segment(segment_name(self.job_id, f"heap{pe}"), readonly=True)
            except (FileNotFoundError, ValueError):
                self._heaps[pe] = None
        return self._heaps[pe]

    def udma(self, pe: int) -> UdmaSegment | None:
        """PE ``pe``'s UDMA segment mapped read-only, or None (not initialised yet, or removed)."""
        if pe not in self._udma:
            try:
                seg = UdmaSegment.attach(self.job_id, pe)
                self._udma[pe] = seg if seg.n_pes == self.n_pes else None
            except (FileNotFoundError, ValueError, AssertionError):
                self._udma[pe] = None
        return self._udma[pe]

    def read_word(self, pe: int, offset: int, dtype: str, count: int = 1) -> int | float | np.ndarray | None:
        """Current value(s) of a word (or ``count`` words) of PE ``pe``'s heap, or None if unreadable."""
        seg = self.heap(pe)
        dt = np.dtype(dtype)
        if seg is None or offset + dt.itemsize * count > seg.size:
            return None
        values = np.frombuffer(seg.mm, dtype=dt, count=count, offset=offset)
        return values[0].item() if count == 1 else values.tolist()

    def allocations(self, pe: int) -> list[tuple[str, int, int]]:
        """PE ``pe``'s live heap allocations: (name, offset, size), by offset."""
        return self.ctl.allocations(pe)

    def allocation_tables(self) -> Allocations:
        return Allocations({p: self.allocations(p) for p in range(self.n_pes)})

    def udma_layout(self) -> dict | None:
        """The UDMA segment layout (the same on every PE), or None when no PE has a UDMA segment."""
        return next((u.layout() for u in (self.udma(p) for p in range(self.n_pes)) if u is not None), None)

    def va_names(self, allocations: Allocations | None = None) -> VaNames:
        allocations = allocations or self.allocation_tables()
        return VaNames(self.n_pes, allocations.describe_offset, self.udma_layout())

    def close(self) -> None:
        for seg in self._heaps.values():
            if seg is not None:
                seg.close()
        for seg in self._udma.values():
            if seg is not None:
                seg.close()
        self._heaps.clear()
        self._udma.clear()

    # --- waits ---------------------------------------------------------------------------------------------

    def waits(self) -> list[dict]:
        """One record per thread of any PE that is blocked in a shmemx wait now."""
        out = []
        now = time.time()
        for pe in range(self.ctl.n_pes):
            slots = self.ctl.pes[pe]["waits"]
            for slot_idx in np.flatnonzero(slots["call"] != 0):
                s = slots[int(slot_idx)].copy()  # one consistent copy of a record its thread may be rewriting
                try:
                    call = WaitCall(int(s["call"])).name.lower()
                except ValueError:
                    continue
                out.append({
                    "pe": pe,
                    "slot": int(slot_idx),
                    "call": call,
                    "target_pe": int(s["pe"]),
                    "offset": int(s["offset"]),
                    "cmp": int(s["cmp"]),
                    "value": int(s["value"]),
                    "dtype": s["dtype"].decode(errors="replace"),
                    "count": int(s["count"]),
                    "target": int(s["target"]),
                    "qp": int(s["qp"]),
                    "seconds": max(0.0, now - float(s["since"])),
                })
        return out

    def describe_wait(self, w: dict) -> str:
        """One line: ``pe 3 (block 1) waits in signal_wait_until on 'flags'+0x40 == 1, current value 0 (...)``.

        Also sets ``w["current"]`` (the word's value now) for waits on heap words.
        """
        who = f"pe {w['pe']}" + (f" (block {w['slot']})" if w["slot"] else "")
        call = w["call"]
        if call in BARRIER_WAIT_NAMES:
            number = w["target"]
            missing = [p for p in range(self.ctl.n_pes) if int(self.ctl.pes[p]["barriers"]) < number]
            listing = ", ".join(map(str, missing[:16])) + (", ..." if len(missing) > 16 else "")
            return (f"{who} waits in {call} (barrier #{number}) for {w['seconds']:.1f} s; "
                    f"not arrived: pe {listing or 'none'}")
        if call in ("team_barrier", "team_split"):  # (shm.barrier: the slot in ``offset``, the number in ``target``)
            slot = w["offset"]
            members = "" if slot else "; every PE is a member (ACLSHMEM_TEAM_WORLD)"
            return (f"{who} waits in {call} of team {slot} (its barrier #{w['target']}) for {w['seconds']:.1f} s"
                    f"{members}")
        if w["dtype"]:
            pe = w["target_pe"]
            where = self.ctl.describe_offset(pe, w["offset"])
            value = self._signed(w["value"], w["dtype"])
            current = self.read_word(pe, w["offset"], w["dtype"], min(w["count"], 16))
            w["current"] = current
            cond = f"{CMP_SYMBOLS[w['cmp']]} {value}" if 0 <= w["cmp"] < 6 else ""
            words = f"{w['count']} words at " if w["count"] > 1 else ""
            owner = f" of pe {pe}" if pe != w["pe"] else ""
            return (f"{who} waits in {call} on {words}{where}{owner} {cond}, current value {current} "
                    f"(for {w['seconds']:.1f} s)")
        detail = f" to pe {w['target_pe']} qp {w['qp']}" if w["target_pe"] >= 0 else ""
        return f"{who} waits in {call}{detail} for {w['seconds']:.1f} s"

    @staticmethod
    def _signed(raw: int, dtype: str) -> int:
        """The recorded raw 64 bits of a comparison value, read back as the word's dtype."""
        dt = np.dtype(dtype)
        return np.array([raw], dtype="<u8").view("<u1")[: dt.itemsize].view(dt)[0].item()

    def pe_state(self, pe: int) -> str:
        """What a PE that waits on nothing is doing: "runs, not in a shmemx wait", "has exited", ..."""
        status = PeStatus(int(self.ctl.pes[pe]["status"]))
        return {
            PeStatus.NOT_STARTED: "has not started",
            PeStatus.STARTED: "runs, not initialised (no shmemx.init yet), not in a shmemx wait",
            PeStatus.READY: "runs, not in a shmemx wait",
            PeStatus.FINALIZED: "has finalized",
            PeStatus.FAILED: "failed",
            PeStatus.EXITED: "has exited",
        }[status]
