"""Per-rank memory of a shmemx job at several job sizes: private and shared pages of every rank process.

    python scripts/rank_memory.py --ranks 8 64 -- scripts/examples/moe_demo.py
    SHMEMX_SQ_DEPTH=1024 python scripts/rank_memory.py --ranks 8 64 128 256 --heap-size 256M -- \\
        scripts/examples/moe_demo.py

For each job size P it runs ``shmemx run -n P --heap-size HEAP SCRIPT ARGS`` (this interpreter's shmemx) and
samples ``/proc/<pid>/smaps_rollup`` of every rank process (the launcher's children but its reaper)
every ``--interval`` seconds until the job ends, keeping each rank's peak of each figure. It prints one row per
job size: the median and the largest rank's peak private pages (Private_Clean + Private_Dirty: this rank's
alone, mostly its interpreter, numpy and its own arrays), shared pages (Shared_Clean + Shared_Dirty: the heaps,
queues and control pages it touched, which other ranks map too, plus the shared libraries), PSS (its fair share
of both), the sum of every rank's PSS peak (about what the job costs the machine), the lowest MemAvailable seen
(``/proc/meminfo``), the job's wall time and its exit status. Run jobs of 64 ranks and more under the machine's
heavy-job lock and one size at a time, watching ``free -g``.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time

FIELDS = ("Rss", "Pss", "Shared_Clean", "Shared_Dirty", "Private_Clean", "Private_Dirty", "Anonymous")


def rollup(pid: int) -> dict | None:
    """The kB figures of ``/proc/<pid>/smaps_rollup``, or None when the process is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            text = f.read()
    except OSError:
        return None
    out = {}
    for line in text.splitlines()[1:]:
        name, _, rest = line.partition(":")
        if name in FIELDS:
            out[name] = int(rest.split()[0])
    return out


def children() -> dict[int, list[int]]:
    """ppid -> pids of every process now."""
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def ranks_of(launcher: int) -> list[int]:
    """The rank processes of the launcher ``launcher``: its children (it forks one per rank), but its reaper."""
    found = []
    for pid in children().get(launcher, ()):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == "shmemx-reaper":
                    continue
        except OSError:
            continue
        found.append(pid)
    return found


def mem_available_kb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1])
    return 0


def measure(n: int, heap: str, command: list[str], interval: float, timeout: float, floor_mb: float) -> dict:
    """Run the job of ``n`` ranks and sample it; the peaks per rank and the job's figures. The job is stopped
    (SIGINT to the launcher, which stops its ranks) when MemAvailable falls below ``floor_mb``: better than the
    kernel's out-of-memory killer choosing among every process of the machine."""
    argv = [sys.executable, "-m", "shmemx", "run", "-n", str(n), "--heap-size", heap, *command]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks: dict[int, dict] = {}
    low = mem_available_kb()
    stopped = False
    out_lines: list[str] = []
    import threading

    reader = threading.Thread(target=lambda: out_lines.extend(proc.stdout), daemon=True)
    reader.start()
    while proc.poll() is None:
        if time.perf_counter() - t0 > timeout:
            proc.kill()
            break
        for pid in ranks_of(proc.pid):
            r = rollup(pid)
            if r:
                peak = peaks.setdefault(pid, dict.fromkeys(FIELDS, 0))
                for k in FIELDS:
                    peak[k] = max(peak[k], r.get(k, 0))
        low = min(low, mem_available_kb())
        if low < floor_mb * 1024 and not stopped:
            print(f"  {n} ranks: MemAvailable {low // 1024} MB < {floor_mb:.0f} MB: stopping the job", flush=True)
            proc.send_signal(signal.SIGINT)
            stopped = True
        time.sleep(interval)
    proc.wait()
    reader.join(5)
    wall = time.perf_counter() - t0
    rows = list(peaks.values())
    private = [r["Private_Clean"] + r["Private_Dirty"] for r in rows]
    shared = [r["Shared_Clean"] + r["Shared_Dirty"] for r in rows]
    pss = [r["Pss"] for r in rows]
    passed = sum("PASS" in line for line in out_lines)
    return dict(n=n, sampled=len(rows), private=private, shared=shared, pss=pss, low=low, wall=wall,
                code=proc.returncode, passed=passed, tail=out_lines[-5:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--heap-size", default="256M")
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--floor-mb", type=float, default=1500,
                    help="stop the job when MemAvailable falls below this many MB (default 1500)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS...")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the script to run after --")
    print(f"shmemx rank_memory: shmemx run -n P --heap-size {args.heap_size} {' '.join(command)} "
          f"(SHMEMX_SQ_DEPTH={os.environ.get('SHMEMX_SQ_DEPTH', 'default')}); peaks per rank of smaps_rollup, MB")
    print(f"{'ranks':>5} {'sampled':>7} {'private med':>11} {'private max':>11} {'shared med':>10} "
          f"{'shared max':>10} {'PSS med':>8} {'PSS sum':>8} {'avail min':>9} {'wall s':>7} {'exit':>4} {'PASS':>5}")
    for n in args.ranks:
        r = measure(n, args.heap_size, command, args.interval, args.timeout, args.floor_mb)
        mb = lambda v: v / 1024  # noqa: E731
        med = lambda v: mb(statistics.median(v)) if v else 0.0  # noqa: E731
        print(f"{n:>5} {r['sampled']:>7} {med(r['private']):11.1f} {mb(max(r['private'], default=0)):11.1f} "
              f"{med(r['shared']):10.1f} {mb(max(r['shared'], default=0)):10.1f} {med(r['pss']):8.1f} "
              f"{mb(sum(r['pss'])):8.0f} {mb(r['low']):9.0f} {r['wall']:7.1f} {r['code']:>4} {r['passed']:>5}",
              flush=True)
        if r["code"] != 0:
            print("  job output ends:", *r["tail"], sep="\n  ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
