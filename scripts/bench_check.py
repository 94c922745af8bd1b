"""What ``--check`` and ``--chaos`` cost: the small-put loop and the 8-PE MoE demo, each beside its plain run.

    flock /tmp/shmemx-heavy.lock python scripts/bench_check.py            # 3 interleaved rounds
    python scripts/bench_check.py --quick                                  # a smoke run (a test uses it)

Two workloads, each run plain, with ``--check`` and with ``--chaos SEED`` in interleaved rounds (noise on this
shared 2-core machine drifts over seconds); the table shows each variant's best round and median, and the ratio
of the medians to the plain run of the same workload:

* put loop: ``scripts/bench_trace.py``'s loop (PE 0 posts 64-B ``aclshmemx_udma_qp_put_nbi`` to PE 1, one
  ``qp_quiet`` per 1024; PE 1 reads the slots after a barrier), 2 PEs. "loop s" is the sender's loop (first post to last quiet), "job s" the whole
  launch, which under ``--check`` includes the launcher's analysis of the logs;
* MoE demo: ``shmemx run -n 8 scripts/examples/moe_demo.py`` (DeepEP-style dispatch + combine, checked against
  the reference) as a command, its wall time from start to exit (the analysis included).

The bars (issue 10): ``--check`` at most 5x and ``--chaos`` at most 3x on the MoE demo's median.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

VARIANTS = ("plain", "check", "chaos")
SEED = 7
QUIET_EVERY = 1024
PAYLOAD = 64


def _put_loop(wqes: int) -> None:
    """The rank body: bench_trace's 64-B qp_put_nbi loop (without its engine-paused part), timed on PE 0."""
    import numpy as np

    import shmemx

    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    dst = shmemx.zeros((QUIET_EVERY, PAYLOAD), np.uint8, name="dst")
    src = np.full((QUIET_EVERY, PAYLOAD), me, np.uint8)
    put, quiet = shmemx.aclshmemx_udma_qp_put_nbi, shmemx.aclshmemx_udma_qp_quiet
    shmemx.aclshmem_barrier_all()
    if me == 0:
        start = time.perf_counter()
        for i in range(wqes):
            j = i & (QUIET_EVERY - 1)
            put(dst[j], src[j], PAYLOAD, 1, 0)
            if j == QUIET_EVERY - 1:
                quiet(1, 0)
        quiet(1, 0)
        print(json.dumps({"loop_s": time.perf_counter() - start}))
    shmemx.aclshmem_barrier_all()
    if me == 1:
        assert (dst == 0).all()


def _put_job(variant: str, wqes: int) -> dict:
    from shmemx.launcher import launch

    out, err = io.StringIO(), io.StringIO()
    kwargs = {"check": variant == "check", "chaos": SEED if variant == "chaos" else None}
    started = time.perf_counter()
    code = launch(2, _put_loop, (wqes,), timeout=900, tag_output=False, stdout=out, stderr=err, **kwargs)
    job_s = time.perf_counter() - started
    if code != 0:
        sys.exit(f"put loop, {variant}: exit {code}\n{out.getvalue()}\n{err.getvalue()}")
    if variant == "check" and "no findings" not in err.getvalue():
        sys.exit(f"put loop under --check has findings:\n{err.getvalue()}")
    row = next(json.loads(line) for line in out.getvalue().splitlines() if line.startswith("{"))
    return {"loop_s": row["loop_s"], "job_s": job_s}


def _moe_job(variant: str, args: list[str]) -> dict:
    cmd = [sys.executable, "-m", "shmemx", "run", "-n", "8"]
    if variant == "check":
        cmd.append("--check")
    elif variant == "chaos":
        cmd += ["--chaos", str(SEED)]
    cmd += [os.path.join(HERE, "examples", "moe_demo.py"), *args]
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    job_s = time.perf_counter() - started
    if proc.returncode != 0 or proc.stdout.count("PASS") != 8:
        sys.exit(f"moe demo, {variant}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    if variant == "check" and "no findings" not in proc.stderr:
        sys.exit(f"moe demo under --check has findings:\n{proc.stderr[-4000:]}")
    return {"job_s": job_s}


def _table(title: str, results: dict, keys: list[str]) -> list[str]:
    lines = [title, f"{'variant':<8}" + "".join(f"{k + ' best [median]':>24}{'ratio':>8}" for k in keys)]
    for v in VARIANTS:
        row = f"{v:<8}"
        for k in keys:
            values = [r[k] for r in results[v]]
            base = statistics.median(r[k] for r in results["plain"])
            med = statistics.median(values)
            row += f"{min(values):>12.3f} [{med:>8.3f}]{med / base:>8.2f}x"
        lines.append(row)
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--wqes", type=int, default=100_000, help="WQEs of the put loop (default 100,000)")
    ap.add_argument("--quick", action="store_true", help="one round, 5,000 WQEs, a small MoE shape")
    ap.add_argument("--bars", action="store_true", help="exit 1 when the MoE demo misses a bar")
    args = ap.parse_args(argv)
    rounds, wqes = (1, 5000) if args.quick else (args.rounds, args.wqes)
    moe_args = ["--tokens", "32", "--hidden", "256"] if args.quick else []
    put = {v: [] for v in VARIANTS}
    moe = {v: [] for v in VARIANTS}
    for _ in range(rounds):
        for v in VARIANTS:
            put[v].append(_put_job(v, wqes))
            moe[v].append(_moe_job(v, moe_args))
    lines = _table(f"64-B qp_put_nbi loop, 2 PEs, {wqes:,} WQEs, {rounds} interleaved round(s): seconds",
                   put, ["loop_s", "job_s"])
    lines += [""] + _table(f"moe_demo.py on 8 PEs{' ' + ' '.join(moe_args) if moe_args else ''}, {rounds} "
                           f"round(s): seconds of the whole command", moe, ["job_s"])
    print("\n".join(lines))
    med = {v: statistics.median(r["job_s"] for r in moe[v]) for v in VARIANTS}
    ok = med["check"] <= 5 * med["plain"] and med["chaos"] <= 3 * med["plain"]
    print(f"\nbars (MoE demo medians): --check {med['check'] / med['plain']:.2f}x (<= 5x), --chaos "
          f"{med['chaos'] / med['plain']:.2f}x (<= 3x): {'met' if ok else 'MISSED'}")
    return 0 if ok or not args.bars else 1


if __name__ == "__main__":
    sys.exit(main())
