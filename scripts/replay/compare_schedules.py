"""A worked comparison in modelled time: the MoE dispatch + combine schedules at 128 PEs on the default topology.

    flock /tmp/shmemx-heavy.lock python scripts/replay/compare_schedules.py [--pes 128] [--tokens 128]
        [--hidden 7168] [--schedules fullmesh,hierarchy,groups] [--topology ascend950] [--dir DIR]

Each schedule is one recorded job (``moe.Buffer``: a fresh dispatch, then a combine, each in a region; DeepEP's
test routing, top-8 of 8 experts per rank), replayed on the topology (16 ranks per server: 128 PEs = 8 servers).
Prints per schedule the WQEs and bytes (all, and across servers), the modelled dispatch and combine times (max
over PEs), what the critical path was bound by, and its three longest stretches. A schedule that this checkout's
``moe.Buffer`` does not know (``schedule=`` arrives with issue 12) is listed as missing; ``fullmesh`` then also
runs as the Buffer's default. Recordings are kept in ``--dir`` and reused.
"""

import argparse
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.abspath(__file__)


def kernel(tokens: int, hidden: int, schedule: str, server_size: int) -> None:
    import ml_dtypes

    import shmemx
    from shmemx.kernels import moe

    shmemx.aclshmemx_set_qp_num(shmemx.ACLSHMEM_DATA_OP_UDMA, 2)
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    experts = 8 * n
    rng = np.random.default_rng(me)
    scores = np.abs(rng.standard_normal((tokens, experts))) + 1
    topk = np.argpartition(-scores, 7, axis=1)[:, :8].astype(np.int64)
    x = rng.standard_normal((tokens, hidden)).astype(ml_dtypes.bfloat16)
    kwargs = {} if schedule == "default" else {"schedule": schedule}
    buf = moe.Buffer(tokens, hidden, 8, experts, server_size=server_size, **kwargs)
    shmemx.aclshmem_barrier_all()
    with shmemx.region("dispatch"):
        got = buf.dispatch(x, topk_idx=topk, topk_weights=np.full(topk.shape, 0.125, np.float32))
    with shmemx.region("combine"):
        buf.combine(got.recv_x, got.handle, got.recv_topk_weights)
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


def supported(schedule: str) -> bool:
    import inspect

    from shmemx.kernels import moe

    return schedule == "default" or "schedule" in inspect.signature(moe.Buffer).parameters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", default=None, help="(internal) run the kernel with this schedule in a rank")
    ap.add_argument("--pes", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--schedules", default="fullmesh,hierarchy,groups")
    ap.add_argument("--topology", default="ascend950")
    ap.add_argument("--server-size", type=int, default=16, help="ranks per server (the topology's is set to it)")
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    if args.kernel:
        kernel(args.tokens, args.hidden, args.kernel, args.server_size)
        return
    from shmemx.launcher import launch
    from shmemx.observe.replay import replay

    folder = args.dir or tempfile.mkdtemp(prefix="shmemx-sched-")
    os.makedirs(folder, exist_ok=True)
    wanted = args.schedules.split(",")
    runs = [s for s in wanted if supported(s)]
    missing = [s for s in wanted if s not in runs]
    if missing and "fullmesh" in missing:
        runs.insert(0, "default")
        missing.remove("fullmesh")
    rows = []
    for schedule in runs:
        path = os.path.join(folder, f"{schedule}_p{args.pes}_s{args.server_size}_t{args.tokens}_h{args.hidden}.rec")
        if not os.path.exists(path):
            code = launch(args.pes, HERE, ["--kernel", schedule, "--tokens", str(args.tokens), "--hidden",
                                           str(args.hidden), "--server-size", str(args.server_size)], record=path,
                          heap_size="1G", timeout=3600)
            if code:
                raise SystemExit(f"recording {schedule} failed with exit status {code}")
        start = time.monotonic()
        doc = replay(path, args.topology, {"ranks_per_server": args.server_size})
        seconds = time.monotonic() - start
        rows.append((schedule, doc, seconds))
    topo = rows[0][1]["topology"] if rows else {}
    print(f"MoE dispatch + combine, {args.pes} PEs, {args.tokens} tokens/PE, H={args.hidden}, top-8, replayed on "
          f"{args.topology} ({topo.get('ranks_per_server')} ranks/server)")
    print(f"{'schedule':<10} {'WQEs':>8} {'MB':>8} {'inter MB':>9} {'dispatch us':>12} {'combine us':>11} "
          f"{'makespan us':>12} {'bound':>12} {'replay s':>9}")
    for schedule, doc, seconds in rows:
        inter = sum(v["bytes"] for k, v in doc["links"].items() if k == "egress inter") / 1e6
        total = sum(p["bytes"] for p in doc["pes"]) / 1e6
        name = "fullmesh" if schedule == "default" else schedule
        print(f"{name:<10} {doc['wqes']:>8,} {total:8.1f} {inter:9.1f} {doc['regions']['dispatch']['max_us']:12.1f} "
              f"{doc['regions']['combine']['max_us']:11.1f} {doc['makespan_us']:12.1f} "
              f"{doc['critical_path']['bound']:>12} {seconds:9.1f}")
    for schedule, doc, _ in rows:
        cp = doc["critical_path"]
        top = sorted(cp["steps"], key=lambda s: -s["us"])[:3]
        name = "fullmesh" if schedule == "default" else schedule
        parts = "; ".join(f"{s['what']} {s['us']:.1f} us at {s['where']}" + (f" x{s['count']}" if s["count"] > 1
                                                                                else "") for s in top)
        print(f"{name}: critical path {', '.join(f'{k} {v:.1f}' for k, v in sorted(cp['breakdown'].items(), key=lambda kv: -kv[1])[:4])} us; longest: {parts}")
        for w in doc["warnings"]:
            print(f"  warning {w['kind']} x{w['count']}: {w['example']}")
    if missing:
        print(f"not in this checkout's moe.Buffer yet (issue 12): {', '.join(missing)}")


if __name__ == "__main__":
    main()
