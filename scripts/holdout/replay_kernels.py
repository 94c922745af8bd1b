"""Rank scripts for the virtual-time hold-out: kernels whose modelled times have closed forms.

    shmemx run -n 2 --record put.rec scripts/holdout/replay_kernels.py put --mib 1
    shmemx run -n 8 --record in.rec scripts/holdout/replay_kernels.py incast --bytes 262144

``put``: PE 0 times, each in a region of its own, one ``--mib`` MiB put + quiet to PE 1 (region "put"), then
a modelled compute annotation followed by the same put + quiet (region "compute_put"). PE 1 only waits at the
final barrier. ``incast``: every PE but 0 puts ``--bytes`` into its own slot of PE 0's inbox with a
put_signal that sets the sender's own flag word on PE 0; PE 0 waits, in region "incast", for every flag.
Both check their data, so a recording is also a correct run.
"""

from __future__ import annotations

import argparse

import numpy as np

import shmemx

COMPUTE_US = 3.25


def put(mib: float) -> None:
    shmemx.init()
    me = shmemx.my_pe()
    nbytes = int(mib * 2 ** 20)
    landing = shmemx.zeros(nbytes, np.uint8, name="landing")
    shmemx.aclshmem_barrier_all()
    if me == 0:
        src = (np.arange(nbytes, dtype=np.int64) % 251).astype(np.uint8)
        with shmemx.region("put"):
            shmemx.aclshmemx_udma_put_nbi(landing, src, nbytes, 1)
            shmemx.aclshmemx_udma_quiet(1)
        src2 = src[::-1].copy()
        with shmemx.region("compute_put"):
            shmemx.compute(us=COMPUTE_US, name="prep")
            shmemx.aclshmemx_udma_put_nbi(landing, src2, nbytes, 1)
            shmemx.aclshmemx_udma_quiet(1)
    shmemx.aclshmem_barrier_all()
    if me == 1:
        want = (np.arange(nbytes, dtype=np.int64) % 251).astype(np.uint8)[::-1]
        assert np.array_equal(np.asarray(landing), want), "pe 1: the second put's bytes are not there"
    shmemx.finalize()


def incast(nbytes: int) -> None:
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    inbox = shmemx.zeros((n, nbytes), np.uint8, name="incast_inbox")
    flags = shmemx.zeros(n, np.uint64, name="incast_flags")
    shmemx.aclshmem_barrier_all()
    if me == 0:
        with shmemx.region("incast"):
            for s in range(1, n):  # each wait returns when its sender's payload (and so its signal) landed
                shmemx.aclshmem_signal_wait_until(flags[s:s + 1], shmemx.ACLSHMEM_CMP_EQ, 1)
        for s in range(1, n):
            assert (np.asarray(inbox[s]) == s).all(), f"pe 0: slot {s} has the wrong bytes"
    else:
        row = np.full(nbytes, me, np.uint8)
        shmemx.aclshmemx_udma_put_signal_nbi(inbox[me], row, nbytes, flags[me:me + 1], 1, 0)
        shmemx.aclshmemx_udma_quiet(0)
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="kernel", required=True)
    p = sub.add_parser("put")
    p.add_argument("--mib", type=float, default=1.0)
    i = sub.add_parser("incast")
    i.add_argument("--bytes", type=int, default=256 * 1024)
    args = ap.parse_args()
    if args.kernel == "put":
        put(args.mib)
    else:
        incast(args.bytes)


if __name__ == "__main__":
    main()
