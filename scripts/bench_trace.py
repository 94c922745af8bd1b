"""What tracing and the counters cost: the 64-byte put loop untraced, traced, and (optionally) before the hooks.

    python scripts/bench_trace.py                 # 2 PEs x 200,000 WQEs, 3 interleaved rounds
    python scripts/bench_trace.py --quick         # a smoke run (tests use it)
    python scripts/bench_trace.py --baseline REV  # also the same loop on commit REV (a git worktree), e.g. the
                                                  # commit before the inspection hooks: --baseline f677b9b^

PE 0 runs the small-put benchmark of the data plane (``scripts/bench_rma.py``'s 64-byte message rate):
``aclshmemx_udma_qp_put_nbi`` of 64 bytes to PE 1, one ``aclshmemx_udma_qp_quiet`` per 1024 WQEs, timed until
the last quiet returned (every WQE executed and completed); with ``--all`` every PE sends to the next one. Variants run in interleaved rounds (noise on this shared
2-core machine drifts over seconds) and the table shows the best round of each (the median in brackets):

* untraced: the current code, tracing off (the counters are always on);
* traced: the same with ``launch(trace=...)`` (= ``shmemx run --trace``), the loop time and the whole job's
  time (which includes writing and merging the trace file at finalize);
* baseline: the same untraced loop on commit REV, i.e. before the hooks ("cost when off").

The ratios are against the untraced variant of the same run. Loop time is the slowest sender's, from its first
post to its last quiet; WQE/s is per sending PE; CPU is the sender process's CPU time (posting thread and DMA
engine) per WQE over the loop, which other processes on a loaded host disturb less than wall time. "post us"
is the posting path alone: the posting thread's CPU per ``qp_put_nbi`` while its engine is paused (best of 3 x
30,000; "-" for a commit without the pause hook), the most direct measure of what the hooks cost when off.
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

QUIET_EVERY = 1024
PAYLOAD = 64
POST_ONLY = 30_000  # WQEs posted with the engine paused (they fit the default 32768-deep SQ)


def _put_loop(wqes: int, all_send: bool) -> None:
    """The rank body: the 64-B qp_put_nbi loop, timed; prints one JSON line per sending PE."""
    import numpy as np

    import shmemx

    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    slots = QUIET_EVERY
    dst = shmemx.zeros((slots, PAYLOAD), np.uint8, name="dst")
    src = np.full((slots, PAYLOAD), me, np.uint8)
    peer = (me + 1) % n
    put, quiet = shmemx.aclshmemx_udma_qp_put_nbi, shmemx.aclshmemx_udma_qp_quiet
    sender = me == 0 or all_send
    shmemx.aclshmem_barrier_all()
    post_us = _post_only(put, quiet, dst, src, peer) if sender else None
    if sender:
        start, cpu = time.perf_counter(), time.process_time()
        for i in range(wqes):
            j = i & (slots - 1)
            put(dst[j], src[j], PAYLOAD, peer, 0)
            if j == slots - 1:
                quiet(peer, 0)
        quiet(peer, 0)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    shmemx.aclshmem_barrier_all()
    if me == 1 % n or all_send:
        assert (dst == (me - 1) % n).all(), "payload from the previous PE did not arrive"
    if sender:
        print(json.dumps({"pe": me, "loop_s": seconds, "cpu_us": cpu / wqes * 1e6, "post_us": post_us}))


def _post_only(put, quiet, dst, src, peer: int) -> float | None:
    """The posting thread's CPU per put with the engine paused (nothing competes for the GIL): the cost of the
    posting path alone, best of 3; None when this version of shmemx has no engine pause hook."""
    from shmemx.runtime import runtime

    engine = runtime().udma.engine
    if not hasattr(engine, "pause"):
        return None
    best = None
    for _ in range(3):
        engine.pause()
        start = time.thread_time()
        for i in range(POST_ONLY):
            j = i & (QUIET_EVERY - 1)
            put(dst[j], src[j], PAYLOAD, peer, 0)
        us = (time.thread_time() - start) / POST_ONLY * 1e6
        engine.resume()
        quiet(peer, 0)
        best = us if best is None else min(best, us)
    tracer = getattr(runtime(), "tracer", None)
    if tracer is not None:  # the trace file (and the job's time to write it) covers the timed loop only
        for records in (*tracer.queues.values(), tracer.engine):
            del records[:]
        tracer.spans.clear()
    return best


def _child(args) -> None:
    """One job of one variant; prints {"loop_s": slowest PE, "rate": mean WQE/s per PE, "job_s": ...}."""
    if args.worktree:
        _use_worktree(args.worktree)
    from shmemx.launcher import launch

    out, err = io.StringIO(), io.StringIO()
    kwargs = {}
    trace_path = None
    if args.traced:
        fd, trace_path = tempfile.mkstemp(suffix=".trace.json")
        os.close(fd)
        kwargs["trace"] = trace_path
    started = time.perf_counter()
    code = launch(args.n, _put_loop, (args.wqes, args.all), timeout=600, tag_output=False, stdout=out, stderr=err, **kwargs)
    job_s = time.perf_counter() - started
    if code != 0:
        sys.exit(f"variant failed (exit {code}):\n{out.getvalue()}\n{err.getvalue()}")
    rows = [json.loads(line) for line in out.getvalue().splitlines() if line.startswith("{")]
    loops = [r["loop_s"] for r in rows]
    trace_mb = 0.0
    if trace_path:
        trace_mb = os.path.getsize(trace_path) / 1e6
        os.unlink(trace_path)
    print(json.dumps({"loop_s": max(loops), "rate": statistics.mean(args.wqes / s for s in loops), "job_s": job_s,
                      "cpu_us": statistics.mean(r["cpu_us"] for r in rows), "trace_mb": trace_mb,
                      "post_us": rows[0]["post_us"]}))


def _use_worktree(path: str) -> None:
    """Import shmemx (and shmemx.launcher, which lives in launcher/) from a checkout of another commit."""
    import importlib.util

    sys.path.insert(0, path)
    spec = importlib.util.spec_from_file_location("shmemx.launcher", os.path.join(path, "launcher", "__init__.py"),
                                                  submodule_search_locations=[os.path.join(path, "launcher")])
    import shmemx

    assert shmemx.__file__.startswith(path), shmemx.__file__
    module = importlib.util.module_from_spec(spec)
    sys.modules["shmemx.launcher"] = module
    spec.loader.exec_module(module)


def _run_variant(name: str, args, worktree: str | None = None, traced: bool = False) -> dict:
    cmd = [sys.executable, __file__, "--child", "-n", str(args.n), "--wqes", str(args.wqes)]
    if args.all:
        cmd.append("--all")
    if traced:
        cmd.append("--traced")
    if worktree:
        cmd += ["--worktree", worktree]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=worktree or os.getcwd())
    if proc.returncode != 0:
        sys.exit(f"{name}: {proc.stderr or proc.stdout}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _worktree(rev: str) -> tuple[str, str]:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = tempfile.mkdtemp(prefix="shmemx_bench_base_")
    os.rmdir(path)
    subprocess.run(["git", "-C", repo, "worktree", "add", "--detach", path, rev], check=True, capture_output=True)
    return repo, path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=2, help="PEs (default 2)")
    parser.add_argument("--wqes", type=int, default=200_000, help="WQEs per PE (default 200,000)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--baseline", metavar="REV", action="append", default=[],
                        help="also run the untraced loop on git commit REV (repeatable)")
    parser.add_argument("--all", action="store_true", help="every PE sends (default: PE 0 only, as bench_rma.py)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 20,000 WQEs, 1 round")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--traced", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worktree", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    if args.quick:
        args.wqes, args.rounds = 20_000, 1
    variants = [("untraced", None, False), ("traced (--trace)", None, True)]
    worktrees = []
    try:
        for rev in args.baseline:
            repo, base = _worktree(rev)
            worktrees.append((repo, base))
            variants.append((f"untraced at {rev}", base, False))
        results: dict[str, list[dict]] = {name: [] for name, _, _ in variants}
        for _ in range(args.rounds):
            for name, worktree, traced in variants:
                results[name].append(_run_variant(name, args, worktree, traced))
    finally:
        for repo, base in worktrees:
            subprocess.run(["git", "-C", repo, "worktree", "remove", "--force", base], capture_output=True)
    _table(args, results)


def _table(args, results: dict[str, list[dict]]) -> None:
    ref = min(r["loop_s"] for r in results["untraced"])
    ref_job = min(r["job_s"] for r in results["untraced"])
    who = f"every PE of {args.n} sends" if args.all else f"PE 0 sends to PE 1 ({args.n} PEs)"
    print(f"64-B aclshmemx_udma_qp_put_nbi loop, one qp_quiet per {QUIET_EVERY}: {who}, {args.wqes:,} WQEs per "
          f"sender, {args.rounds} interleaved round(s); best round [median]")
    ref_cpu = min(r["cpu_us"] for r in results["untraced"])
    head = (f"{'variant':<30} {'loop s':>16} {'WQE/s per PE':>20} {'loop ratio':>10} {'CPU us/WQE':>15} "
            f"{'CPU ratio':>9} {'job s':>15} {'job ratio':>9} {'trace MB':>8} {'post us':>15}")
    print(head)
    print("-" * len(head))
    for name, rows in results.items():
        loop = [r["loop_s"] for r in rows]
        rate = [r["rate"] for r in rows]
        job = [r["job_s"] for r in rows]
        cpu = [r["cpu_us"] for r in rows]
        print(f"{name:<30} {min(loop):7.3f} [{statistics.median(loop):6.3f}] "
              f"{max(rate):9,.0f} [{statistics.median(rate):8,.0f}] {min(loop) / ref:10.2f} "
              f"{min(cpu):6.2f} [{statistics.median(cpu):6.2f}] {min(cpu) / ref_cpu:9.2f} "
              f"{min(job):6.2f} [{statistics.median(job):6.2f}] {min(job) / ref_job:9.2f} "
              f"{max(r['trace_mb'] for r in rows):8.1f} {_post_column(rows, results['untraced'])}")


def _post_column(rows: list[dict], ref_rows: list[dict]) -> str:
    posts = [r["post_us"] for r in rows if r["post_us"] is not None]
    refs = [r["post_us"] for r in ref_rows if r["post_us"] is not None]
    if not posts or not refs:
        return f"{'-':>15}"
    return f"{min(posts):5.2f} ({min(posts) / min(refs):4.2f}x)"


if __name__ == "__main__":
    main()
