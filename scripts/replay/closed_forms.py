"""The replay's closed forms on kernels the tests do not contain (issue 13's bars); prints figure, form, error.

    python scripts/replay/closed_forms.py                 # 1 MiB put + quiet (within and across servers), 7-to-1
    python scripts/replay/closed_forms.py --alltoall 128  # + the uniform all-to-all at P = 128, 16 per server

Heavy (8 and 128 PEs): run it under ``flock /tmp/shmemx-heavy.lock``. Each case records a job
(``launch(..., record=)``), replays it (``observe.replay``) and compares with the closed form of
../shared/reference/timing_model.md (post + doorbell + wqe + latency + bytes / bandwidth, ...): the relative
error must stay below 1e-9. Exit 1 otherwise.
"""

import argparse
import os
import sys
import tempfile

import numpy as np

import shmemx
from shmemx.launcher import launch
from shmemx.observe.replay import load_topology, replay

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20


def put_1mib() -> None:
    """PE 0 puts 1 MiB into PE 1 and quiets, inside the region "put"."""
    shmemx.init()
    dst = shmemx.zeros(MiB, np.uint8, name="dst")
    if shmemx.my_pe() == 0:
        src = np.arange(MiB, dtype=np.uint32).astype(np.uint8)
        with shmemx.region("put"):
            shmemx.aclshmemx_udma_put_nbi(dst, src, MiB, 1)
            shmemx.aclshmemx_udma_quiet(1)
    shmemx.aclshmem_barrier_all()
    if shmemx.my_pe() == 1:
        assert (dst == np.arange(MiB, dtype=np.uint32).astype(np.uint8)).all()
    shmemx.finalize()


def incast_7_to_1(nbytes: int) -> None:
    """PEs 1..7 each put ``nbytes`` into PE 0 (one put, then one 8-byte signal_op after a quiet would serialise
    them: here each signals with its put, WRITE_WITH_NOTIFY on QP 0); PE 0 waits for the seven signals."""
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    rows = shmemx.zeros((n, nbytes), np.uint8, name="rows")
    flags = shmemx.zeros(n, np.uint64, name="flags")
    if me == 0:
        with shmemx.region("incast"):
            for p in range(1, n):
                shmemx.aclshmem_signal_wait_until(flags[p:p + 1], shmemx.ACLSHMEM_CMP_EQ, 100 + p)
        assert all((rows[p] == p).all() for p in range(1, n))
    else:
        shmemx.aclshmemx_udma_put_signal_nbi(rows[me], np.full(nbytes, me, np.uint8), nbytes, flags[me:me + 1],
                                             100 + me, 0)
        shmemx.aclshmemx_udma_quiet(0)
    shmemx.finalize()


def check(rows: list, name: str, got: float, want: float) -> None:
    err = abs(got - want) / want
    rows.append((name, got, want, err))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--alltoall", type=int, default=0, metavar="P", help="also the all-to-all at P PEs")
    ap.add_argument("--bytes", type=int, default=65536, help="all-to-all bytes per peer")
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    folder = args.dir or tempfile.mkdtemp(prefix="shmemx-closed-")
    os.makedirs(folder, exist_ok=True)
    rows: list = []

    def record(n, target, *targs):
        path = os.path.join(folder, f"case{len(os.listdir(folder))}.rec")
        code = launch(n, target, targs, record=path, timeout=900)
        if code:
            raise SystemExit(f"recording {target} on {n} PEs failed with {code}")
        return path

    put = record(2, put_1mib)
    for topo_name, over, label in (("ascend950", {}, "within a server"),
                                   ("ascend950", {"ranks_per_server": 1}, "across servers"),
                                   ("h800_cx7", {"ranks_per_server": 1}, "across servers, h800_cx7")):
        topo = load_topology(topo_name, over)
        tier = topo.intra if topo.ranks_per_server > 1 else topo.inter
        want = topo.post_us + topo.doorbell_us + topo.wqe_us + tier.latency_us + MiB / tier.bytes_per_us \
            + tier.latency_us
        check(rows, f"1 MiB put + quiet, {label}", replay(put, topo)["regions"]["put"]["max_us"], want)

    nbytes = 3 * MiB // 4
    inc = record(8, incast_7_to_1, nbytes)
    for sharing in ("fcfs", "maxmin"):
        for over in ({}, {"ranks_per_server": 1}):
            topo = load_topology("ascend950", dict(over, **{"network.sharing": sharing}))
            tier = topo.intra if topo.ranks_per_server > 1 else topo.inter
            t0 = topo.post_us + topo.doorbell_us + topo.wqe_us + tier.latency_us
            got = replay(inc, topo)["regions"]["incast"]["max_us"]
            where = "within a server" if over == {} else "across servers"
            check(rows, f"7-to-1 incast of 768 KiB, {where}, {sharing}", got, t0 + 7 * nbytes / tier.bytes_per_us)

    if args.alltoall:
        p, n = args.alltoall, 16
        a2a = record(p, os.path.join(HERE, "alltoall_kernel.py"), "--bytes", str(args.bytes),
                     "--ranks-per-server", str(n), "--order", "inter")
        topo = load_topology("ascend950")
        doc = replay(a2a, topo)
        t0 = topo.post_us + topo.doorbell_us + topo.wqe_us + topo.inter.latency_us
        m = args.bytes
        form = t0 + max((n - 1) * m / topo.intra.bytes_per_us, (p - n) * m / topo.inter.bytes_per_us,
                        (p - 1) * topo.wqe_us)
        check(rows, f"all-to-all P={p}, {n}/server, {m} B: last byte (+ L_inter ack)",
              doc["regions"]["alltoall"]["max_us"], form + topo.inter.latency_us)
        check(rows, f"all-to-all P={p}: mean over PEs", doc["regions"]["alltoall"]["mean_us"],
              form + topo.inter.latency_us)

    width = max(len(r[0]) for r in rows)
    print(f"{'case':<{width}}  {'replayed us':>14}  {'closed form us':>14}  {'rel. error':>10}")
    for name, got, want, err in rows:
        print(f"{name:<{width}}  {got:14.6f}  {want:14.6f}  {err:10.1e}  {'ok' if err < 1e-9 else 'FAIL'}")
    sys.exit(0 if all(r[3] < 1e-9 for r in rows) else 1)


if __name__ == "__main__":
    main()
