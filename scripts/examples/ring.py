# ring.py: every PE puts a row into the next PE's inbox and signals it. Run: shmemx run -n 4 scripts/examples/ring.py
import numpy as np

import shmemx

shmemx.init()
me, n = shmemx.my_pe(), shmemx.n_pes()
assert n >= 2, "run it on 2 PEs or more: UDMA to the own PE is an error"
inbox = shmemx.zeros(256, np.float32, name="inbox")      # symmetric: the same offset on every PE
flag = shmemx.zeros(1, np.uint64, name="flag")
row = np.full(256, me, np.float32)                        # a local array: registered for the put's life

nxt, prv = (me + 1) % n, (me - 1) % n
shmemx.aclshmemx_udma_put_signal_nbi(inbox, row, 256, flag, 1, nxt)   # one WRITE_WITH_NOTIFY WQE
shmemx.aclshmemx_udma_quiet(nxt)                                        # polls the CQ of (nxt, QP 0)
shmemx.aclshmem_signal_wait_until(flag, shmemx.ACLSHMEM_CMP_EQ, 1)     # sleeps (futex), never spins a core
ok = bool((inbox == prv).all())
print(f"{'PASS' if ok else 'FAIL'}: pe {me} holds pe {prv}'s row")
shmemx.finalize()
raise SystemExit(0 if ok else 1)
