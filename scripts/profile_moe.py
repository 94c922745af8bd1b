"""Where the CPU of the default ``moe.Buffer`` dispatch + combine goes: per rank, per pair, per function.

    python scripts/profile_moe.py                          # T=512 H=7168 K=8 E=256 on 8 PEs, 20 timed pairs
    python scripts/profile_moe.py -H 128                   # the same calls with tiny rows: the fixed costs
    python scripts/profile_moe.py -P 256 -T 64 -H 1024 -E 256 --sq-depth 1024 --heap 256M --iters 3
    python scripts/profile_moe.py --cprofile /tmp/pe0.prof # cProfile of PE 0 (on thread CPU time) as well

One job of ``-P`` ranks runs ``--warmup`` untimed and ``--iters`` timed dispatch + combine pairs of the default
Buffer on bench_moe's routing (the previous pair's result held while the next one runs, as a training loop does),
each call entered after a barrier. Per pair it prints the CPU of every rank's process (user + system, all
threads: kernel blocks and the engine), the main thread's, and the wall time, for a few ranks and summed over the
job; on a host whose cores the ranks outnumber, the wall time follows the summed CPU, and wall - CPU / cores is the
time the job's ranks waited with a core idle or held by another job. Then the main thread's CPU on PE 0 per
function of the kernels (``FUNCTIONS``, each wrapped with a ``time.thread_time`` counter; nested functions count
inside their callers too), per pair over every call, warm-up included. Run it under the machine lock.
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

from bench_moe import payload, routing  # noqa: E402

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


def _cpu() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def _job(cfg: dict, out_path: str) -> None:
    import shmemx
    from shmemx.kernels import moe

    shmemx.init(sq_depth=cfg["sq_depth"]) if cfg["sq_depth"] else shmemx.init()
    me, P = shmemx.my_pe(), shmemx.n_pes()
    T, H, K, E = cfg["T"], cfg["H"], cfg["K"], cfg["E"]
    topk, weights = routing(me, T, K, E)
    x = payload(me, T, H)
    res = shmemx.zeros((P, 4), np.float64, name="profile results")
    spent: dict = {}
    if me == 0:
        _count_functions(spent)
    buf = moe.Buffer(T, H, K, E)
    prof = None
    d, slot = None, -1
    for it in range(cfg["warmup"] + cfg["iters"]):
        shmemx.aclshmem_barrier_all()
        if it == cfg["warmup"]:
            c0, m0, w0 = _cpu(), time.thread_time(), time.perf_counter()
            if me == 0 and cfg["cprofile"]:
                import cProfile

                prof = cProfile.Profile(time.thread_time)
                prof.enable()
        d = buf.dispatch(x, topk_idx=topk, topk_weights=weights)
        slot = buf.last_stats.extra.get("recv_slot", -1)
        shmemx.aclshmem_barrier_all()
        buf.combine(d.recv_x, d.handle)
    if prof is not None:
        prof.disable()
        prof.dump_stats(cfg["cprofile"])
    n = cfg["iters"]
    res[me] = ((_cpu() - c0) / n, (time.thread_time() - m0) / n, (time.perf_counter() - w0) / n,
               float(slot))
    d = None
    buf.close()
    shmemx.aclshmem_barrier_all()
    if me == 0:
        every = np.stack([shmemx.aclshmem_ptr(res, p)[p] for p in range(P)])
        calls = cfg["warmup"] + n
        with open(out_path, "w") as f:
            json.dump({"ranks": every.tolist(), "functions": {k: v / calls for k, v in spent.items()}}, f)
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


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
    args = ap.parse_args(argv)
    from shmemx.launcher import launch

    cfg = dict(T=args.T, H=args.H, K=args.K, E=args.E, iters=args.iters, warmup=args.warmup,
               sq_depth=args.sq_depth, cprofile=args.cprofile)
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
    print("PE 0's main thread CPU per function (ms per pair, calls nest):")
    for key, value in sorted(got["functions"].items(), key=lambda kv: -kv[1]):
        print(f"  {value * 1e3:8.3f}  {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
