"""One path: observed runs run the code that plain runs run, and what observing costs.

    flock /tmp/shmemx-heavy.lock python scripts/one_path.py                   # DeepEP's shape, 3 rounds
    python scripts/one_path.py --tokens 128 --hidden 1024 --experts 64 --rounds 1   # the small shape (a test)

Runs the default ``moe.Buffer(T, H, K, E)`` (fixed inputs, ``--calls`` dispatch + combine pairs) on 8 PEs as
separate jobs: plain, ``--check``, ``--chaos 1``, ``--trace``, ``--record``, and plain confined to one core
(``taskset -c 0``), in interleaved rounds (noise on this shared machine drifts over seconds). Two tables:

* the counters every PE's ``shmemx.stats()`` gives after the calls (``wqes_posted``, ``bytes_posted``,
  ``doorbells``, ``quiets``, ``block_syncs``, ``cqes_consumed``): each mode's must equal the plain run's on every
  PE (a row says ``same`` or names the PEs and counters that differ; exit status 1 then);
* the time of one dispatch + combine pair (the slowest PE's median over the calls, the median over the rounds)
  and its ratio to the plain run's. The bars (issue 23): ``--check`` at most 1.5x, ``--record`` and ``--trace``
  at most 1.3x, ``--chaos`` at most 2x. Beside it the CPU time of a pair (every PE's process CPU seconds over
  the calls, engine threads included, summed over the PEs, per pair; the median over the rounds) and its ratio:
  less noisy than wall time on a shared machine, where other jobs take the cores.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

COUNTERS = ("wqes_posted", "bytes_posted", "doorbells", "quiets", "block_syncs", "cqes_consumed")
MODES = ("plain", "check", "chaos", "trace", "record", "taskset")
BARS = {"check": 1.5, "record": 1.3, "trace": 1.3, "chaos": 2.0}


def body(tokens: int, hidden: int, topk: int, experts: int, calls: int) -> None:
    """The rank body: the default Buffer's dispatch + combine, ``calls`` times, timed; prints JSON lines."""
    import ml_dtypes
    import numpy as np

    import shmemx
    from shmemx.kernels import moe

    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    rng = np.random.default_rng(1000 + me)
    x = rng.standard_normal((tokens, hidden)).astype(ml_dtypes.bfloat16)
    idx = np.argsort(rng.random((tokens, experts)), axis=1)[:, :topk].astype(np.int64)
    weights = rng.random(idx.shape).astype(np.float32)
    buf = moe.Buffer(tokens, hidden, topk, experts)
    shmemx.aclshmem_barrier_all()
    times = []
    cpu0 = time.process_time()
    for _ in range(calls):
        t0 = time.perf_counter()
        d = buf.dispatch(x, topk_idx=idx, topk_weights=weights)
        buf.combine(d.recv_x, d.handle, d.recv_topk_weights)
        times.append(time.perf_counter() - t0)
    cpu_s = (time.process_time() - cpu0) / calls
    shmemx.aclshmem_barrier_all()
    print(json.dumps({"pe": me, "pair_s": statistics.median(times), "cpu_s": cpu_s}), flush=True)
    stats = shmemx.stats().per_pe()
    if me == 0:
        zeros = [0] * n  # (a build before these counters: scripts/ab_compare.py times it beside this one)
        print(json.dumps({"counters": {k: [int(v) for v in stats.get(k, zeros)] for k in COUNTERS}}), flush=True)
    buf.close()
    shmemx.finalize()


def run(mode: str, args, tmp: str) -> dict:
    """One job of ``mode``: {"counters": {name: [per pe]}, "pair_s": slowest PE's median, "cpu_s": the PEs' CPU
    seconds per pair, summed}."""
    cmd = [sys.executable, "-m", "shmemx", "run", "-n", str(args.pes), "--no-tag-output", "--timeout", "900"]
    cmd += {"check": ["--check"], "chaos": ["--chaos", "1"], "trace": ["--trace", os.path.join(tmp, "t.json")],
            "record": ["--record", os.path.join(tmp, "r.rec")]}.get(mode, [])
    cmd += [os.path.abspath(__file__), "--body", str(args.tokens), str(args.hidden), str(args.topk),
            str(args.experts), str(args.calls)]
    if mode == "taskset":
        cmd = ["taskset", "-c", "0"] + cmd
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        sys.exit(f"{mode}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    if mode == "check" and "no findings" not in done.stderr:
        sys.exit(f"{mode}: the sanitizer found something:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    counters = next(r["counters"] for r in rows if "counters" in r)
    times = [r for r in rows if "pair_s" in r]
    return {"counters": counters, "pair_s": max(r["pair_s"] for r in times),
            "cpu_s": sum(r.get("cpu_s", 0.0) for r in times)}


def differences(plain: dict, other: dict) -> str:
    bad = []
    for name in COUNTERS:
        pes = [pe for pe, (a, b) in enumerate(zip(plain[name], other[name])) if a != b]
        if pes:
            bad.append(f"{name} on pe {pes[:4]} ({other[name][pes[0]]} vs {plain[name][pes[0]]})")
    return "same" if not bad else "; ".join(bad)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pes", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = ap.parse_args()
    results: dict[str, list] = {m: [] for m in args.modes}
    with tempfile.TemporaryDirectory(prefix="shmemx_one_path_") as tmp:
        for _ in range(args.rounds):
            for mode in args.modes:
                results[mode].append(run(mode, args, tmp))
    plain = results.get("plain") or results[args.modes[0]]
    print(f"default moe.Buffer({args.tokens}, {args.hidden}, {args.topk}, {args.experts}) on {args.pes} PEs, "
          f"{args.calls} dispatch + combine pairs per job, {args.rounds} rounds")
    print(f"\n{'mode':8} counters ({', '.join(COUNTERS)}) against the plain run, every round")
    failed = False
    for mode in args.modes:
        verdicts = {differences(plain[0]["counters"], r["counters"]) for r in results[mode]}
        failed |= verdicts != {"same"}
        print(f"{mode:8} {' | '.join(sorted(verdicts))}")
    base = statistics.median(r["pair_s"] for r in plain)
    cpu_base = statistics.median(r["cpu_s"] for r in plain) or float("nan")
    print(f"\n{'mode':8} {'pair ms':>9} {'x plain':>8} {'cpu ms':>9} {'x plain':>8} {'bar':>6}")
    for mode in args.modes:
        t = statistics.median(r["pair_s"] for r in results[mode])
        cpu = statistics.median(r["cpu_s"] for r in results[mode])
        bar = BARS.get(mode)
        verdict = "" if bar is None else ("PASS" if t / base <= bar else "MISS")
        print(f"{mode:8} {t * 1e3:9.2f} {t / base:8.3f} {cpu * 1e3:9.2f} {cpu / cpu_base:8.3f} "
              f"{'' if bar is None else f'{bar:.1f}x':>6} {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--body":
        body(*(int(v) for v in sys.argv[2:7]))
    else:
        sys.exit(main())
