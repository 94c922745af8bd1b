"""The counters of a job, for ``--stats`` (see the README, "Inspecting a job"):

    shmemx run -n 3 --stats scripts/examples/counters.py

Every PE runs a kernel of 2 AIV blocks; block b owns QP b and, inside a region, posts 100 puts of 25 bytes to each
other PE on it and counts them in the user counter "puts", then quiets. The main thread then sends each peer a
500-byte put_signal on QP 0 and waits for its own two signals. Each PE checks what it received and prints PASS.
"""

import numpy as np

import shmemx

PUTS, ROW = 100, 25

shmemx.aclshmemx_set_qp_num(shmemx.ACLSHMEM_DATA_OP_UDMA, 2)
shmemx.init()
me, n = shmemx.my_pe(), shmemx.n_pes()
peers = [p for p in range(n) if p != me]
inbox = shmemx.zeros((n, 2, ROW), np.uint8, name="inbox")   # [source, block, byte]
tail = shmemx.zeros((n, 500), np.uint8, name="tail")       # [source, byte]
signals = shmemx.zeros(n, np.uint64, name="signals")
rows = np.full((2, ROW), me, np.uint8)


def kernel():
    b = shmemx.get_block_idx()
    with shmemx.region("puts"):
        for p in peers:
            for _ in range(PUTS):
                shmemx.aclshmemx_udma_qp_put_nbi(inbox[me, b], rows[b], ROW, p, b)
            shmemx.count("puts", PUTS)
        for p in peers:
            shmemx.aclshmemx_udma_qp_quiet(p, b)


shmemx.launch(kernel, 2)
for p in peers:
    shmemx.aclshmemx_udma_put_signal_nbi(tail[me], np.full(500, me, np.uint8), 500, signals[me:me + 1], 1, p)
for p in peers:
    shmemx.aclshmemx_udma_quiet(p)
shmemx.aclshmem_wait_until_all(signals, shmemx.ACLSHMEM_CMP_EQ, 1, status=(np.arange(n) == me).astype(np.int32))
shmemx.aclshmem_barrier_all()
ok = all((inbox[p] == p).all() and (tail[p] == p).all() for p in peers)
print(f"{'PASS' if ok else 'FAIL'}: pe {me} got {2 * PUTS} puts and a put_signal from each of {len(peers)} peers")
shmemx.finalize()
raise SystemExit(0 if ok else 1)
