"""Memory footprint of the UDMA segments (queue tables and rings) of a real job, measured from /dev/shm.

    shmemx run -n 128 --heap-size 1M scripts/udma_footprint.py --qps 2

Each PE's UDMA segment is a sparse file: its size is the address space reserved (``UdmaSegment.size``), its
``st_blocks`` the memory actually used. PE 0 reads both for every PE's file at three moments: after init, after
one put per (peer, qp), and after 256 puts per (peer, qp) (every PE sends to every other PE on every QP, quieting
each queue). Prints one table: per PE (median and max over PEs) and for the whole job. The "Ring memory"
table of docs/design.md comes from this script at 128 PEs x 2 QPs.
"""

import argparse
import os

import numpy as np

import shmemx
from shmemx.udma.segment import UdmaSegment
from shmemx.runtime import runtime

MIB = 1 << 20

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--qps", type=int, default=2, help="QPs per peer (default 2)")
ap.add_argument("--sq-depth", type=int, default=None, help="SQ depth (default: shmemx's, 32768)")
args = ap.parse_args()

shmemx.aclshmemx_set_qp_num(shmemx.ACLSHMEM_DATA_OP_UDMA, args.qps)
shmemx.init(sq_depth=args.sq_depth)
rt = runtime()
me, n = shmemx.my_pe(), shmemx.n_pes()
dst = shmemx.zeros((n, args.qps, 8), np.int64, name="dst")
src = shmemx.zeros(8, np.int64, name="src")
rows = []


def measure(label: str) -> None:
    shmemx.aclshmem_barrier_all()  # every PE finished the phase (each quieted its queues)
    if me == 0:
        stats = [os.stat(f"/dev/shm/shmemx_{rt.job_id}_udma{p}") for p in range(n)]
        used = np.array([st.st_blocks * 512 for st in stats]) / MIB
        rows.append((label, stats[0].st_size / MIB, float(np.median(used)), float(used.max()), float(used.sum())))
    shmemx.aclshmem_barrier_all()


measure("after init")
for count in (1, 255):  # 1, then 255 more: 256 in all
    for k in range(1, n):
        peer = (me + k) % n
        for qp in range(args.qps):
            for _ in range(count):
                shmemx.aclshmemx_udma_qp_put_nbi(dst[me, qp], src, 8, peer, qp)
            shmemx.aclshmemx_udma_qp_quiet(peer, qp)
    measure(f"after {1 if count == 1 else 256} puts per (peer, qp)")

if me == 0:
    seg = rt.udma.seg
    formula = UdmaSegment.size(n, args.qps, seg.sq_depth, seg.cq_depth) / MIB
    print(f"UDMA segments of {n} PEs x {args.qps} QPs, SQ depth {seg.sq_depth}, CQ depth {seg.cq_depth}: "
          f"{formula:.1f} MiB reserved per PE (UdmaSegment.size), {formula * n / 1024:.1f} GiB for the job")
    print(f"{'moment':<32} {'file size/PE':>13} {'touched/PE median':>18} {'max':>9} {'whole job':>11}")
    for label, size, median, top, total in rows:
        print(f"{label:<32} {size:>9.1f} MiB {median:>14.2f} MiB {top:>5.2f} MiB {total:>7.0f} MiB")
shmemx.finalize()
