"""A kernel with a protocol bug, to see what shmemx says about a hang:

    shmemx run -n 4 --timeout 3 scripts/examples/hang_demo.py

Every PE sends a row to the next PE with put_signal and waits for the row from the previous one, with signal
value 1. PE 2 has a bug: it signals 2. PE 3 waits forever; the launcher stops the job at --timeout, prints who
waits on what ("pe 3 waits in signal_wait_until on 'flags'+0x10 == 1, current value 2") and writes the full
dump to ./shmemx-dump-<job>.json (``shmemx dump --file`` reads it).
"""

import numpy as np

import shmemx

shmemx.init()
me, n = shmemx.my_pe(), shmemx.n_pes()
nxt, prv = (me + 1) % n, (me - 1) % n
inbox = shmemx.zeros((n, 256), np.uint8, name="inbox")
flags = shmemx.zeros(n, np.uint64, name="flags")
row = np.full(256, me, np.uint8)

signal = 2 if me == 2 else 1  # the bug
with shmemx.region("send"):
    shmemx.aclshmemx_udma_put_signal_nbi(inbox[me], row, 256, flags[me:me + 1], signal, nxt)
    shmemx.aclshmemx_udma_quiet(nxt)
with shmemx.region("receive"):
    shmemx.aclshmem_signal_wait_until(flags[prv:prv + 1], shmemx.ACLSHMEM_CMP_EQ, 1)
assert (inbox[prv] == prv).all()
shmemx.aclshmem_barrier_all()
print("PASS")
