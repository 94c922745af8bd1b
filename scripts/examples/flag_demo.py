"""A flag before its payload, for ``--check`` to find (see the README's "Finding protocol bugs"):

    shmemx run -n 2 --check scripts/examples/flag_demo.py            # the bug: one finding, exit status 3
    shmemx run -n 2 --check scripts/examples/flag_demo.py --fixed    # the fix: no findings

PE 0 puts a row into PE 1's inbox on QP 1 and raises PE 1's flag with ``aclshmemx_signal_op``; PE 1 waits for
the flag and sums the row. The bug: the quiet before the flag is ``aclshmemx_udma_quiet(1)``, which covers QP 0
only, so the flag can land before the row. On this machine the engine is usually fast enough for the row to be
there anyway, so the kernel passes; ``--check`` reports it on every run. ``--fixed`` quiets QP 1.
"""

import sys

import numpy as np

import shmemx

fixed = "--fixed" in sys.argv[1:]
shmemx.aclshmemx_set_qp_num(shmemx.ACLSHMEM_DATA_OP_UDMA, 2)
shmemx.init()
me = shmemx.my_pe()
inbox = shmemx.zeros(1024, np.float32, name="inbox")
flag = shmemx.zeros(1, np.uint64, name="flag")
if me == 0:
    row = np.arange(1024, dtype=np.float32)
    shmemx.aclshmemx_udma_qp_put_nbi(inbox, row, 1024, 1, 1)          # the payload, on QP 1
    if fixed:
        shmemx.aclshmemx_udma_qp_quiet(1, 1)                          # completes QP 1
    else:
        shmemx.aclshmemx_udma_quiet(1)                                # the bug: completes QP 0 only
    shmemx.aclshmemx_signal_op(flag, 1, shmemx.ACLSHMEM_SIGNAL_SET, 1)
    shmemx.aclshmemx_udma_qp_quiet(1, 1)
elif me == 1:
    shmemx.aclshmem_signal_wait_until(flag, shmemx.ACLSHMEM_CMP_EQ, 1)
    print(f"sum {inbox.sum():.0f} (want {1023 * 1024 // 2})")
shmemx.aclshmem_barrier_all()
shmemx.finalize()
