"""UDMA allgather (CANN SHMEM's ``udma_demo``, mode 0): every PE puts its block to every other PE over UDMA.

    shmemx run -n 8 scripts/examples/udma_allgather.py

Each PE holds 16 int32 equal to ``10 + pe`` in block ``pe`` of a symmetric buffer and, from one AIV block,
``aclshmemx_udma_put_nbi``-s those 64 bytes to the same offset on every other PE, quiets each peer
(``aclshmemx_udma_quiet``: QP 0 of that PE), and meets the other PEs in ``aclshmemx_barrier_all_vec``. Then every
block i of every PE must hold ``10 + i``. Prints PASS or FAIL per PE; exits 1 if any block is wrong.
"""

import numpy as np

import shmemx

ELEMS = 16  # int32 per block: 64 bytes, one WQE each

shmemx.init()
me, n = shmemx.my_pe(), shmemx.n_pes()
gva = shmemx.zeros(n * ELEMS, np.int32, name="gva")
gva[me * ELEMS:(me + 1) * ELEMS] = 10 + me
shmemx.aclshmem_barrier_all()  # every PE's own block is written before anyone reads it


def kernel():
    mine = gva[me * ELEMS:(me + 1) * ELEMS].view(np.uint8)  # moved as 64 bytes, as the CANN demo does
    ub = shmemx.get_ub(128)
    for pe in range(n):
        if pe != me:
            shmemx.aclshmemx_udma_put_nbi(mine, mine, mine.size, pe, buf=ub, sync_id=0)
            shmemx.aclshmemx_udma_quiet(pe)
    shmemx.aclshmemx_barrier_all_vec()


shmemx.launch(kernel, 1)
bad = [i for i in range(n) if not (gva[i * ELEMS:(i + 1) * ELEMS] == 10 + i).all()]
if bad:
    print(f"FAIL: pe {me}: blocks {bad} wrong: {gva.reshape(n, ELEMS)[bad, :4].tolist()} (want 10 + block)")
else:
    print(f"PASS: pe {me}: all {n} blocks hold 10 + block")
shmemx.finalize()
raise SystemExit(1 if bad else 0)
