"""A small kernel to read a replay by (see the README, "Modelled time"): a 4-PE all-to-all of 64 KiB put_signals,
quiets, a wait_until_all, 3 us of compute and a barrier.

    shmemx run -n 4 --record a2a.rec scripts/examples/replay_alltoall.py && shmemx replay a2a.rec
"""

import numpy as np

import shmemx

shmemx.init()
me, n = shmemx.my_pe(), shmemx.n_pes()
buf = shmemx.zeros((n, 65536), np.uint8, name="buf")
sig = shmemx.zeros(n, np.uint64, name="sig")
src = np.full(65536, me, np.uint8)
with shmemx.region("a2a"):
    for p in range(n):
        if p != me:
            shmemx.aclshmemx_udma_put_signal_nbi(buf[me], src, 65536, sig[me:me + 1], 1, p)
    for p in range(n):
        if p != me:
            shmemx.aclshmemx_udma_quiet(p)
    shmemx.aclshmem_wait_until_all(sig, shmemx.ACLSHMEM_CMP_GE, 1, status=(np.arange(n) == me).astype(np.int32))
shmemx.compute(us=3.0, name="ffn")
ok = all((buf[p] == p).all() for p in range(n) if p != me)
print(f"{'PASS' if ok else 'FAIL'}: pe {me} holds every peer's row")
shmemx.aclshmem_barrier_all()
shmemx.finalize()
raise SystemExit(0 if ok else 1)
