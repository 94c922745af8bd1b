"""A first UDMA kernel: every PE sends a row to the next PE with put_signal, on one AIV block per QP.

    shmemx run -n 8 scripts/examples/udma_hello.py

Each PE puts a 1 KiB row that encodes its origin into the next PE's ``inbox`` with one WRITE_WITH_NOTIFY per QP
(the payload, then the 64-bit signal, then the CQE), waits for the row from the previous PE, checks it byte for
byte and prints the first WQE it posted, decoded field by field, as ``shmemx dump`` would show it.
"""

import numpy as np

import shmemx
from shmemx.layout import decode_wqe
from shmemx.udma.describe import format_wqe

QPS = 2
ROW = 1024

shmemx.aclshmemx_set_qp_num(shmemx.ACLSHMEM_DATA_OP_UDMA, QPS)
shmemx.init()
me, n = shmemx.my_pe(), shmemx.n_pes()
nxt, prv = (me + 1) % n, (me - 1) % n

inbox = shmemx.zeros((QPS, ROW), np.uint8, name="inbox")
signals = shmemx.zeros(QPS, np.uint64, name="signals")
row = ((np.arange(QPS * ROW) * 7 + me * 31) & 0xFF).astype(np.uint8).reshape(QPS, ROW)


def kernel():
    qp = shmemx.get_block_idx()  # one submitter per (peer, qp): block b owns QP b
    if n > 1:
        shmemx.aclshmemx_udma_qp_put_signal_nbi(inbox[qp], row[qp], ROW, signals[qp:qp + 1], (me << 8) | qp + 1,
                                                nxt, qp)
        shmemx.aclshmemx_udma_qp_quiet(nxt, qp)
        shmemx.aclshmem_signal_wait_until(signals[qp:qp + 1], shmemx.ACLSHMEM_CMP_EQ, (prv << 8) | qp + 1)


shmemx.launch(kernel, QPS)
expected = ((np.arange(QPS * ROW) * 7 + prv * 31) & 0xFF).astype(np.uint8).reshape(QPS, ROW)
ok = n == 1 or bool((inbox == expected).all())
if n > 1:
    q = shmemx.aclshmemx_udma_raw_queue(nxt, 0)
    wqe = decode_wqe(q.sq[0].tobytes() + q.sq[1].tobytes())
    print(f"{'PASS' if ok else 'FAIL'}: row from pe {prv} arrived on {QPS} QPs; my first WQE to pe {nxt}:")
    print("   ", format_wqe(wqe, q.describe_va))
shmemx.aclshmem_barrier_all()
raise SystemExit(0 if ok else 1)
