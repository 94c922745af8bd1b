"""Benchmark of the foundation's synchronisation: start-up, barrier latency, signal ping-pong and ring hops.

Prints one table. Every figure is the median over repetitions; the signal rows stand beside the raw blocking
primitive measured in the same run, with the ratio shmemx / raw:

* start-up: wall time of ``shmemx run -n N empty.py`` (a subprocess, the real command), N = 8 and 32;
* barrier: time per ``aclshmem_barrier_all`` at 2, 8 and 16 ranks (mean over a batch, median over batches);
* ping-pong: round trip of ``aclshmemx_signal_op(SET)`` -> ``aclshmem_signal_wait_until(EQ)`` between 2 ranks;
* ring: per-hop time of a token passed around 8 ranks the same way;
* raw: the same ping-pong and ring by plain forked processes doing futex WAIT / WAKE on u32 words (one per 64-byte
  line) of a shared mmap, through ``shmemx.shm.futex.futex_wait/futex_wake``, without spinning, exactly as
  ``machine_limits.md`` section 3 measured them. The raw and shmemx runs alternate, so that drift of this
  shared host hits both.

* peer columns when ``scripts/install_peers.sh`` installed them (``scripts/peers.py``; a full run, or
  ``--peers``): shmem4py over Open MPI's OSHMEM (``barrier_all``; ``put``, ``fence``, ``atomic_set`` ->
  ``wait_until`` for the ping-pong) and mpi4py over MPICH (``MPI_Barrier``; ``Send`` -> ``Recv``), each job run
  right after shmemx's job of the same row.

Bars (issue 2): 8 ranks start and exit in at most 0.5 s; the 2-rank round trip and the 8-rank hop at most 1.5x raw.

Usage: ``python scripts/bench_sync.py [--quick] [--check] [--peers | --no-peers]``. ``--quick`` is a smoke run of a
few seconds (its numbers are rough; no peers unless ``--peers``); ``--check`` exits 1 when a bar is missed.
"""

from __future__ import annotations

import argparse
import io
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import shmemx
from shmemx.shm import atomics, futex
from shmemx.launcher import launch

SET, EQ = shmemx.ACLSHMEM_SIGNAL_SET, shmemx.ACLSHMEM_CMP_EQ
LINE = 64  # bytes between two raw futex words: one word per cache line


@dataclass
class Config:
    startup_reps: int
    barrier_iters: int
    barrier_reps: int
    pingpong_rounds: int
    ring_rounds: int
    reps: int  # repetitions per job of the signal measurements
    blocks: int  # alternating raw / shmemx jobs


FULL = Config(startup_reps=5, barrier_iters=400, barrier_reps=7, pingpong_rounds=2000, ring_rounds=250, reps=5,
              blocks=3)
QUICK = Config(startup_reps=2, barrier_iters=100, barrier_reps=3, pingpong_rounds=300, ring_rounds=40, reps=3,
               blocks=1)


# --- start-up ----------------------------------------------------------------------------------------------


def _shmemx_command() -> list[str]:
    script = Path(sys.executable).with_name("shmemx")
    return [str(script)] if script.exists() else [sys.executable, "-m", "shmemx"]


def startup_times(n: int, reps: int, script: Path) -> list[float]:
    """Wall seconds of ``shmemx run -n n script`` (after one warm-up run)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHMEMX_")}
    times = []
    for i in range(reps + 1):
        start = time.perf_counter()
        proc = subprocess.run(_shmemx_command() + ["run", "-n", str(n), str(script)], env=env,
                              capture_output=True, text=True, timeout=120)
        elapsed = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"shmemx run -n {n} {script} failed ({proc.returncode}): {proc.stderr}")
        if i:
            times.append(elapsed)
    return times


# --- jobs of shmemx ranks; PE 0 prints one JSON list of per-repetition figures -----------------------------


def _run_job(n: int, body, *args) -> list[float]:
    out, err = io.StringIO(), io.StringIO()
    code = launch(n, body, args, timeout=300, heap_size="1M", tag_output=False, stdout=out, stderr=err)
    if code != 0:
        raise RuntimeError(f"{body.__name__} on {n} ranks exited {code}: {err.getvalue()}")
    return json.loads(out.getvalue())


def _barrier_body(iters: int, reps: int) -> None:
    shmemx.init()
    for _ in range(20):
        shmemx.aclshmem_barrier_all()
    per_barrier = []
    for _ in range(reps):
        shmemx.aclshmem_barrier_all()
        start = time.perf_counter()
        for _ in range(iters):
            shmemx.aclshmem_barrier_all()
        per_barrier.append((time.perf_counter() - start) / iters)
    if shmemx.my_pe() == 0:
        print(json.dumps(per_barrier))


def _signal_ring_body(rounds: int, reps: int) -> None:
    """A token around all PEs: PE 0 sets PE 1's word, each PE waits for its word, then sets the next PE's."""
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    token = shmemx.zeros(1, np.int64, name="token")
    nxt = (me + 1) % n
    shmemx.aclshmem_barrier_all()
    per_round = []
    value = 0
    for rep in range(reps + 1):  # repetition 0 warms up
        start = time.perf_counter()
        for _ in range(rounds):
            value += 1
            if me == 0:
                shmemx.aclshmemx_signal_op(token, value, SET, nxt)
            shmemx.aclshmem_signal_wait_until(token, EQ, value)
            if me != 0:
                shmemx.aclshmemx_signal_op(token, value, SET, nxt)
        if rep:
            per_round.append((time.perf_counter() - start) / rounds)
    if me == 0:
        print(json.dumps(per_round))


# --- the raw primitive: forked processes, futex words in a shared mmap -------------------------------------


def _raw_ring_member(k: int, n: int, words: np.ndarray, base: int, rounds: int, reps: int, out: np.ndarray) -> None:
    mine, nxt = words[k * LINE // 4:k * LINE // 4 + 1], (k + 1) % n
    theirs, my_addr, nxt_addr = words[nxt * LINE // 4:nxt * LINE // 4 + 1], base + k * LINE, base + nxt * LINE
    value = 0
    for rep in range(reps + 1):
        start = time.perf_counter()
        for _ in range(rounds):
            value += 1
            if k == 0:
                theirs[0] = value
                futex.futex_wake(nxt_addr)
            while True:
                seen = int(mine[0])
                if seen == value:
                    break
                futex.futex_wait(my_addr, seen, 0.25)
            if k != 0:
                theirs[0] = value
                futex.futex_wake(nxt_addr)
        if rep and k == 0:
            out[rep - 1] = (time.perf_counter() - start) / rounds


def raw_ring(n: int, rounds: int, reps: int) -> list[float]:
    """Per-round seconds of the token ring over ``n`` plain processes blocking on futexes (n=2: ping-pong)."""
    mm = mmap.mmap(-1, n * LINE + 8 * reps)  # MAP_SHARED | MAP_ANONYMOUS: shared with the forked children
    words = np.frombuffer(mm, np.uint32, count=n * LINE // 4)
    out = np.frombuffer(mm, np.float64, count=reps, offset=n * LINE)
    base = atomics.address_of(mm)
    children = []
    for k in range(1, n):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _raw_ring_member(k, n, words, base, rounds, reps, out)
            except BaseException:
                code = 1
            os._exit(code)
        children.append(pid)
    _raw_ring_member(0, n, words, base, rounds, reps, out)
    for pid in children:
        _, status = os.waitpid(pid, 0)
        if status:
            raise RuntimeError(f"raw ring member {pid} failed with status {status}")
    result = out.tolist()
    del words, out
    mm.close()
    return result


def paired(n: int, rounds: int, cfg: Config, peer_names=()) -> tuple[list[float], list[float], dict]:
    """Per-round seconds of the raw ring and of the shmemx ring on ``n`` ranks, alternating jobs; with
    ``peer_names`` (2 ranks), each peer's ping-pong round trips too, after each shmemx job."""
    import peers

    raw, shm, theirs = [], [], {}
    for _ in range(cfg.blocks):
        raw += raw_ring(n, rounds, cfg.reps)
        shm += _run_job(n, _signal_ring_body, rounds, cfg.reps)
        for peer in peer_names:
            got = peers.run(peer, "pingpong", 2, {"samples": cfg.reps, "pingpong_rounds": rounds}) or {}
            theirs.setdefault(peer, []).extend(2 * v for v in got.get("pingpong", []))  # half -> round trip
    return raw, shm, theirs


def _peer_barriers(n: int, cfg: Config, peer_names) -> dict:
    import peers

    out = {}
    for peer in peer_names:
        got = peers.run(peer, "barrier", n, {"samples": cfg.barrier_reps, "barriers": cfg.barrier_iters}) or {}
        if got.get("barrier"):
            out[peer] = got["barrier"]
    return out


# --- the table ---------------------------------------------------------------------------------------------


def _fmt(seconds: float, unit: str) -> str:
    return f"{seconds:.3f} s" if unit == "s" else f"{seconds * 1e6:.1f} us"


def _spread(values: list[float], unit: str) -> str:
    scale = 1.0 if unit == "s" else 1e6
    return f"{min(values) * scale:.3g}..{max(values) * scale:.3g}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds (rough numbers)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a bar is missed")
    parser.add_argument("--peers", dest="peers", action="store_true", default=None,
                        help="measure the installed peers (the default of a full run)")
    parser.add_argument("--no-peers", dest="peers", action="store_false", help="measure shmemx only")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import peers

    want = (not args.quick) if args.peers is None else args.peers
    peer_names = [p for p, found in peers.available().items() if want and found]
    rows = []  # (what, unit, shmemx values, raw values or None, bar text, passed or None, {peer: values})

    with tempfile.TemporaryDirectory() as tmp:
        empty = Path(tmp) / "empty.py"
        empty.write_text("")
        for n, bar in ((8, 0.5), (32, None)):
            times = startup_times(n, cfg.startup_reps, empty)
            ok = None if bar is None else statistics.median(times) <= bar
            rows.append((f"start-up + exit, {n} ranks, empty script", "s", times, None,
                         f"<= {bar} s" if bar else "", ok, {}))
    for n in (2, 8, 16):
        mine = _run_job(n, _barrier_body, cfg.barrier_iters, cfg.barrier_reps)
        rows.append((f"barrier_all, {n} ranks", "us", mine, None, "", None, _peer_barriers(n, cfg, peer_names)))
    raw, shm, theirs = paired(2, cfg.pingpong_rounds, cfg, peer_names)
    rows.append(("signal ping-pong round trip, 2 ranks", "us", shm, raw, "<= 1.5x raw",
                 statistics.median(shm) <= 1.5 * statistics.median(raw), theirs))
    raw, shm, _ = paired(8, cfg.ring_rounds, cfg)
    hop = lambda values: [v / 8 for v in values]  # noqa: E731 - per-hop time of an 8-rank round
    rows.append(("signal ring, per hop, 8 ranks", "us", hop(shm), hop(raw), "<= 1.5x raw",
                 statistics.median(shm) <= 1.5 * statistics.median(raw), {}))

    cores = len(os.sched_getaffinity(0))
    load = os.getloadavg()[0]  # other work on the machine: above ~1 per core, latencies measure the scheduler
    print(f"shmemx bench_sync ({'quick' if args.quick else 'full'} run; {cores} cores, load {load:.1f}; medians "
          f"over repetitions, min..max in brackets)")
    peer_cols = "".join(f" {p:>24}" for p in peer_names)
    header = f"{'measurement':<42} {'shmemx':>24} {'raw futex':>24} {'ratio':>7}{peer_cols}  {'bar':<12} result"
    print(header)
    print("-" * len(header))
    failed = 0
    for what, unit, values, raw_values, bar, ok, peer_values in rows:
        mine = f"{_fmt(statistics.median(values), unit)} [{_spread(values, unit)}]"
        theirs = ratio = ""
        if raw_values:
            theirs = f"{_fmt(statistics.median(raw_values), unit)} [{_spread(raw_values, unit)}]"
            ratio = f"{statistics.median(values) / statistics.median(raw_values):.2f}x"
        result = "" if ok is None else ("ok" if ok else "MISSED")
        failed += ok is False
        extra = "".join(f" {_cell(peer_values.get(p), unit):>24}" for p in peer_names)
        print(f"{what:<42} {mine:>24} {theirs:>24} {ratio:>7}{extra}  {bar:<12} {result}")
    if peer_names:
        print("peers: shmem4py = barrier_all / put, fence, atomic_set -> wait_until over Open MPI OSHMEM; "
              "mpi = MPI_Barrier / Send -> Recv over MPICH")
    elif want:
        print("peer columns skipped: not installed (bash scripts/install_peers.sh)")
    return 1 if args.check and failed else 0


def _cell(values, unit: str) -> str:
    return f"{_fmt(statistics.median(values), unit)} [{_spread(values, unit)}]" if values else ""


if __name__ == "__main__":
    sys.exit(main())
