"""Across hosts: `shmemx ps` while the job runs, then `--stats` after it. Every PE puts to a PE of the other host
(a known number of WQEs and bytes); pe 0 waits for the file named by argv[1] (the test's, once it has run
`shmemx ps`) before the puts. Run by tests/test_hosts.py as ``shmemx run -n 4 --hosts 2 --stats``."""

import os
import sys
import time

import numpy as np

import shmemx
from shmemx import *

shmemx.init(heap_size="16M")
me, n = aclshmem_my_pe(), aclshmem_n_pes()
far = (me + n // 2) % n
dst = shmemx.zeros(1024, np.int64)
src = np.arange(1024, dtype=np.int64) + me
aclshmem_barrier_all()
print(f"pe {me}: ready", flush=True)
if me == 0:
    deadline = time.monotonic() + 60
    while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
        time.sleep(0.05)
aclshmem_barrier_all()
for k in range(7):  # 7 WQEs of 8 KiB each to the far PE
    aclshmemx_udma_put_nbi(dst, src, 1024, far)
aclshmemx_udma_quiet(far)
aclshmem_barrier_all()
assert (dst == np.arange(1024) + far).all()
print(f"pe {me}: ps stats ok", flush=True)
