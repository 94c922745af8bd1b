"""Benchmark of the CAM window-mode pair (``moe_dispatch_normal`` + ``moe_combine_normal``) beside its copy bound.

    python scripts/bench_cam.py                 # T=512 H=7168 K=8 E=256 P=8, bfloat16 (issue 6's shape)
    python scripts/bench_cam.py --quick         # a small smoke run (seconds)

``run_window_mode(...)`` is the entry point ``scripts/bench_moe.py`` calls to put this design in its table beside
the DeepEP-style kernels: it launches a P-rank job, runs ``warmup`` untimed pairs (they also fault in the window
pages the pair touches) and ``iters`` timed ones with new data each time, and returns a dict:

- ``dispatch_ms`` / ``combine_ms``: median over iterations of the mean over ranks; ``*_max_ms``: median of the
  slowest rank (each rank times its own call, entered after a barrier);
- ``notify_ms``: the routing exchange (CAM's separate notify_dispatch op; not part of the dispatch kernel);
- ``payload_bytes``: token bytes delivered by one dispatch (= by one combine), all ranks: rows * H * 2;
- ``copied_bytes``: bytes the kernels really copy (rows are staged in the sender's window: about twice the payload);
- ``flags_written``: dispatch flags (P * E) and combine flags (one per returned row) per pair, all ranks;
- ``copy_gbps``: aggregate copy bandwidth of two processes ``np.copyto``-ing 64 MiB buffers at once, measured in
  the same run, and ``bound_ms``: 2 * payload_bytes / copy_gbps (the copy lower bound of the pair).

``run_paired(...)`` (``--deepep``) runs this design and the DeepEP-style ``Buffer`` in one job, interleaved per
iteration on the same data, and returns the median of the per-iteration ratios: the same-run comparison of the
issue's bar. Timings are wall clock on a shared 2-core machine with P processes: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time

import ml_dtypes
import numpy as np

__all__ = ["run_window_mode", "run_paired", "copy_bandwidth_gbps", "print_rows", "print_paired"]

BF16 = ml_dtypes.bfloat16


def _copy_worker(nbytes: int, reps: int, start, out) -> None:
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    np.copyto(dst, src)  # fault in both buffers before the clock starts
    start.wait()
    t0 = time.perf_counter()
    for _ in range(reps):
        np.copyto(dst, src)
    out.put(time.perf_counter() - t0)


def copy_bandwidth_gbps(nbytes: int = 64 << 20, reps: int = 8, procs: int = 2) -> float:
    """Aggregate GB/s of ``procs`` processes each copying ``nbytes`` ``reps`` times at the same time."""
    ctx = mp.get_context("fork")
    start, out = ctx.Barrier(procs), ctx.Queue()
    workers = [ctx.Process(target=_copy_worker, args=(nbytes, reps, start, out)) for _ in range(procs)]
    for w in workers:
        w.start()
    times = [out.get(timeout=120) for _ in workers]
    for w in workers:
        w.join()
    return procs * nbytes * reps / max(times) / 1e9


def _inputs(it: int, rank: int, T: int, H: int, K: int, E: int):
    rng = np.random.default_rng([it, rank, 6])
    x = rng.standard_normal((T, H), np.float32).astype(BF16)
    x[:, 0], x[:, 1] = rank, np.arange(T) % 256  # origin in the row
    topk = np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int32)  # K distinct experts per token
    w = rng.random((T, K), np.float32)
    return x, topk, w


def _rank_body(T, H, K, E, iters, warmup, aiv_num, quant_mode, hccl_mb, out_path):
    import shmemx
    from shmemx.kernels import cam

    shmemx.init()
    me, P = shmemx.my_pe(), shmemx.n_pes()
    ctx = cam.WindowContext(hccl_buffsize=hccl_mb, aiv_num=aiv_num)
    ctx.prefault(T * P, K, H, out_size=1 if quant_mode else 2)  # no first-touch page faults in the timed calls
    times = shmemx.zeros((P, iters, 3), np.float64, name="bench_cam times")
    counts = shmemx.zeros((P, 4), np.int64, name="bench_cam counts")
    cap = T * K * P  # output buffers reused across calls, as aclnn callers pass them (no page faults per call)
    outs = dict(recv_x_out=np.zeros((cap, H), np.int8 if quant_mode else BF16),
                x_scales_out=np.zeros(cap, np.float32), assist_info_out=np.zeros(3 * cap, np.int32))
    x_out = np.zeros((T, H), BF16)
    for it in range(warmup + iters):
        x, topk, w = _inputs(it, me, T, H, K, E)
        shmemx.aclshmem_barrier_all()
        t0 = time.perf_counter()
        route = cam.notify_dispatch(ctx, topk, E)
        shmemx.aclshmem_barrier_all()
        t1 = time.perf_counter()
        d = cam.moe_dispatch_normal(ctx, x, topk, *route, moe_expert_num=E, global_bs=T * P, quant_mode=quant_mode,
                                    **outs)
        t2 = time.perf_counter()
        y = d.recv_x if quant_mode == 0 else cam.dequantize_for_combine(d.recv_x, d.x_scales)
        shmemx.aclshmem_barrier_all()
        t3 = time.perf_counter()
        c = cam.moe_combine_normal(ctx, y, d.assist_info_for_combine, d.ep_recv_counts, w, moe_expert_num=E,
                                   global_bs=T * P, x_out=x_out)
        t4 = time.perf_counter()
        if it >= warmup:
            times[me, it - warmup] = (t1 - t0, t2 - t1, t4 - t3)
        if it == warmup:
            counts[me] = (len(d.recv_x), d.flags_written + c.flags_written, d.bytes_copied + c.bytes_copied,
                          int(np.isfinite(c.x.astype(np.float32)).all()))
    for p in range(P):  # gather everything on rank 0
        if p != me:
            shmemx.aclshmemx_mte_put_nbi(times[me], times[me], times[me].size, p)
            shmemx.aclshmemx_mte_put_nbi(counts[me], counts[me], counts[me].size, p)
    shmemx.aclshmem_barrier_all()
    if me == 0:
        with open(out_path, "w") as f:
            json.dump({"times": times.tolist(), "counts": counts.tolist()}, f)
    ctx.close()


def run_window_mode(T: int = 512, H: int = 7168, K: int = 8, E: int = 256, P: int = 8, *, iters: int = 5,
                    warmup: int = 2, aiv_num: int = 2, quant_mode: int = 0, copy_gbps: float | None = None,
                    timeout: float = 900.0, verbose: bool = True) -> dict:
    """Run the window-mode pair on a P-rank job and return its figures (see the module docstring).

    Args:
        T, H, K, E, P: tokens per rank, hidden size, top-k, experts, ranks.
        iters, warmup: timed and untimed dispatch/combine pairs.
        aiv_num: AIV blocks per kernel.
        quant_mode: 0 (bf16 rows) or 2 (DynamicQuant int8 rows; combine gets the dequantised bf16).
        copy_gbps: the aggregate copy bandwidth if the caller measured it in the same run; else measured here.
        timeout: job deadline (seconds).
        verbose: print this design's rows.
    """
    from shmemx.kernels import cam
    from shmemx.launcher import launch

    hccl_mb = cam.needed_mb(T, K, H)
    heap = (hccl_mb + 8) << 20
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "cam.json")
        code = launch(P, _rank_body, (T, H, K, E, iters, warmup, aiv_num, quant_mode, hccl_mb, path),
                      heap_size=heap, timeout=timeout)
        if code != 0:
            raise RuntimeError(f"bench_cam: the {P}-rank job exited with {code}")
        with open(path) as f:
            raw = json.load(f)
    times = np.array(raw["times"])  # [P, iters, 3]: notify, dispatch, combine
    counts = np.array(raw["counts"])
    if copy_gbps is None:
        copy_gbps = copy_bandwidth_gbps()
    rows = int(counts[:, 0].sum())
    payload = rows * H * 2
    res = {
        "design": f"CAM window mode ({'int8' if quant_mode else 'bf16'}, aiv {aiv_num})",
        "T": T, "H": H, "K": K, "E": E, "P": P, "iters": iters,
        "notify_ms": float(np.median(times[:, :, 0].mean(axis=0))) * 1e3,
        "dispatch_ms": float(np.median(times[:, :, 1].mean(axis=0))) * 1e3,
        "dispatch_max_ms": float(np.median(times[:, :, 1].max(axis=0))) * 1e3,
        "combine_ms": float(np.median(times[:, :, 2].mean(axis=0))) * 1e3,
        "combine_max_ms": float(np.median(times[:, :, 2].max(axis=0))) * 1e3,
        "payload_bytes": payload, "copied_bytes": int(counts[:, 2].sum()),
        "flags_written": int(counts[:, 1].sum()), "copy_gbps": copy_gbps,
        "bound_ms": 2 * payload / (copy_gbps * 1e9) * 1e3,
        "finite": bool(counts[:, 3].all()),
    }
    res["pair_ms"] = res["dispatch_ms"] + res["combine_ms"]
    res["pair_max_ms"] = res["dispatch_max_ms"] + res["combine_max_ms"]
    if verbose:
        print_rows([res])
    return res


def _paired_body(T, H, K, E, iters, warmup, aiv_num, channels, zero_copy, policies, hccl_mb, out_path):
    """Both designs in one job: every iteration runs the CAM pair and each DeepEP-style configuration on the same
    data, in an order that rotates, so that machine noise hits them alike."""
    import shmemx
    from shmemx.kernels import cam, moe

    shmemx.aclshmemx_set_qp_num(shmemx.ACLSHMEM_DATA_OP_UDMA, max(moe.POLICY_QPS[p] for p in policies))
    shmemx.init()
    me, P = shmemx.my_pe(), shmemx.n_pes()
    ctx = cam.WindowContext(hccl_buffsize=hccl_mb, aiv_num=aiv_num)
    ctx.prefault(T * P, K, H)  # no first-touch page faults in the timed calls
    buf = moe.Buffer(T, H, K, E, num_channels=channels, qp_num=max(moe.POLICY_QPS[p] for p in policies),
                     qp_policy=policies[0], zero_copy=zero_copy)
    n = 1 + len(policies)
    times = shmemx.zeros((P, iters, n, 3), np.float64, name="bench_paired times")
    cap = T * K * P
    outs = dict(recv_x_out=np.zeros((cap, H), BF16), assist_info_out=np.zeros(3 * cap, np.int32))
    x_out = np.zeros((T, H), BF16)

    def timed(fn):
        shmemx.aclshmem_barrier_all()
        t0 = time.perf_counter()
        result = fn()
        return result, time.perf_counter() - t0

    def cam_pair(x, topk, w):
        route, t_notify = timed(lambda: cam.notify_dispatch(ctx, topk, E))
        d, t_dispatch = timed(lambda: cam.moe_dispatch_normal(ctx, x, topk, *route, moe_expert_num=E,
                                                              global_bs=T * P, **outs))
        _, t_combine = timed(lambda: cam.moe_combine_normal(ctx, d.recv_x, d.assist_info_for_combine,
                                                            d.ep_recv_counts, w, moe_expert_num=E,
                                                            global_bs=T * P, x_out=x_out))
        return t_notify + t_dispatch, t_dispatch, t_combine

    def deepep_pair(policy, x, topk, w):
        buf.set_schedule(qp_policy=policy)
        d, t_fresh = timed(lambda: buf.dispatch(x, topk_idx=topk.astype(np.int64), topk_weights=w))
        _, t_cached = timed(lambda: buf.dispatch(x, handle=d.handle))
        _, t_combine = timed(lambda: buf.combine(d.recv_x, d.handle))
        return t_fresh, t_cached, t_combine

    for it in range(warmup + iters):
        x, topk, w = _inputs(it, me, T, H, K, E)
        runs = [lambda: cam_pair(x, topk, w)] + [lambda p=p: deepep_pair(p, x, topk, w) for p in policies]
        order = [(i + it) % n for i in range(n)]
        for i in order:
            result = runs[i]()
            if it >= warmup:
                times[me, it - warmup, i] = result
    for p in range(P):
        if p != me:
            shmemx.aclshmemx_mte_put_nbi(times[me], times[me], times[me].size, p)
    shmemx.aclshmem_barrier_all()
    if me == 0:
        with open(out_path, "w") as f:
            json.dump({"times": times.tolist()}, f)
    buf.close()
    ctx.close()


def run_paired(T: int = 512, H: int = 7168, K: int = 8, E: int = 256, P: int = 8, *, iters: int = 5,
               warmup: int = 2, aiv_num: int = 2, channels: int = 1, zero_copy: bool = True,
               policies=("one", "bytes"), timeout: float = 1800.0) -> dict:
    """The window-mode pair and the DeepEP-style ``Buffer`` (``shmemx.kernels.moe``) in ONE job, on the same data,
    interleaved per iteration: the same-run comparison the issue's bar asks for, robust to a noisy machine.

    Returns ``{"cam": {...}, "deepep": {policy: {...}}, "ratio_fresh": ..., "ratio_cached": ...}`` with, per design,
    ``dispatch_ms`` (CAM: notify + kernel; DeepEP: fresh dispatch, whose notify runs inside), ``cached_ms`` (CAM:
    the kernel alone; DeepEP: dispatch with a handle), ``combine_ms``: means over ranks, medians over iterations.
    The ratios are medians over iterations of CAM's pair / the best DeepEP pair of that iteration. The default
    DeepEP-style configuration is the fastest one ``scripts/bench_moe.py`` measures (aggregate, 1 channel, zero
    copy; policies ``one`` and ``bytes``): the issue's bar compares against the best configuration.
    """
    from shmemx.kernels import cam
    from shmemx.launcher import launch

    hccl_mb = cam.needed_mb(T, K, H)
    heap = (hccl_mb + 16 + T * P * H * 2 * 3 // 2 ** 20 + 64) << 20
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "paired.json")
        code = launch(P, _paired_body, (T, H, K, E, iters, warmup, aiv_num, channels, zero_copy, list(policies),
                                        hccl_mb, path), heap_size=heap, timeout=timeout)
        if code != 0:
            raise RuntimeError(f"bench_cam: the paired {P}-rank job exited with {code}")
        with open(path) as f:
            times = np.array(json.load(f)["times"])  # [P, iters, 1 + policies, 3]
    mean = times.mean(axis=0)  # [iters, designs, 3]: mean over ranks

    def figures(i: int) -> dict:
        return {name: float(np.median(mean[:, i, j])) * 1e3
                for j, name in enumerate(("dispatch_ms", "cached_ms", "combine_ms"))}

    fresh = mean[:, :, 0] + mean[:, :, 2]
    cached = mean[:, :, 1] + mean[:, :, 2]
    return {"cam": figures(0), "deepep": {p: figures(1 + i) for i, p in enumerate(policies)},
            "ratio_fresh": float(np.median(fresh[:, 0] / fresh[:, 1:].min(axis=1))),
            "ratio_cached": float(np.median(cached[:, 0] / cached[:, 1:].min(axis=1))),
            "aiv_num": aiv_num, "iters": iters, "channels": channels, "zero_copy": zero_copy}


def print_paired(res: dict) -> None:
    """The same-run comparison table of ``run_paired``."""
    print(f"\n{'design (one job, interleaved)':<36} {'dispatch':>9} {'cached':>9} {'combine':>9} {'fresh pair':>11} "
          f"{'cached pair':>12}")
    rows = [(f"CAM window mode (aiv {res['aiv_num']})", res["cam"])]
    how = f"{res['channels']} ch{', zero copy' if res['zero_copy'] else ''}"
    rows += [(f"DeepEP-style ({p}, {how})", r) for p, r in res["deepep"].items()]
    for name, r in rows:
        print(f"{name:<36} {r['dispatch_ms']:9.1f} {r['cached_ms']:9.1f} {r['combine_ms']:9.1f} "
              f"{r['dispatch_ms'] + r['combine_ms']:11.1f} {r['cached_ms'] + r['combine_ms']:12.1f}")
    print(f"CAM / best DeepEP-style, median of per-iteration ratios: fresh pair (CAM notify + dispatch + combine vs "
          f"DeepEP fresh dispatch + combine) {res['ratio_fresh']:.2f}x; cached pair (CAM dispatch + combine vs "
          f"DeepEP cached dispatch + combine) {res['ratio_cached']:.2f}x (issue 6 bar: <= 1.5x)")


def print_rows(results: list[dict]) -> None:
    """Print one table row per result of ``run_window_mode``."""
    head = (f"{'design':<28} {'notify':>8} {'dispatch':>15} {'combine':>15} {'pair':>15} {'payload':>9} "
            f"{'copied':>9} {'flags':>7} {'bound':>8} {'pair/bound':>10}")
    print(head)
    print(f"{'':<28} {'ms':>8} {'avg/max ms':>15} {'avg/max ms':>15} {'avg/max ms':>15} {'MB':>9} {'MB':>9} "
          f"{'':>7} {'ms':>8}")
    for r in results:
        print(f"{r['design']:<28} {r['notify_ms']:8.1f} {r['dispatch_ms']:7.1f}/{r['dispatch_max_ms']:<7.1f} "
              f"{r['combine_ms']:7.1f}/{r['combine_max_ms']:<7.1f} {r['pair_ms']:7.1f}/{r['pair_max_ms']:<7.1f} "
              f"{r['payload_bytes'] / 1e6:9.1f} {r['copied_bytes'] / 1e6:9.1f} {r['flags_written']:7d} "
              f"{r['bound_ms']:8.1f} {r['pair_ms'] / r['bound_ms']:9.2f}x")
    print(f"(bound: 2 x payload / aggregate copy bandwidth {results[0]['copy_gbps']:.1f} GB/s of two processes "
          f"copying at once, measured in this run)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small shape, one timed pair (a smoke run)")
    ap.add_argument("-T", type=int, default=512)
    ap.add_argument("-H", type=int, default=7168)
    ap.add_argument("-K", type=int, default=8)
    ap.add_argument("-E", type=int, default=256)
    ap.add_argument("-P", type=int, default=8)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--aiv", type=int, nargs="+", default=[1])
    ap.add_argument("--quant", action="store_true", help="also run DynamicQuant (int8 rows)")
    ap.add_argument("--deepep", nargs="*", default=None, metavar="POLICY",
                    help="also run the DeepEP-style Buffer (shmemx.kernels.moe) with these QP policies (default: "
                         "one bytes) interleaved with the window mode in one job, and print the ratio")
    ap.add_argument("--channels", type=int, default=1, help="DeepEP-style channels in the paired run (default 1)")
    ap.add_argument("--no-zero-copy", action="store_true", help="DeepEP-style recv_x copied out in the paired run")
    args = ap.parse_args(argv)
    if args.quick:
        args.T, args.H, args.K, args.E, args.P, args.iters = 16, 1024, 4, 16, 4, 1
    gbps = copy_bandwidth_gbps()
    results = []
    for aiv in args.aiv:
        for quant in ([0, 2] if args.quant else [0]):
            results.append(run_window_mode(args.T, args.H, args.K, args.E, args.P, iters=args.iters,
                                           warmup=1 if args.quick else 2, aiv_num=aiv, quant_mode=quant,
                                           copy_gbps=gbps, verbose=False))
    print(f"T={args.T} H={args.H} K={args.K} E={args.E} P={args.P}, {args.iters} timed pairs")
    print_rows(results)
    ok = all(r["finite"] for r in results)
    if args.deepep is not None:
        try:
            res = run_paired(args.T, args.H, args.K, args.E, args.P, iters=args.iters, warmup=1 if args.quick else 2,
                             aiv_num=args.aiv[0], channels=args.channels, zero_copy=not args.no_zero_copy,
                             policies=args.deepep or ["one", "bytes"])
            print_paired(res)
        except RuntimeError as exc:  # the other design failed: say so
            print(f"the paired run did not complete: {exc}")
            ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
