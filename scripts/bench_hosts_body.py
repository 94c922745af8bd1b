"""Rank body of ``scripts/bench_rma.py --hosts 2``: PE 0 -> PE 1 across two hosts, shmemx (``--engine shmemx``,
run by ``shmemx run -n 2 --hosts 2``) or MPI's own (``--engine mpi``, run by ``mpiexec -n 2`` with the same
network settings): put bandwidth (k puts then one quiet / Win_flush), 64 B message rate (1024 per quiet / flush),
and a ping-pong (put_signal + signal_wait_until; MPI: Send / Recv). Prints one JSON line on rank 0:
{"bw": {size: [GB/s samples]}, "rate": [msg/s samples], "pingpong_us": [half round trip samples]}."""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

KIB, MIB = 1 << 10, 1 << 20


def _reps(size: int) -> int:
    return max(1, min(256, (16 * MIB) // size))


def shmemx_body(sizes, samples: int, rate_n: int, pings: int) -> dict:
    import shmemx
    from shmemx import (ACLSHMEM_CMP_EQ, aclshmem_barrier_all, aclshmem_signal_wait_until, aclshmemx_udma_put_nbi,
                        aclshmemx_udma_put_signal_nbi, aclshmemx_udma_quiet)

    top = max(max(sizes), 64 * rate_n)
    shmemx.init(heap_size=str(3 * top + 64 * MIB))
    me = shmemx.aclshmem_my_pe()
    src = shmemx.zeros(top, np.uint8)
    dst = shmemx.zeros(top, np.uint8)
    src[:] = 7
    sig = shmemx.zeros(2, np.uint64)
    out = {"bw": {}, "rate": [], "pingpong_us": []}
    aclshmem_barrier_all()
    if me == 0:
        aclshmemx_udma_put_nbi(dst, src, top, 1)
        aclshmemx_udma_quiet(1)
        for size in sizes:
            k = _reps(size)
            row = []
            for _ in range(samples):
                t = time.perf_counter()
                for _ in range(k):
                    aclshmemx_udma_put_nbi(dst[:size], src[:size], size, 1)
                aclshmemx_udma_quiet(1)
                row.append(k * size / (time.perf_counter() - t) / 1e9)
            out["bw"][size] = row
        rows = dst[:rate_n * 64].reshape(rate_n, 64)
        srows = src[:rate_n * 64].reshape(rate_n, 64)
        for _ in range(samples):
            t = time.perf_counter()
            for i in range(rate_n):
                aclshmemx_udma_put_nbi(rows[i], srows[i], 64, 1)
                if i % 1024 == 1023:
                    aclshmemx_udma_quiet(1)
            aclshmemx_udma_quiet(1)
            out["rate"].append(rate_n / (time.perf_counter() - t))
    aclshmem_barrier_all()
    peer = 1 - me
    seq = 0
    for s in range(samples):
        aclshmem_barrier_all()
        t = time.perf_counter()
        for _ in range(pings):
            seq += 1
            if me == 0:
                aclshmemx_udma_put_signal_nbi(dst[:8], src[:8], 8, sig[0:1], seq, peer)
                aclshmem_signal_wait_until(sig[1:2], ACLSHMEM_CMP_EQ, seq)
            else:
                aclshmem_signal_wait_until(sig[0:1], ACLSHMEM_CMP_EQ, seq)
                aclshmemx_udma_put_signal_nbi(dst[:8], src[:8], 8, sig[1:2], seq, peer)
        if me == 0:
            out["pingpong_us"].append((time.perf_counter() - t) / pings / 2 * 1e6)
        aclshmemx_udma_quiet(peer)
    aclshmem_barrier_all()
    return out if me == 0 else None


def mpi_body(sizes, samples: int, rate_n: int, pings: int) -> dict:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    me = comm.Get_rank()
    top = max(max(sizes), 64 * rate_n)
    mem = np.zeros(top, np.uint8)
    src = np.full(top, 7, np.uint8)
    win = MPI.Win.Create(mem, comm=comm)
    out = {"bw": {}, "rate": [], "pingpong_us": []}
    win.Lock_all()
    comm.Barrier()
    if me == 0:
        win.Put([src, top, MPI.BYTE], 1)
        win.Flush(1)
        for size in sizes:
            k = _reps(size)
            row = []
            for _ in range(samples):
                t = time.perf_counter()
                for _ in range(k):
                    win.Put([src[:size], size, MPI.BYTE], 1)
                win.Flush(1)
                row.append(k * size / (time.perf_counter() - t) / 1e9)
            out["bw"][size] = row
        for _ in range(samples):
            t = time.perf_counter()
            for i in range(rate_n):
                win.Put([src[64 * i:64 * i + 64], 64, MPI.BYTE], 1, target=(64 * i, 64, MPI.BYTE))
                if i % 1024 == 1023:
                    win.Flush(1)
            win.Flush(1)
            out["rate"].append(rate_n / (time.perf_counter() - t))
    comm.Barrier()
    win.Unlock_all()
    buf = np.zeros(8, np.uint8)
    peer = 1 - me
    for _ in range(samples):
        comm.Barrier()
        t = time.perf_counter()
        for _ in range(pings):
            if me == 0:
                comm.Send([buf, 8, MPI.BYTE], peer, 0)
                comm.Recv([buf, 8, MPI.BYTE], peer, 0)
            else:
                comm.Recv([buf, 8, MPI.BYTE], peer, 0)
                comm.Send([buf, 8, MPI.BYTE], peer, 0)
        if me == 0:
            out["pingpong_us"].append((time.perf_counter() - t) / pings / 2 * 1e6)
    win.Free()
    return out if me == 0 else None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--engine", choices=["shmemx", "mpi"], required=True)
    p.add_argument("--sizes", required=True)
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--rate-n", type=int, default=8192)
    p.add_argument("--pings", type=int, default=200)
    a = p.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    body = shmemx_body if a.engine == "shmemx" else mpi_body
    out = body(sizes, a.samples, a.rate_n, a.pings)
    if out is not None:
        print("BENCH " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
