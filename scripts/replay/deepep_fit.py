"""DeepEP's published tables against the replay: fit two parameters on two points, report every other point.

    flock /tmp/shmemx-heavy.lock python scripts/replay/deepep_fit.py --mode normal [--tokens 256] [--dir DIR]
    flock /tmp/shmemx-heavy.lock python scripts/replay/deepep_fit.py --mode ll --eps 8,16,32,64 [--dir DIR]

DeepEP's README (its Performance section), H800 + CX7 (the ``h800_cx7`` topology, 8 per node):

* **normal** kernels, 4096 tokens, H = 7168, top-4 nodes, top-8 of 256 experts, FP8 dispatch / BF16 combine;
  "bottleneck bandwidth" per rank = DeepEP's bytes / the kernel's time (intranode EP8: received rows x H x 2,
  x (1 + 4/128) / 2 for FP8; internode EP16/32/64: (token, destination node) pairs x H x 2, own node included, x
  the same factor for the FP8 dispatch)::

      intranode EP8  dispatch 153 GB/s  combine 158        internode EP16 43 / 43, EP32 58 / 57, EP64 51 / 50

  The project's kernels of that shape: ``shmemx.deep_ep.Buffer`` (``--kernel deep_ep``, the default), intranode
  at EP8 and the internode mode above (one RDMA copy per (token, node) to the same-lane forwarder, forwarded
  inside the node), or ``moe.Buffer`` (``--kernel moe`` with ``--schedule``; the full mesh by default).
* **ll** (low latency), 128 tokens, H = 7168, top-8 of 256 experts, FP8 dispatch / BF16 combine: dispatch
  77/118/155/173/192/194 us and combine 114/195/273/314/369/360 us at EP 8/16/32/64/128/256, with
  ``deep_ep.Buffer.low_latency_dispatch`` / ``low_latency_combine`` (one WRITE per (token, expert) message,
  one put + signal per (rank, local expert), one QP per local expert).

For each EP a job is recorded (DeepEP's test routing with a seed per rank; a first call, then the timed calls in
regions "dispatch" and "combine"), then replayed on ``h800_cx7``. At most two parameters are fitted on at most
two points (the dispatch figures), every other point predicted; ``--fit`` chooses which:

* ``tiers`` (normal): the NVLink bandwidth on the EP8 dispatch, the RDMA bandwidth on a dispatch across nodes
  (``--tier-eps``: EP64 with ``--kernel deep_ep``, whose EP16 dispatch is bound by its forwarders' NVLink, not by
  RDMA; EP16 with ``--kernel moe``); with ``--kernel deep_ep`` the default fits are ``tiers`` and ``none``;
* ``none``: every value as the topology file has it, nothing fitted;
* ``rdma`` (normal, ll): the RDMA bandwidth on the first fitted EP and the engine's per-WQE cost
  (``engine.wqe_us``) on the second (what grows with the number of destinations); ``--fit-eps`` names them
  (default 16,64);
* ``cost`` (ll, the default with ``kernel``): one parameter on one point, the fixed cost of a kernel call
  (``host.kernel_us``: launch, grid syncs, the per-call work not posted) on the first ``--fit-eps``, every
  bandwidth as the topology file has it (NVLink 160, CX7 50 GB/s: DeepEP's own figures);
* ``kernel`` (ll): the RDMA bandwidth and ``host.kernel_us`` on both ``--fit-eps`` (the bandwidth whose modelled
  rise between them is the published rise, then the cost).

Each bandwidth is solved by the secant method on 1/B (the modelled time is nearly linear in it), the WQE cost by
bisection on its logarithm around that.

Measured (2026-12-01, EP 8/16/32/64; EP128/256 do not fit this machine's memory), error at the points not fitted:

* ll, ``cost`` (host.kernel_us = 27.4 on EP16, NVLink 160 / CX7 50 GB/s as the file has them): dispatch -6.4% /
  +2.8% / +3.1% at EP8/32/64, combine -1.9 .. +4.7% at every EP; ``kernel`` (CX7 54.7 GB/s, host.kernel_us = 34.7
  on EP16 and EP64): dispatch +3.1% / +0.4% at EP8/32, combine -6.5 .. +4.5%. Both within 10% everywhere.
* normal, ``--kernel deep_ep`` (the default: intranode at EP8, the internode kernel above; 256 tokens), ``tiers``
  (NVLink 146.8 GB/s on EP8, RDMA 55.0 GB/s on EP64): dispatch -5.9% / +3.0% at EP16/32, combine -4.9 .. +3.2% at
  every EP; ``none`` (NVLink 160, CX7 50 GB/s): dispatch within 8.4%, combine within 10.3%. The EP16 dispatch is
  bound by the forwarders' NVLink egress (2.8x the bytes DeepEP counts), EP32/64 by the CX7 port.
* normal, ``--kernel moe`` (the full mesh, 256 tokens), ``tiers`` (NVLink 146.8 on EP8, RDMA 84.0 GB/s on EP16):
  dispatch -15.5% / -13.0% at EP32/64, combine -10.3 .. +7.0% (+0.2% at EP8). The full mesh sends a token once per
  destination rank, DeepEP's internode kernel once per destination node: the bytes per rank differ from DeepEP's
  by a factor that changes with EP (kernel / DeepEP-counted bytes 1.64 / 1.50 / 1.64 at EP16/32/64), which one
  fitted bandwidth cannot follow. See docs/timing-model.md for the tables.
"""

import argparse
import os
import sys
import tempfile
import time

import ml_dtypes
import numpy as np

HERE = os.path.abspath(__file__)
H, K, E, GROUPS, PER_NODE = 7168, 8, 256, 4, 8
FP8 = (1 + 4 / 128) / 2
LL_TOKENS, LL_MSG = 128, H + 4 * (H // 128) + 16  # DeepEP's FP8 message bytes per (token, expert) selection
PUBLISHED = {8: (153.0, 158.0), 16: (43.0, 43.0), 32: (58.0, 57.0), 64: (51.0, 50.0)}  # GB/s
PUBLISHED_LL = {8: (77.0, 114.0), 16: (118.0, 195.0), 32: (155.0, 273.0), 64: (173.0, 314.0),
                128: (192.0, 369.0), 256: (194.0, 360.0)}  # us


def routing(rank: int, tokens: int, n_pes: int) -> np.ndarray:
    """DeepEP's normal-mode test routing: |randn| + 1 scores, the top-4 nodes by their best expert, top-8 experts
    in them."""
    rng = np.random.default_rng(1000 + rank)
    scores = np.abs(rng.standard_normal((tokens, E))) + 1
    nodes = max(n_pes // PER_NODE, 1)
    g = min(GROUPS, nodes)
    best = scores.reshape(tokens, nodes, E // nodes).max(-1)
    keep = np.zeros((tokens, nodes), bool)
    np.put_along_axis(keep, np.argsort(-best, axis=1)[:, :g], True, axis=1)
    masked = np.where(np.repeat(keep, E // nodes, axis=1), scores, 0.0)
    return np.argsort(-masked, axis=1, kind="stable")[:, :K].astype(np.int64)


def ll_routing(rank: int) -> np.ndarray:
    """DeepEP's low-latency test routing: top-8 of |randn| + 1 scores over all experts (no node groups)."""
    rng = np.random.default_rng(2000 + rank)
    scores = np.abs(rng.standard_normal((LL_TOKENS, E))) + 1
    return np.argsort(-scores, axis=1, kind="stable")[:, :K].astype(np.int64)


def deepep_bytes(n_pes: int, tokens: int) -> np.ndarray:
    """DeepEP's per-rank bytes of the BF16 payload (the FP8 dispatch counts FP8 x this): [n_pes] float."""
    if n_pes <= PER_NODE:  # intranode: rows each rank receives x H x 2
        recv = np.zeros(n_pes)
        for r in range(n_pes):
            ranks = routing(r, tokens, n_pes) // (E // n_pes)
            for dst in range(n_pes):
                recv[dst] += (ranks == dst).any(axis=1).sum()
        return recv * H * 2
    out = np.zeros(n_pes)
    for r in range(n_pes):
        node = routing(r, tokens, n_pes) // (E // n_pes) // PER_NODE
        pairs = sum((node == nd).any(axis=1).sum() for nd in range(n_pes // PER_NODE))
        out[r] = pairs * H * 2
    return out


def _fp8(x: np.ndarray) -> tuple:
    tokens = x.shape[0]
    scales = (np.abs(x).reshape(tokens, H // 128, 128).max(-1) / 448.0).astype(np.float32)
    return (x / np.repeat(scales, 128, axis=1)).astype(ml_dtypes.float8_e4m3fn), scales


def kernel_moe(tokens: int, schedule: str | None) -> None:
    import shmemx
    from shmemx.kernels import moe

    shmemx.aclshmemx_set_qp_num(shmemx.ACLSHMEM_DATA_OP_UDMA, moe.POLICY_QPS["two_3_1"])
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    topk = routing(me, tokens, n)
    x8, scales = _fp8(np.random.default_rng(me).standard_normal((tokens, H)).astype(np.float32))
    kwargs = {"schedule": schedule} if schedule else {}
    buf = moe.Buffer(tokens, H, K, E, server_size=PER_NODE, **kwargs)
    layout = buf.get_dispatch_layout(topk)
    first = buf.dispatch((x8, scales), topk_idx=topk, topk_weights=np.ones(topk.shape, np.float32),
                         num_tokens_per_rank=layout.num_tokens_per_rank, is_token_in_rank=layout.is_token_in_rank,
                         num_tokens_per_expert=layout.num_tokens_per_expert)
    shmemx.aclshmem_barrier_all()
    with shmemx.region("dispatch"):
        got = buf.dispatch((x8, scales), handle=first.handle)
    shmemx.aclshmem_barrier_all()
    back = got.recv_x[0].astype(np.float32).astype(ml_dtypes.bfloat16)
    with shmemx.region("combine"):
        buf.combine(back, got.handle, got.recv_topk_weights)
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


def kernel_deep_ep(tokens: int) -> None:
    """deep_ep.Buffer's normal mode (intranode at 8 ranks, internode above): a fresh dispatch, then the timed
    cached dispatch and combine."""
    import shmemx
    from shmemx import deep_ep

    n = int(os.environ["SHMEMX_SIZE"])
    buf = deep_ep.Buffer(None, int(2e9), int(1e9) if n > PER_NODE else 0, num_qps_per_rank=24, server_size=PER_NODE)
    me = buf.rank
    topk = routing(me, tokens, n)
    x = _fp8(np.random.default_rng(me).standard_normal((tokens, H)).astype(np.float32))
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, E)
    weights = np.ones(topk.shape, np.float32)
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
                                                   is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                                                   topk_idx=topk, topk_weights=weights)
    shmemx.aclshmem_barrier_all()
    with shmemx.region("dispatch"):
        recv_x, _, _, _, _, _ = buf.dispatch(x, handle=handle)
    shmemx.aclshmem_barrier_all()
    back = recv_x[0].astype(np.float32).astype(ml_dtypes.bfloat16)
    with shmemx.region("combine"):
        buf.combine(back, handle, topk_weights=recv_w)
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


def kernel_ll() -> None:
    """deep_ep's low-latency dispatch and combine, DeepEP's benchmark shape: a first pair, then the timed pair."""
    import shmemx
    from shmemx import deep_ep

    n = int(os.environ["SHMEMX_SIZE"])
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(LL_TOKENS, H, n, E)
    buf = deep_ep.Buffer(None, num_rdma_bytes=hint, low_latency_mode=True, num_qps_per_rank=E // n,
                         server_size=PER_NODE)
    me = buf.rank
    topk = ll_routing(me)
    x = np.random.default_rng(me).standard_normal((LL_TOKENS, H)).astype(ml_dtypes.bfloat16)
    weights = np.abs(np.random.default_rng(99 + me).standard_normal(topk.shape)).astype(np.float32)
    local = E // n
    back = np.zeros((local, n * LL_TOKENS, H), ml_dtypes.bfloat16)  # lazily zero: only received rows are touched
    for timed in (False, True):
        shmemx.aclshmem_barrier_all()
        with shmemx.region("dispatch" if timed else "first dispatch"):
            recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, topk, LL_TOKENS, E, use_fp8=True)
        if not timed:
            for e in range(local):  # the expert's output: its received rows, as BF16 (untouched rows stay zero)
                c = int(count[e])
                back[e, :c] = recv_x[0][e, :c].astype(np.float32) * np.repeat(recv_x[1][e, :c], 128, axis=1)
        shmemx.aclshmem_barrier_all()
        with shmemx.region("combine" if timed else "first combine"):
            buf.low_latency_combine(back, topk, weights, handle)
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


MB_PER_RANK = {"ll": 160, "normal": 150}  # memory per rank while recording (measured at EP64, rounded up)


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def record(n: int, folder: str, args) -> str | None:
    from shmemx.launcher import launch

    if args.mode == "ll":
        name, extra = f"ll_ep{n}", ["--rank-main", "--kernel", "ll"]
    else:
        name = f"{args.kernel}_ep{n}_t{args.tokens}{'_' + args.schedule if args.schedule else ''}"
        extra = ["--rank-main", "--kernel", args.kernel, "--tokens", str(args.tokens)] + \
            (["--schedule", args.schedule] if args.schedule else [])
    if args.shape:
        extra += ["--shape", args.shape]
        name += "_" + args.shape.replace(",", "_")
    path = os.path.join(folder, name + ".rec")
    if not os.path.exists(path):
        need, avail = n * MB_PER_RANK[args.mode] * 2**20, _mem_available()
        if avail is not None and need > 0.8 * avail:
            print(f"EP{n}: not recorded: {n} ranks need about {need / 2**30:.1f} GiB of memory ({MB_PER_RANK[args.mode]}"
                  f" MiB each, measured at EP64), {avail / 2**30:.1f} GiB are available", flush=True)
            return None
        t = time.perf_counter()
        heap = "3G" if args.kernel == "moe" and args.mode == "normal" else None  # deep_ep.Buffer sizes its heap
        code = launch(n, HERE, extra, record=path, heap_size=heap, timeout=3600, tag_output=True)
        if code:
            raise SystemExit(f"recording EP{n} failed with exit status {code}")
        print(f"(recorded EP{n} in {time.perf_counter() - t:.0f} s of wall time)", flush=True)
    return path


class Model:
    """The modelled figures of one recording, replayed on h800_cx7 with overrides (cached)."""

    def __init__(self, path: str, mode: str, nbytes=None):
        self.path, self.mode, self.nbytes = path, mode, nbytes
        self.cache: dict = {}

    def __call__(self, over: dict) -> tuple[float, float]:
        """normal: (dispatch, combine) GB/s per rank as DeepEP computes them, the mean over ranks; ll: (dispatch,
        combine) us, the mean over ranks (DeepEP's benchmark averages its ranks)."""
        key = tuple(sorted(over.items()))
        if key not in self.cache:
            from shmemx.observe.replay import replay

            doc = replay(self.path, "h800_cx7", dict({"ranks_per_server": PER_NODE}, **over))
            d = np.array([p["regions"]["dispatch"] for p in doc["pes"]])
            c = np.array([p["regions"]["combine"] for p in doc["pes"]])
            if self.mode == "ll":
                self.cache[key] = (float(d.mean()), float(c.mean()))
            else:
                self.cache[key] = (float(np.mean(self.nbytes * FP8 / d / 1e3)), float(np.mean(self.nbytes / c / 1e3)))
        return self.cache[key]


B_RANGE = (1.0, 1e4)  # GB/s: a fitted bandwidth outside this range means the point cannot be met by bandwidth


def solve_bandwidth(target: float, f, guess: float) -> float:
    """The bandwidth b at which the modelled figure ``f(b)`` meets ``target``: secant on x = 1/b, kept within
    ``B_RANGE`` (the bound when no bandwidth meets it)."""
    lo_x, hi_x = 1 / B_RANGE[1], 1 / B_RANGE[0]
    x0, x1 = 1 / guess, 1 / (guess * 1.5)
    g0, g1 = f(1 / x0) - target, f(1 / x1) - target
    for _ in range(30):
        if g1 == g0 or abs(g1) < 1e-6 * abs(target):
            break
        x0, x1, g0 = x1, min(max(x1 - g1 * (x1 - x0) / (g1 - g0), lo_x), hi_x), g1
        g1 = f(1 / x1) - target
        if x1 in (lo_x, hi_x) and x0 == x1:
            break
    if abs(g1) > 1e-3 * abs(target):  # not met: insensitive to the bandwidth, or beyond the range
        return B_RANGE[1] if g1 == g0 or x1 == lo_x else B_RANGE[0]
    return 1 / x1


def fit_tiers(models: dict, published: dict, a: int = 8, b: int = 16) -> dict:
    """The NVLink bandwidth on EP ``a`` (one node), then the RDMA bandwidth on EP ``b``."""
    over = {"intra.bandwidth_GBps": solve_bandwidth(
        published[a][0], lambda bw: models[a]({"intra.bandwidth_GBps": bw})[0], 160.0)}
    over["inter.bandwidth_GBps"] = solve_bandwidth(
        published[b][0], lambda bw: models[b](dict(over, **{"inter.bandwidth_GBps": bw}))[0], 50.0)
    return over


W_GRID = (0.003, 0.01, 0.03, 0.1, 0.3)  # us per WQE tried before bisecting


def fit_rdma(models: dict, published: dict, a: int, b: int) -> tuple[dict, str]:
    """For each per-WQE cost w the RDMA bandwidth that meets EP ``a``; w such that EP ``b`` is met too (a sign
    change of the error at EP ``b`` on ``W_GRID``, then bisection on log w). Returns the overrides and a note
    (empty, or why no pair meets both points: then the pair closest at EP ``b``)."""
    def at(w: float) -> dict:
        over = {"engine.wqe_us": w}
        over["inter.bandwidth_GBps"] = solve_bandwidth(published[a][0], lambda bw: models[a](
            dict(over, **{"inter.bandwidth_GBps": bw}))[0], 50.0)
        return over

    def err(over: dict) -> float:
        return models[b](over)[0] - published[b][0]

    def feasible(over: dict) -> bool:
        return B_RANGE[0] * 1.001 < over["inter.bandwidth_GBps"] < B_RANGE[1] * 0.999

    grid = [(w, at(w)) for w in W_GRID]
    grid = [(w, o, err(o)) for w, o in grid if feasible(o)]
    if not grid:
        return at(W_GRID[0]), f"no RDMA bandwidth meets EP{a} at any w of {W_GRID}"
    for (w0, o0, e0), (w1, o1, e1) in zip(grid, grid[1:]):
        if e0 == 0 or (e0 < 0) != (e1 < 0):
            lo, hi, elo = w0, w1, e0
            for _ in range(6):
                mid = (lo * hi) ** 0.5
                om = at(mid)
                em = err(om)
                if (em < 0) == (elo < 0):
                    lo, elo = mid, em
                else:
                    hi = mid
            return at((lo * hi) ** 0.5), ""
    w, over, e = min(grid, key=lambda g: abs(g[2]))
    return over, (f"no (bandwidth, w) meets both EP{a} and EP{b}: EP{b} stays {'above' if e > 0 else 'below'} "
                  f"the published figure for every w in {W_GRID} (the closest shown)")


def fit_cost(models: dict, published: dict, a: int) -> tuple[dict, str]:
    """One parameter on one point: the fixed cost of a kernel call (``host.kernel_us``) that meets EP ``a``, every
    bandwidth as the topology file has it (the cost adds to every call alike)."""
    cost = published[a][0] - models[a]({})[0]
    if cost < 0:
        return {"host.kernel_us": 0.0}, f"EP{a} is above the published figure without a fixed cost: host.kernel_us = 0"
    return {"host.kernel_us": cost}, ""


def fit_kernel(models: dict, published: dict, a: int, b: int) -> tuple[dict, str]:
    """The RDMA bandwidth and the fixed cost of a kernel call (``host.kernel_us``) that meet EP ``a`` and EP ``b``:
    the cost adds to every call alike, so the bandwidth is the one whose modelled rise from EP ``a`` to EP ``b``
    is the published rise (secant on 1/B), then the cost is what EP ``a`` still misses."""
    rise = published[b][0] - published[a][0]
    bw = solve_bandwidth(rise, lambda x: models[b]({"inter.bandwidth_GBps": x})[0]
                         - models[a]({"inter.bandwidth_GBps": x})[0], 50.0)
    over = {"inter.bandwidth_GBps": bw}
    cost = published[a][0] - models[a](over)[0]
    note = ""
    if cost < 0:
        note, cost = f"EP{a} is above the published figure without a fixed cost: host.kernel_us = 0", 0.0
    over["host.kernel_us"] = cost
    return over, note


def _wqes_per_rank(path: str) -> float:
    from shmemx.observe.record import Recording

    rec = Recording.load(path)
    total = sum(sum(len(b) for b in p.bbs.values()) for p in rec.parts)  # BBs ~ WQEs (one BB each here)
    return total / rec.n_pes


def fit_points(how: str, fit_eps: tuple, tier_eps: tuple) -> tuple:
    """The EPs whose recordings fit ``how`` fits its parameters on (``none``: no EP)."""
    return {"none": (), "tiers": tier_eps, "cost": fit_eps[:1]}.get(how, fit_eps)


def unfit(how: str, fit_eps: tuple, tier_eps: tuple, recorded: list) -> str | None:
    """Why fit ``how`` cannot run on the ``recorded`` EPs (the EPs it fits on were not recorded: with ``--mode ll
    --eps 8,16,32`` the 'kernel' fit's default EP 64), or None when it can."""
    absent = [n for n in fit_points(how, fit_eps, tier_eps) if n not in recorded]
    if not absent:
        return None
    flag = "--tier-eps" if how == "tiers" else "--fit-eps"
    return (f"fit '{how}': skipped: it fits on EP {', '.join(map(str, absent))} ({flag}), which was not recorded "
            f"(recorded: EP {', '.join(map(str, recorded))}); name recorded EPs with {flag}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", default="deep_ep", choices=("deep_ep", "moe", "ll"),
                    help="normal mode: deep_ep.Buffer (default) or moe.Buffer; (ll: internal)")
    ap.add_argument("--mode", choices=("normal", "ll"), default="normal")
    ap.add_argument("--rank-main", action="store_true", help="(internal) run the kernel in a rank")
    ap.add_argument("--tokens", type=int, default=256, help="normal mode: tokens per rank (DeepEP: 4096)")
    ap.add_argument("--schedule", default=None, help="moe.Buffer schedule (--kernel moe)")
    ap.add_argument("--dir", default=None, help="keep the recordings here (reused when present)")
    ap.add_argument("--eps", default=None, help="EP sizes to record (normal: 8,16,32,64; ll: 8,16,32,64)")
    ap.add_argument("--fit", choices=("tiers", "rdma", "kernel", "cost", "both", "none"), default=None,
                    help="ll default: cost (host.kernel_us on the first --fit-eps) and kernel (RDMA bandwidth + "
                         "host.kernel_us on both); normal default: tiers and rdma; none: the topology file's "
                         "values, nothing fitted")
    ap.add_argument("--fit-eps", default="16,64", help="the two EPs the 'rdma' fit uses")
    ap.add_argument("--tier-eps", default=None,
                    help="the 'tiers' fit: the EP of its NVLink point (one node) and of its RDMA point (default "
                         "8,64 with --kernel deep_ep, 8,16 with --kernel moe)")
    ap.add_argument("--shape", default=None, metavar="H,E,T_LL,NODE",
                    help="a smaller hidden size, expert count, low-latency token count and node size (to try the "
                         "script out; the published figures are compared with it as if it were DeepEP's shape)")
    args = ap.parse_args()
    global H, E, LL_TOKENS, PER_NODE
    if args.shape:
        H, E, LL_TOKENS, PER_NODE = (int(v) for v in args.shape.split(","))
    if args.rank_main:
        if args.kernel == "ll":
            kernel_ll()
        elif args.kernel == "moe":
            kernel_moe(args.tokens, args.schedule)
        else:
            kernel_deep_ep(args.tokens)
        return
    folder = args.dir or tempfile.mkdtemp(prefix="shmemx-deepep-")
    os.makedirs(folder, exist_ok=True)
    eps = [int(e) for e in (args.eps or "8,16,32,64").split(",")]
    fit_eps = tuple(int(e) for e in args.fit_eps.split(","))
    recs = {n: record(n, folder, args) for n in eps}
    skipped = [n for n in eps if recs[n] is None]
    eps = [n for n in eps if recs[n] is not None]
    if any(n in skipped for n in fit_eps):
        fit_eps = (fit_eps[0], max(eps))
        print(f"fitting on EP{fit_eps[0]} and EP{fit_eps[1]} instead (EP {', '.join(map(str, skipped))} not recorded)")
    if args.mode == "ll":
        published, unit = PUBLISHED_LL, "us"
        models = {n: Model(recs[n], "ll") for n in eps}
        print(f"DeepEP low-latency mode vs the replay of deep_ep.Buffer.low_latency_dispatch/combine, {LL_TOKENS} "
              f"tokens per rank, H={H}, top-{K} of {E} experts, FP8 dispatch / BF16 combine, h800_cx7")
        fits = ("cost", "kernel") if args.fit is None else ("rdma",) if args.fit in ("rdma", "both") \
            else (args.fit,)
    else:
        published, unit = PUBLISHED, "GB/s"
        models = {n: Model(recs[n], "normal", deepep_bytes(n, args.tokens)) for n in eps}
        what = f"moe.Buffer ({args.schedule or 'full mesh'})" if args.kernel == "moe" else \
            "deep_ep.Buffer (intranode at EP8, internode above)"
        print(f"DeepEP normal mode vs the replay of {what}, {args.tokens} tokens per rank, H={H}, top-{GROUPS} "
              f"nodes, top-{K} of {E} experts, FP8 dispatch / BF16 combine, h800_cx7")
        fits = ("tiers", "rdma") if args.fit in (None, "both") else (args.fit,)
        if args.fit is None and args.kernel == "deep_ep":  # its RDMA binds only from EP32 on (tier_eps): no 'rdma'
            fits = ("tiers", "none")
    if args.fit == "none":
        fits = ("none",)
    tier_eps = tuple(int(e) for e in (args.tier_eps or ("8,64" if args.kernel == "deep_ep" else "8,16")).split(","))
    if args.shape:  # a try-out: the published figures stand in for the EPs given, in order
        published = dict(zip(eps, published.values()))
        tier_eps = tuple(eps[:2])
    for how in fits:
        why = unfit(how, fit_eps, tier_eps, eps)
        if why:
            print(f"\n{why}")
            continue
        t = time.perf_counter()
        note = ""
        if how == "none":
            over, fitted_points = {}, set()
        elif how == "tiers":
            over = fit_tiers(models, published, *tier_eps)
            fitted_points = {(tier_eps[0], "dispatch"), (tier_eps[1], "dispatch")}
        elif how == "cost":
            over, note = fit_cost(models, published, fit_eps[0])
            fitted_points = {(fit_eps[0], "dispatch")}
        elif how == "kernel":
            over, note = fit_kernel(models, published, *fit_eps)
            fitted_points = {(fit_eps[0], "dispatch"), (fit_eps[1], "dispatch")}
            if not B_RANGE[0] * 1.001 < over["inter.bandwidth_GBps"] < B_RANGE[1] * 0.999:
                fitted_points = set()
        else:
            over, note = fit_rdma(models, published, *fit_eps)
            fitted_points = {(fit_eps[0], "dispatch")} | (set() if note else {(fit_eps[1], "dispatch")})
            if not B_RANGE[0] * 1.001 < over["inter.bandwidth_GBps"] < B_RANGE[1] * 0.999:
                fitted_points = set()
        print(f"\nfit '{how}': " + (", ".join(f"{k} = {v:.4g}" for k, v in over.items()) or "nothing fitted")
              + " (the file: intra 160, inter 50 GB/s, wqe 0.05 us, kernel 0 us;"
              + f" fitted in {time.perf_counter() - t:.0f} s)")
        bounded = [k for k, v in over.items() if k.endswith("GBps") and not B_RANGE[0] * 1.001 < v < B_RANGE[1] * 0.999]
        if bounded:
            note = (note + "; " if note else "") + f"{', '.join(bounded)} at the bound of {B_RANGE} GB/s: no " \
                "bandwidth meets that point (something else bounds it)"
        if how == "tiers":
            if "intra.bandwidth_GBps" in bounded:
                fitted_points.discard((tier_eps[0], "dispatch"))
            if "inter.bandwidth_GBps" in bounded:
                fitted_points.discard((tier_eps[1], "dispatch"))
        if note:
            print("note: " + note)
        print(f"{'EP':>4} {'kind':>9} {'published ' + unit:>15} {'modelled ' + unit:>14} {'error':>8}  WQEs/rank (job)")
        errors = []
        for n in eps:
            d, c = models[n](over)
            wqes = _wqes_per_rank(recs[n])
            for kind, got, want in (("dispatch", d, published[n][0]), ("combine", c, published[n][1])):
                fitted = (n, kind) in fitted_points
                err = (got - want) / want
                if not fitted:
                    errors.append((abs(err), kind))
                print(f"{n:>4} {kind:>9} {want:15.1f} {got:14.1f} {err:+8.1%}  {wqes:9,.0f}"
                      f"{'  (fitted)' if fitted else ''}")
        for kind in ("dispatch", "combine"):
            errs = [e for e, k in errors if k == kind]
            if errs:
                print(f"largest {kind} error at a point not fitted: {max(errs):.1%} (target 10%)")
    if args.mode == "ll":
        missing = sorted(set(PUBLISHED_LL) - set(eps))
        if missing:
            print(f"not recorded: EP {', '.join(map(str, missing))} (docs/timing-model.md: what this machine can "
                  "record)")


if __name__ == "__main__":
    main()
