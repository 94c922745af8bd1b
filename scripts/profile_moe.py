"""Where the CPU of the default ``moe.Buffer`` dispatch + combine goes: per rank, per pair, per function.

    python scripts/profile_moe.py                          # T=512 H=7168 K=8 E=256 on 8 PEs, 20 timed pairs
    python scripts/profile_moe.py -H 128                   # the same calls with tiny rows: the fixed costs
    python scripts/profile_moe.py -P 256 -T 64 -H 1024 -E 256 --sq-depth 1024 --heap 256M --iters 3
    python scripts/profile_moe.py --cprofile /tmp/pe0.prof # cProfile of PE 0 (on thread CPU time) as well
    python scripts/profile_moe.py --phase-cpu              # the per-call phase timers on thread CPU, not wall

One job of ``-P`` ranks runs ``--warmup`` untimed and ``--iters`` timed dispatch + combine pairs of the default
Buffer on bench_moe's routing (the previous pair's result held while the next one runs, as a training loop does),
each call entered after a barrier. Per pair it prints the CPU of every rank's process (user + system, all
threads: kernel blocks and the engine), the main thread's, and the wall time, for a few ranks and summed over the
job; on a host whose cores the ranks outnumber, the wall time follows the summed CPU, and wall - CPU / cores is the
time the job's ranks waited with a core idle or held by another job. Then the main thread's CPU on PE 0 per
function of the kernels (``FUNCTIONS``, each wrapped with a ``time.thread_time`` counter; nested functions count
inside their callers too), per timed pair. Between the two: the median rank's user and
system CPU, minor page faults and context switches per pair, and per call (dispatch, combine) the median rank's
and PE 0's call, notify, kernel and slowest-block phase times (``measure.PHASES``), on the wall clock or, with
``--phase-cpu``, on each thread's CPU clock (on a host whose cores the ranks outnumber, a phase's wall time
mostly counts waits for a core). PE 0's CLOCK_MONOTONIC at the start and end of the timed pairs is printed for
``perf record --clockid monotonic ...; perf report --time START,END``. Run it under the machine lock.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import resource
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_moe import PHASES, payload, routing  # noqa: E402

BUFFER = "shmemx.kernels.moe.buffer"
FUNCTIONS = [  # (module, class or None, name)
    (BUFFER, "Buffer", "_fresh_dispatch"), (BUFFER, "Buffer", "get_dispatch_layout"), (BUFFER, None, "notify_dispatch"),
    (BUFFER, "Buffer", "_run_dispatch"), (BUFFER, "Buffer", "_next"), (BUFFER, "Buffer", "_dispatch_args"),
    (BUFFER, "Buffer", "combine"), (BUFFER, "Buffer", "_combine_args"),
    ("shmemx.kernels.moe.notify", None, "_kernel"), ("shmemx.kernels.moe.notify", None, "_post_all"),
    ("shmemx.kernels.moe.dispatch", None, "_send_round"), ("shmemx.kernels.moe.dispatch", None, "_local"),
    ("shmemx.kernels.moe.dispatch", None, "_post_round"), ("shmemx.kernels.moe.dispatch", None, "_receive_all"),
    ("shmemx.kernels.moe.dispatch", None, "_copy_rows"), ("shmemx.kernels.moe.dispatch", None, "give_credits"),
    ("shmemx.kernels.moe.combine", None, "_send_round"), ("shmemx.kernels.moe.combine", None, "_local"),
    ("shmemx.kernels.moe.combine", None, "_post_round"), ("shmemx.kernels.moe.combine", None, "_wait_sources"),
    ("shmemx.kernels.moe.combine", None, "_reduce"), ("shmemx.kernels.moe.combine", None, "give_credits"),
    ("shmemx.kernels.moe.lanes", "Lanes", "submit_units"), ("shmemx.kernels.moe.lanes", "Lanes", "end_round"),
    ("shmemx.kernels.moe.lanes", "Lanes", "wait_completions"),
    ("shmemx", None, "aclshmem_wait_until_all"), ("shmemx", None, "aclshmemx_signal_op"),
]


def _count_functions(spent: dict) -> None:
    """Wrap every function of ``FUNCTIONS`` with a thread-CPU counter into ``spent`` (this process only)."""
    for modname, cls, name in FUNCTIONS:
        owner = importlib.import_module(modname)
        owner = getattr(owner, cls) if cls else owner
        fn = getattr(owner, name)
        key = f"{modname.rsplit('.', 1)[-1]}.{cls + '.' if cls else ''}{name}"

        def counted(*a, _fn=fn, _key=key, **kw):
            t = time.thread_time()
            try:
                return _fn(*a, **kw)
            finally:
                spent[_key] = spent.get(_key, 0.0) + time.thread_time() - t

        setattr(owner, name, functools.wraps(fn)(counted))


USAGE = ("ru_utime", "ru_stime", "ru_minflt", "ru_nvcsw", "ru_nivcsw")  # per pair, this rank's process


def _usage() -> np.ndarray:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return np.array([getattr(use, k) for k in USAGE], np.float64)


def _clock_on_thread_cpu() -> None:
    """The kernels' phase and call timers read this thread's CPU time instead of the wall clock (this job only):
    on a host whose cores the ranks outnumber, a phase's wall time counts the waits for a core."""
    import types

    from shmemx.kernels.moe import buffer, measure

    clock = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("_")})
    clock.perf_counter = time.thread_time
    measure.time = buffer.time = clock


def _call_vector(stats) -> np.ndarray:
    """One call's wall, notify, kernel and slowest-block phases (seconds)."""
    return np.concatenate([[stats.wall, stats.notify, stats.kernel], stats.phase_max_array()])


def _job(cfg: dict, out_path: str) -> None:
    import shmemx
    from shmemx.kernels import moe

    shmemx.init(sq_depth=cfg["sq_depth"]) if cfg["sq_depth"] else shmemx.init()
    me, P = shmemx.my_pe(), shmemx.n_pes()
    T, H, K, E = cfg["T"], cfg["H"], cfg["K"], cfg["E"]
    topk, weights = routing(me, T, K, E)
    x = payload(me, T, H)
    res = shmemx.zeros((P, 4), np.float64, name="profile results")
    nv = 3 + len(PHASES)
    per_call = shmemx.zeros((P, 2, nv), np.float64, name="profile calls")  # dispatch, combine: _call_vector sums
    usage = shmemx.zeros((P, len(USAGE) + 1), np.float64, name="profile usage")  # + barrier thread CPU
    if cfg["phase_cpu"]:
        _clock_on_thread_cpu()
    spent: dict = {}
    if me == 0:
        _count_functions(spent)
    buf = moe.Buffer(T, H, K, E)
    prof = None
    d, slot = None, -1
    held = 0.0  # thread CPU in the loop's barriers, timed pairs
    for it in range(cfg["warmup"] + cfg["iters"]):
        timed = it >= cfg["warmup"]
        b0 = time.thread_time()
        shmemx.aclshmem_barrier_all()
        held += (time.thread_time() - b0) * timed
        if it == cfg["warmup"]:
            spent.clear()  # the functions' counters too count the timed pairs only
            m0, w0, u0 = time.thread_time(), time.perf_counter(), _usage()
            window = [time.clock_gettime(time.CLOCK_MONOTONIC)]
            if me == 0 and cfg["cprofile"]:
                import cProfile

                prof = cProfile.Profile(time.thread_time)
                prof.enable()
        d = buf.dispatch(x, topk_idx=topk, topk_weights=weights)
        slot = buf.last_stats.extra.get("recv_slot", -1)
        per_call[me, 0] += _call_vector(buf.last_stats) * timed
        b0 = time.thread_time()
        shmemx.aclshmem_barrier_all()
        held += (time.thread_time() - b0) * timed
        buf.combine(d.recv_x, d.handle)
        per_call[me, 1] += _call_vector(buf.last_stats) * timed
    if prof is not None:
        prof.disable()
        prof.dump_stats(cfg["cprofile"])
    n = cfg["iters"]
    window.append(time.clock_gettime(time.CLOCK_MONOTONIC))
    use = _usage() - u0
    res[me] = ((use[0] + use[1]) / n, (time.thread_time() - m0) / n, (time.perf_counter() - w0) / n, float(slot))
    usage[me] = np.append(use, held) / n
    per_call[me] /= n
    d = None
    buf.close()
    shmemx.aclshmem_barrier_all()
    if me == 0:
        every = np.stack([shmemx.aclshmem_ptr(res, p)[p] for p in range(P)])
        with open(out_path, "w") as f:
            json.dump({"ranks": every.tolist(), "functions": {k: v / n for k, v in spent.items()},
                       "calls": np.stack([shmemx.aclshmem_ptr(per_call, p)[p] for p in range(P)]).tolist(),
                       "usage": np.stack([shmemx.aclshmem_ptr(usage, p)[p] for p in range(P)]).tolist(),
                       "window": window}, f)
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


def _print_usage(usage: np.ndarray) -> None:
    """Per pair, the median rank's process usage (``USAGE``) and its loop barriers' thread CPU."""
    med = np.median(usage, axis=0)
    print(f"per pair, median rank: user {med[0] * 1e3:.2f} ms, system {med[1] * 1e3:.2f} ms, minor faults "
          f"{med[2]:.0f}, voluntary / involuntary switches {med[3]:.0f} / {med[4]:.0f}; the loop's two barriers "
          f"{med[5] * 1e3:.2f} ms of thread CPU")


def _print_calls(calls: np.ndarray, clock: str) -> None:
    """Per call (dispatch, combine), the median over ranks (and PE 0) of the call's wall, notify, kernel and
    slowest-block phase times (``calls [P, 2, 3 + phases]`` ms)."""
    names = ("call", "notify", "kernel") + PHASES
    print(f"per call ({clock}, ms; median rank / PE 0):")
    for k, kind in enumerate(("dispatch", "combine")):
        med = np.median(calls[:, k], axis=0)
        print(f"  {kind:<8} " + "  ".join(f"{n} {m:.2f}/{z:.2f}" for n, m, z in zip(names, med, calls[0, k])
                                         if m > 0 or z > 0))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-P", type=int, default=8)
    ap.add_argument("-T", type=int, default=512)
    ap.add_argument("-H", type=int, default=7168)
    ap.add_argument("-K", type=int, default=8)
    ap.add_argument("-E", type=int, default=256)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--sq-depth", type=int, default=0, help="the rings' depth (0: init's default)")
    ap.add_argument("--heap", default="512M")
    ap.add_argument("--cprofile", metavar="FILE", help="also a cProfile of PE 0 (thread CPU) into FILE")
    ap.add_argument("--phase-cpu", action="store_true",
                    help="the kernels' phase and call timers on thread CPU time instead of the wall clock")
    args = ap.parse_args(argv)
    from shmemx.launcher import launch

    cfg = dict(T=args.T, H=args.H, K=args.K, E=args.E, iters=args.iters, warmup=args.warmup,
               sq_depth=args.sq_depth, cprofile=args.cprofile,
               phase_cpu=args.phase_cpu)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "profile.json")
        code = launch(args.P, _job, (cfg, path), heap_size=args.heap, timeout=3600)
        if code != 0:
            print(f"profile_moe: the {args.P}-rank job exited with {code}")
            return 1
        with open(path) as f:
            got = json.load(f)
    ranks = np.array(got["ranks"]) * 1e3  # [P, 4]: process CPU, main-thread CPU, wall (ms per pair), slot
    print(f"shmemx profile_moe: default moe.Buffer(T={args.T}, H={args.H}, K={args.K}, E={args.E}) on {args.P} PEs, "
          f"{args.iters} timed pairs; load {os.getloadavg()[0]:.1f}")
    print(f"per pair (ms): process CPU / main thread CPU / wall, per rank (first 4), the last dispatch's receive "
          f"slot (0: x, copied out)")
    for p in range(min(args.P, 4)):
        print(f"  pe {p}: {ranks[p, 0]:7.2f} / {ranks[p, 1]:7.2f} / {ranks[p, 2]:7.1f}   slot {int(ranks[p, 3] / 1e3)}")
    print(f"  every rank: CPU {ranks[:, 0].sum():.1f} ms per pair (median rank {np.median(ranks[:, 0]):.2f}), "
          f"main threads {ranks[:, 1].sum():.1f}; wall {ranks[:, 2].mean():.1f} ms")
    print(f"PE 0's timed pairs: CLOCK_MONOTONIC {got['window'][0]:.6f} .. {got['window'][1]:.6f} (perf record "
          f"--clockid monotonic; perf report --time A,B)")
    _print_usage(np.array(got["usage"]))
    _print_calls(np.array(got["calls"]) * 1e3, "thread CPU" if args.phase_cpu else "wall")
    print("PE 0's main thread CPU per function (ms per pair, calls nest):")
    for key, value in sorted(got["functions"].items(), key=lambda kv: -kv[1]):
        print(f"  {value * 1e3:8.3f}  {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
