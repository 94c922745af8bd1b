"""Reading a job from outside: its segments, who waits on what, and what its addresses mean.

Used by the launcher's failure reports, ``shmemx ps``, ``shmemx dump`` and ``shmemx clean``. Everything here
maps segments read-only and only reads: it never stops, wakes or slows the job beyond the reads themselves.

* ``list_jobs`` finds the jobs on this machine from their control segments (``/dev/shm/shmemx_<job>_ctl``)
  and tells a live job from a stale one (its launcher's pid is gone: a SIGKILLed launcher leaves its segments).
* ``JobReader`` maps one job's control segment, and on demand each PE's heap and UDMA segment.
* ``VaMap`` turns an emulated device VA into words: ``pe 3 heap +0x1200 ('recv_x'+0x200)``, from the allocation
  tables alone, so that a saved dump describes addresses exactly as a live one does.
"""

from __future__ import annotations

import os
import time

import numpy as np

from .control import Control, JobState, PeStatus, WaitCall, format_heap_offset
from .heap import HEAP_VA_BASE, HEAP_VA_STRIDE
from .resources import LOCAL_VA_BASE, UDMA_VA_BASE, UDMA_VA_STRIDE, UdmaSegment
from .segment import SHM_DIR, Segment, remove_job_segments, segment_name

__all__ = ["JobReader", "VaMap", "CMP_NAMES", "list_jobs", "find_job", "clean_job", "pid_alive"]

CMP_NAMES = ("==", "!=", ">", ">=", "<", "<=")
_BARRIER_CALLS = ("barrier_all", "sync_all", "init", "finalize", "malloc", "free", "sync_vec_all")


def pid_alive(pid: int) -> bool:
    """True while ``pid`` names a live process (a zombie counts as gone)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


# --- jobs on this machine ----------------------------------------------------------------------------------


def _segments_by_job() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return out
    for name in names:
        if name.startswith("shmemx_") and name.count("_") >= 2:
            job = name.split("_", 2)[1]
            out.setdefault(job, []).append(name)
    return out


def list_jobs() -> list[dict]:
    """Every shmemx job with segments in /dev/shm: job, n_pes, script, start time, state, PE statuses, stale.

    A job is stale when its launcher's process is gone (or its control segment is missing or unreadable);
    ``clean_job`` removes such a job's segments.
    """
    jobs = []
    for job, names in sorted(_segments_by_job().items()):
        rec = {"job": job, "segments": len(names), "bytes": _disk_bytes(names), "n_pes": None, "script": "",
               "start_time": None, "state": "NO_CONTROL_SEGMENT", "launcher_pid": 0, "pes": {}, "stale": True}
        try:
            ctl = Control.attach(job, readonly=True)
        except PermissionError:  # another user's job (segments are mode 0600): not ours to judge or clean
            rec.update(state="OTHER_USER", stale=False)
            jobs.append(rec)
            continue
        except ValueError:  # no magic yet: a job being created right now, or the remains of a crash
            young = _age(segment_name(job, "ctl")) < 10.0
            rec.update(state="CREATING" if young else "BROKEN_CONTROL_SEGMENT", stale=not young)
            jobs.append(rec)
            continue
        except OSError:
            jobs.append(rec)
            continue
        try:
            hdr = ctl.header
            statuses: dict[str, int] = {}
            for p in range(ctl.n_pes):
                name = PeStatus(int(ctl.pes[p]["status"])).name
                statuses[name] = statuses.get(name, 0) + 1
            rec.update(n_pes=ctl.n_pes, script=hdr["script"].item().decode(errors="replace"),
                       start_time=float(hdr["start_time"]), state=JobState(int(hdr["state"])).name,
                       launcher_pid=int(hdr["launcher_pid"]), pes=statuses)
            rec["stale"] = not pid_alive(rec["launcher_pid"])
        finally:
            ctl.close()
        jobs.append(rec)
    return jobs


def _age(name: str) -> float:
    """Seconds since the segment file ``name`` was last modified (infinite when it is gone)."""
    try:
        return time.time() - os.stat(os.path.join(SHM_DIR, name)).st_mtime
    except FileNotFoundError:
        return float("inf")


def _disk_bytes(names: list[str]) -> int:
    total = 0
    for name in names:
        try:
            total += os.stat(os.path.join(SHM_DIR, name)).st_blocks * 512
        except FileNotFoundError:
            pass
    return total


def find_job(job: str | None) -> str:
    """The job id ``job`` names (a unique prefix will do), or the one live job when ``job`` is None.

    Raises:
        LookupError: no such job, or several match (the message lists them).
    """
    jobs = list_jobs()
    if job is None:
        live = [j for j in jobs if not j["stale"]]
        if len(live) == 1:
            return live[0]["job"]
        if not live:
            raise LookupError("no live shmemx job on this machine (shmemx ps lists every job)")
        raise LookupError("several live jobs; name one: " + ", ".join(j["job"] for j in live))
    matches = [j["job"] for j in jobs if j["job"].startswith(job)]
    if job in matches:
        return job
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise LookupError(f"no shmemx job {job!r} on this machine (shmemx ps lists every job)")
    raise LookupError(f"{job!r} names several jobs: {', '.join(matches)}")


def clean_job(job: str, *, force: bool = False) -> list[str]:
    """Remove every segment of ``job``; refuses a job whose launcher is alive unless ``force``.

    Returns the names removed. Raises RuntimeError for a live job.
    """
    for rec in list_jobs():
        if rec["job"] == job and not rec["stale"] and not force:
            raise RuntimeError(f"job {job} is alive (launcher pid {rec['launcher_pid']}); stop it first, or "
                               f"use --force")
    return remove_job_segments(job)


# --- addresses -----------------------------------------------------------------------------------------------


class VaMap:
    """Names emulated device VAs from the job's allocation tables and UDMA layout.

    Args:
        n_pes: PEs of the job.
        allocations: ``{pe: [(name, offset, size), ...]}``, the live heap allocations.
        udma: the UDMA segment layout (``udma_layout``), or None when no PE has one.
    """

    def __init__(self, n_pes: int, allocations: dict, udma: dict | None = None):
        self.n_pes = n_pes
        self.allocations = {int(pe): sorted((int(o), int(s), n) for n, o, s in allocs)
                            for pe, allocs in allocations.items()}
        self.udma = udma

    def allocation_at(self, pe: int, offset: int):
        for start, size, name in self.allocations.get(pe, []):
            if start <= offset < start + max(size, 1):
                return name, start, size
        return None

    def describe_offset(self, pe: int, offset: int) -> str:
        """``'recv_x'+0x200`` inside a named allocation, else ``heap+0x1200``."""
        return format_heap_offset(self.allocation_at(pe, offset), offset)

    def describe(self, va: int, local_pe: int | None = None) -> str:
        """``pe 3 heap +0x1200 ('recv_x'+0x200)``, ``pe 0 amo scratch -> pe 3 qp 1 +0x0``, ``pe 0 local 0x..``."""
        if HEAP_VA_BASE <= va < HEAP_VA_BASE + self.n_pes * HEAP_VA_STRIDE:
            pe, off = divmod(va - HEAP_VA_BASE, HEAP_VA_STRIDE)
            name = self.describe_offset(pe, off)
            return f"pe {pe} heap +{off:#x}" + (f" ({name})" if not name.startswith("heap") else "")
        if UDMA_VA_BASE <= va < UDMA_VA_BASE + self.n_pes * UDMA_VA_STRIDE:
            pe, off = divmod(va - UDMA_VA_BASE, UDMA_VA_STRIDE)
            return f"pe {pe} {self._udma_part(off)}"
        if LOCAL_VA_BASE <= va < UDMA_VA_BASE:
            return f"pe {local_pe} local {va:#x}" if local_pe is not None else f"local {va:#x}"
        return f"{va:#x} (unmapped)"

    def _udma_part(self, off: int) -> str:
        u = self.udma
        if u is None:
            return f"udma +{off:#x}"
        qp_num = u["qp_num"]
        for what, base, stride, count in (("amo scratch", u["amo_offset"], 64, u["n_slots"]),
                                          ("SQ", u["sq_offset"], u["sq_bytes"], u["n_slots"]),
                                          ("CQ", u["cq_offset"], u["cq_bytes"], u["n_slots"])):
            if base <= off < base + stride * count:
                index, within = divmod(off - base, stride)
                return f"{what} -> pe {index // qp_num} qp {index % qp_num} +{within:#x}"
        return f"udma +{off:#x}"


def udma_layout(seg: UdmaSegment) -> dict:
    """The offsets ``VaMap`` needs to name addresses inside a UDMA segment (the same for every PE of a job)."""
    return {"qp_num": seg.qp_num, "n_slots": seg.n_slots, "sq_depth": seg.sq_depth, "cq_depth": seg.cq_depth,
            "amo_offset": seg.amo_offset, "sq_offset": seg.sq_offset, "sq_bytes": seg.sq_bytes,
            "cq_offset": seg.cq_offset, "cq_bytes": seg.cq_bytes}


# --- one job ---------------------------------------------------------------------------------------------------


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

    def read_word(self, pe: int, offset: int, dtype: str, count: int = 1):
        """Current value(s) of a word (or ``count`` words) of PE ``pe``'s heap, or None if unreadable."""
        seg = self.heap(pe)
        dt = np.dtype(dtype)
        if seg is None or offset + dt.itemsize * count > seg.size:
            return None
        values = np.frombuffer(seg.mm, dtype=dt, count=count, offset=offset)
        return values[0].item() if count == 1 else values.tolist()

    def allocations(self, pe: int) -> list[tuple[str, int, int]]:
        """PE ``pe``'s live heap allocations: (name, offset, size), by offset."""
        live = self.ctl.live_allocations(pe)
        return sorted(((a["name"].decode(errors="replace"), int(a["offset"]), int(a["size"])) for a in live),
                      key=lambda a: a[1])

    def va_map(self) -> VaMap:
        layout = next((udma_layout(u) for u in (self.udma(p) for p in range(self.n_pes)) if u is not None), None)
        return VaMap(self.n_pes, {p: self.allocations(p) for p in range(self.n_pes)}, layout)

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
        if call in _BARRIER_CALLS:
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
            w["current"] = current
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

    def diagnosis(self) -> list[str]:
        """Lines naming what every PE waits on and which queues hold unexecuted WQEs (see ``dump.diagnosis``)."""
        from .dump import diagnosis, snapshot

        return diagnosis(snapshot(self, limit=0, stats=False))
