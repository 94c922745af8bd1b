"""The shmemx jobs on this machine: finding them from their segments, telling live from stale, cleaning up.

Used by ``shmemx ps`` / ``clean`` / ``dump`` and the launcher. A job is found by its control segment
(``/dev/shm/shmemx_<job>_ctl``); it is stale when its launcher's process is gone (a SIGKILLed launcher whose
reaper did not get to run, or the remains of a crash), and ``clean_job`` removes such a job's segments.
Everything here only maps segments read-only and reads them.
"""

from __future__ import annotations

import os
import time

from ..shm.control import Control, JobState, PeStatus
from ..shm.hosts import base_job_id
from ..shm.segment import SHM_DIR, remove_job_segments, segment_name

__all__ = ["list_jobs", "find_job", "clean_job", "pid_alive"]


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

    A host's part of a job of several hosts (``shmemx run --hosts``) is a job of its own here (``<job>.h<k>``)
    with ``base`` (the job), ``n_hosts``, ``host`` and ``host_pes`` ([first PE, PEs]); its PE statuses count its
    own PEs. A job of one host has ``base`` = its id and ``n_hosts`` = 1.

    A job is stale when its launcher's process is gone (or its control segment is missing or unreadable);
    ``clean_job`` removes such a job's segments.
    """
    jobs = []
    for job, names in sorted(_segments_by_job().items()):
        rec = {"job": job, "segments": len(names), "bytes": _disk_bytes(names), "n_pes": None, "script": "",
               "start_time": None, "state": "NO_CONTROL_SEGMENT", "launcher_pid": 0, "pes": {}, "stale": True,
               "base": base_job_id(job), "n_hosts": 1, "host": 0, "host_pes": None}
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
            first, count = (int(hdr["host_first_pe"]), int(hdr["host_pes"])) if int(hdr["n_hosts"]) > 1 \
                else (0, ctl.n_pes)
            statuses: dict[str, int] = {}
            for p in range(first, first + count):  # (a host's own PEs: the other hosts' rows are copies)
                name = PeStatus(int(ctl.pes[p]["status"])).name
                statuses[name] = statuses.get(name, 0) + 1
            rec.update(n_pes=ctl.n_pes, script=hdr["script"].item().decode(errors="replace"),
                       start_time=float(hdr["start_time"]), state=JobState(int(hdr["state"])).name,
                       launcher_pid=int(hdr["launcher_pid"]), pes=statuses, base=base_job_id(job),
                       n_hosts=max(1, int(hdr["n_hosts"])), host=int(hdr["host"]), host_pes=[first, count])
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
