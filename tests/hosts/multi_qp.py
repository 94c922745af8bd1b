"""Across hosts: 4 QPs, one per AIV block of a launch, defer/submit batches, SO put_signal, waits (run by
tests/test_hosts.py as shmemx run -n N --hosts 2)."""
import numpy as np, shmemx
from shmemx import *
aclshmemx_set_qp_num(ACLSHMEM_DATA_OP_UDMA, 4)
shmemx.init(heap_size="32M")
me, n = aclshmem_my_pe(), aclshmem_n_pes()
far = (me + n // 2) % n
B = 4
rows = shmemx.zeros((n, B, 64), np.int64)
src = shmemx.zeros((B, 64), np.int64)
src[:] = me * 1000 + np.arange(B)[:, None]
sig = shmemx.zeros((n,), np.uint64)
aclshmem_barrier_all()

def kernel():
    b = get_block_idx()
    aclshmemx_udma_qp_put_nbi(rows[me, b], src[b], 64, far, b)  # one QP per block
    aclshmemx_udma_qp_quiet(far, b)
    aclshmemx_barrier_all_vec()

shmemx.launch(kernel, B)
for p in range(n):
    if p == (me - n // 2) % n:
        assert (rows[p] == p * 1000 + np.arange(B)[:, None]).all(), rows[p, :, 0]
# defer / submit batch over QP 1
st = aclshmemx_submit_state_t()
got = shmemx.zeros((8, 64), np.int64)
for i in range(7):
    aclshmemx_udma_qp_put_nbi(got[i], src[i % B], 64, far, 1, batch=aclshmemx_defer_t(st))
aclshmemx_udma_qp_put_nbi(got[7], src[0], 64, far, 1, batch=aclshmemx_submit_t(st))
aclshmemx_udma_qp_quiet(far, 1)
aclshmem_barrier_all()
assert (got[:7, 0] == ((far * 1000) + np.arange(7) % B)).all(), got[:, 0]
# SO config put_signal on qp 2, and a fence WQE ordering
aclshmemx_udma_qp_put_signal_nbi(rows[me, 0], src[0], 64, sig[me:me + 1], 9, far, 2, config=ACLSHMEMX_UDMA_OP_CONFIG_SO)
aclshmemx_udma_qp_quiet(far, 2)
aclshmem_signal_wait_until(sig[far:far + 1], ACLSHMEM_CMP_EQ, 9)
aclshmem_wait_until_all(sig[far:far + 1], ACLSHMEM_CMP_GE, 9)
aclshmem_sync_all()
aclshmem_barrier_all()
print(f"pe {me}: multi ok", flush=True)
