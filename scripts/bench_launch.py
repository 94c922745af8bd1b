"""Benchmark of ``shmemx.launch``: what starting a kernel's blocks costs, beside fresh threads in the same run.

    python scripts/bench_launch.py              # 4 blocks, 1 PE and 8 PEs (PEs outnumbering this machine's cores)
    python scripts/bench_launch.py --blocks 2 4 8 -P 1

Each PE launches, ``--iters`` times, (a) an empty kernel and (b) a kernel whose every block runs ~``--work-us``
of pure Python (it holds the interpreter lock, as the MoE kernels' block code does), timing each launch; and the
same bodies on fresh threads (``threading.Thread`` start + join per block: what a launch cost before its blocks
ran on parked threads) alternating with them. Printed per configuration: the median launch time and, for (b),
the median delay from entering the launch to the start of the last block, for both, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time

import numpy as np


def _spin(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def _job(cfg: dict, out: str) -> None:
    import shmemx

    shmemx.init()
    me = shmemx.my_pe()
    res = {}
    for n in cfg["blocks"]:
        starts = np.zeros(n)

        def kernel(work: float) -> None:
            starts[shmemx.get_block_idx()] = time.perf_counter()
            if work:
                _spin(work)

        def fresh(work: float) -> None:
            def body(b: int) -> None:
                starts[b] = time.perf_counter()
                if work:
                    _spin(work)

            threads = [threading.Thread(target=body, args=(b,), daemon=True) for b in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        for work in (0.0, cfg["work_us"]):
            rows = {"launch": [], "fresh": []}
            for it in range(cfg["warmup"] + cfg["iters"]):
                for name in ("launch", "fresh"):
                    shmemx.aclshmem_barrier_all()
                    t0 = time.perf_counter()
                    if name == "launch":
                        shmemx.launch(kernel, n, work)
                    else:
                        fresh(work)
                    t1 = time.perf_counter()
                    if it >= cfg["warmup"]:
                        rows[name].append((t1 - t0, starts.max() - t0))
            res[f"{n} {work}"] = rows
    with open(f"{out}.{me}.json", "w") as f:
        json.dump(res, f)
    shmemx.finalize()


def main() -> None:
    from shmemx.launcher import launch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=[4])
    ap.add_argument("-P", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--work-us", type=float, default=1000.0)
    args = ap.parse_args()
    cfg = dict(blocks=args.blocks, iters=args.iters, warmup=args.warmup, work_us=args.work_us)
    print(f"shmemx bench_launch: {args.iters} launches per row (median), blocks on the pool's parked threads "
          f"('launch') against fresh threads started and joined per launch, alternating, in one job")
    print(f"{'PEs':>3} {'blocks':>6} {'block body':>16} {'launch us':>10} {'fresh us':>9} {'ratio':>6}   "
          f"{'last block starts after (us): launch':>36} {'fresh':>7} {'ratio':>6}")
    for P in args.P:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "launch")
            if launch(P, _job, (cfg, out), timeout=600) != 0:
                raise SystemExit(f"bench_launch: the {P}-PE job failed")
            per_pe = [json.load(open(f"{out}.{p}.json")) for p in range(P)]
        for key in per_pe[0]:
            n, work = key.split()
            med = {name: np.median([r[name] for pe in per_pe for r in [pe[key]]], axis=(0, 1)) * 1e6
                   for name in ("launch", "fresh")}
            body = "empty" if float(work) == 0 else f"{float(work):.0f} us of Python"
            print(f"{P:>3} {n:>6} {body:>16} {med['launch'][0]:10.1f} {med['fresh'][0]:9.1f} "
                  f"{med['launch'][0] / med['fresh'][0]:5.2f}x   {med['launch'][1]:36.1f} {med['fresh'][1]:7.1f} "
                  f"{med['launch'][1] / max(med['fresh'][1], 1e-9):5.2f}x")


if __name__ == "__main__":
    main()
