"""UDMA allgather with put_signal (CANN SHMEM's ``udma_demo``, mode 1).

    shmemx run -n 8 scripts/examples/udma_put_signal.py

As ``udma_allgather.py``, but every block travels in one ``aclshmemx_udma_put_signal_nbi``: a
WRITE_WITH_NOTIFY WQE that writes the 64-byte payload, then sets the sender's 64-bit signal word (``sig[me]`` on
the receiver) to 1000. Every PE checks that block i holds ``10 + i`` and that the signal word of every other PE
is 1000 (its own stays 0). Prints PASS or FAIL per PE; exits 1 on any difference.
"""

import numpy as np

import shmemx

ELEMS = 16
SIGNAL = 1000

shmemx.init()
me, n = shmemx.my_pe(), shmemx.n_pes()
gva = shmemx.zeros(n * ELEMS, np.int32, name="gva")
sig = shmemx.zeros(n, np.uint64, name="sig")  # 8 bytes per sender: sig_addr + 8 * pe
gva[me * ELEMS:(me + 1) * ELEMS] = 10 + me
shmemx.aclshmem_barrier_all()


def kernel():
    mine = gva[me * ELEMS:(me + 1) * ELEMS].view(np.uint8)
    ub = shmemx.get_ub(128)
    for pe in range(n):
        if pe != me:
            shmemx.aclshmemx_udma_put_signal_nbi(mine, mine, mine.size, sig[me:me + 1], SIGNAL, pe, buf=ub)
            shmemx.aclshmemx_udma_quiet(pe)
    shmemx.aclshmemx_barrier_all_vec()


shmemx.launch(kernel, 1)
bad_blocks = [i for i in range(n) if not (gva[i * ELEMS:(i + 1) * ELEMS] == 10 + i).all()]
want_sig = np.where(np.arange(n) == me, 0, SIGNAL)
bad_sigs = [j for j in range(n) if sig[j] != want_sig[j]]
if bad_blocks or bad_sigs:
    print(f"FAIL: pe {me}: wrong blocks {bad_blocks}, wrong signal words {bad_sigs}: {sig.tolist()}")
else:
    print(f"PASS: pe {me}: all {n} blocks hold 10 + block, every other PE's signal word is {SIGNAL}")
shmemx.finalize()
raise SystemExit(1 if bad_blocks or bad_sigs else 0)
