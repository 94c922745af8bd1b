"""Reading a job from outside: who waits on what, decoded from the control segment and the heaps.

Used by the launcher's timeout and failure reports and by ``shmemx dump``. Everything here only reads shared
memory; it never stops, wakes or slows the job beyond the reads.
"""

from __future__ import annotations

import time

import numpy as np

from .control import Control, PeStatus, WaitCall
from .segment import Segment, segment_name

__all__ = ["JobReader", "CMP_NAMES"]

CMP_NAMES = ("==", "!=", ">", ">=", "<", "<=")


class JobReader:
    """Read-only access to a live or stopped job's control segment and heaps."""

    def __init__(self, ctl: Control):
        self.ctl = ctl
        self._heaps: dict[int, Segment | None] = {}

    @classmethod
    def attach(cls, job_id: str) -> "JobReader":
        return cls(Control.attach(job_id, readonly=True))

    def heap(self, pe: int) -> Segment | None:
        if pe not in self._heaps:
            try:
                self._heaps[pe] = Segment(segment_name(self.ctl.job_id, f"heap{pe}"), readonly=True)
            except (FileNotFoundError, ValueError):
                self._heaps[pe] = None
        return self._heaps[pe]

    def read_word(self, pe: int, offset: int, dtype: str, count: int = 1):
        """Current value(s) of a word (or ``count`` words) of PE ``pe``'s heap, or None if unreadable."""
        seg = self.heap(pe)
        dt = np.dtype(dtype)
        if seg is None or offset + dt.itemsize * count > seg.size:
            return None
        values = np.frombuffer(seg.mm, dtype=dt, count=count, offset=offset)
        return values[0].item() if count == 1 else values.tolist()

    def close(self) -> None:
        for seg in self._heaps.values():
            if seg is not None:
                seg.close()
        self._heaps.clear()

    # --- waits ---------------------------------------------------------------------------------------------

    def waits(self) -> list[dict]:
        """One record per thread of any PE that is blocked in a shmemx wait now."""
        out = []
        now = time.time()
        for pe in range(self.ctl.n_pes):
            slots = self.ctl.pes[pe]["waits"]
            for slot_idx in np.flatnonzero(slots["call"] != 0):
                s = slots[int(slot_idx)]
                rec = {
                    "pe": pe,
                    "slot": int(slot_idx),
                    "call": WaitCall(int(s["call"])).name.lower(),
                    "target_pe": int(s["pe"]),
                    "offset": int(s["offset"]),
                    "cmp": int(s["cmp"]),
                    "value": int(s["value"]),
                    "dtype": s["dtype"].decode(),
                    "count": int(s["count"]),
                    "target": int(s["target"]),
                    "qp": int(s["qp"]),
                    "seconds": max(0.0, now - float(s["since"])),
                }
                out.append(rec)
        return out

    def describe_wait(self, w: dict) -> str:
        """One line: ``pe 3 (block 0) waits in signal_wait_until on 'flags'+0x40 == 1, current value 0``."""
        who = f"pe {w['pe']}" + (f" (block {w['slot']})" if w["slot"] else "")
        call = w["call"]
        if call in ("barrier_all", "sync_all", "init", "finalize", "malloc", "free", "sync_vec_all"):
            number = w["target"]
            missing = [p for p in range(self.ctl.n_pes) if int(self.ctl.pes[p]["barriers"]) < number]
            listing = ", ".join(map(str, missing[:16])) + (", ..." if len(missing) > 16 else "")
            return (f"{who} waits in {call} (barrier #{number}) for {w['seconds']:.1f} s; "
                    f"not arrived: pe {listing or 'none'}")
        if w["dtype"]:
            pe = w["target_pe"]
            where = self.ctl.describe_offset(pe, w["offset"])
            value = self._signed(w["value"], w["dtype"])
            current = self.read_word(pe, w["offset"], w["dtype"], min(w["count"], 16))
            cond = f"{CMP_NAMES[w['cmp']]} {value}" if 0 <= w["cmp"] < 6 else ""
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

    def diagnosis(self) -> list[str]:
        """Lines naming, for every PE, what it waits on now (or its state when it waits on nothing)."""
        lines = []
        waits = self.waits()
        waiting_pes = {w["pe"] for w in waits}
        for w in waits:
            lines.append(self.describe_wait(w))
        for pe in range(self.ctl.n_pes):
            if pe in waiting_pes:
                continue
            status = PeStatus(int(self.ctl.pes[pe]["status"]))
            state = {
                PeStatus.NOT_STARTED: "has not started",
                PeStatus.STARTED: "runs, not initialised (no shmemx.init yet), not in a shmemx wait",
                PeStatus.READY: "runs, not in a shmemx wait",
                PeStatus.FINALIZED: "has finalized",
                PeStatus.FAILED: "failed",
                PeStatus.EXITED: "has exited",
            }[status]
            lines.append(f"pe {pe} {state}")
        return lines
