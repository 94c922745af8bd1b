"""Across hosts: put / get / put_signal / atomics / signal_op / waits / barrier / sync_all / error CQEs / MTE.

Run by tests/test_hosts.py as ``shmemx run -n N --hosts 2``. Payloads encode (source pe, element)."""

import numpy as np

import shmemx
from shmemx import *
from shmemx.errors import CompletionError

shmemx.init(heap_size="32M")
me, n = aclshmem_my_pe(), aclshmem_n_pes()
half = n // 2
far = (me + half) % n  # a PE of the other host (PEs are split evenly, consecutive per host)
N = 1024


def pattern(pe, k=N):
    return pe * 1_000_000 + np.arange(k, dtype=np.int64)


dst = shmemx.zeros(N, np.int64)
got = shmemx.zeros(N, np.int64)
src = shmemx.zeros(N, np.int64)
src[:] = pattern(me)
sig = shmemx.zeros(4, np.uint64)
ctr = shmemx.zeros(4, np.int64)
word32 = shmemx.zeros(4, np.int32)
aclshmem_barrier_all()

# put + quiet, then a barrier: the far PE sees it
aclshmemx_udma_put_nbi(dst, src, N, far)
aclshmemx_udma_quiet(far)
aclshmem_barrier_all()
assert (dst == pattern(far)).all(), f"pe {me}: put from pe {far} wrong: {dst[:4]}"

# get from the far PE into the heap and into a private array (the NIC writes the process's memory)
aclshmemx_udma_get_nbi(got, src, N, far)
private = np.zeros(N, np.int64)
aclshmemx_udma_get_nbi(private, src, N, far)
aclshmemx_udma_quiet(far)
assert (got == pattern(far)).all() and (private == pattern(far)).all(), f"pe {me}: get wrong"

# put from a private array, multi-QP, put_signal: payload before signal
priv_src = pattern(me) + 7
aclshmem_barrier_all()
aclshmemx_udma_put_signal_nbi(dst, priv_src, N, sig[0:1], me + 1, far)
aclshmemx_udma_quiet(far)
v = aclshmem_signal_wait_until(sig[0:1], ACLSHMEM_CMP_EQ, far + 1)
assert (dst == pattern(far) + 7).all(), f"pe {me}: put_signal payload wrong after its signal"

# atomics: every PE of the other host adds to pe 0's counter (and of this host to pe n-1's); fetch_add, CAS
aclshmem_barrier_all()
first_host = me < half
aclshmemx_udma_atomic_add(ctr[0:1], 1, n - 1 if first_host else 0)
aclshmemx_udma_quiet(n - 1 if first_host else 0)
old = aclshmemx_udma_atomic_fetch_add(ctr[1:2], 10, n - 1 if first_host else 0)
assert old % 10 == 0 and 0 <= old < 10 * half, old
aclshmem_barrier_all()
if me in (0, n - 1):
    assert ctr[0] == half and ctr[1] == 10 * half, f"pe {me}: atomic totals {ctr[:2]}"
olds = shmemx.zeros(n, np.int64)
aclshmem_barrier_all()
won = aclshmemx_udma_atomic_compare_swap(ctr[2:3], 0, me + 1, far)
assert won in (0,) or won >= 1
v = aclshmemx_udma_atomic_fetch(ctr[2:3], far)
assert v >= 1
aclshmemx_udma_atomic_set(word32[0:1], 5 + me, far)
aclshmem_barrier_all()
assert word32[0] == 5 + far, f"pe {me}: atomic_set from pe {far}: {word32[0]}"

# signal_op across hosts (SET and ADD) and the waits on them
aclshmem_barrier_all()
aclshmemx_signal_op(sig[1:2], 100 + me, ACLSHMEM_SIGNAL_SET, far)
aclshmemx_signal_op(sig[2:3], 3, ACLSHMEM_SIGNAL_ADD, far)
aclshmem_signal_wait_until(sig[1:2], ACLSHMEM_CMP_EQ, 100 + far)
aclshmem_wait_until(sig[2:3], ACLSHMEM_CMP_GE, 3)
aclshmem_sync_all()

# an error CQE from another host: a bad token
# large payloads (sent apart by the NIC, from and into the heap): put, put_signal, get, and a private array
BIG = 1 << 18  # int64 elements: 2 MiB
bsrc = shmemx.zeros(BIG, np.int64)
bdst = shmemx.zeros(BIG, np.int64)
bsrc[:] = pattern(me, BIG)
aclshmem_barrier_all()
aclshmemx_udma_put_signal_nbi(bdst, bsrc, BIG, sig[3:4], 1, far)
aclshmemx_udma_quiet(far)
aclshmem_signal_wait_until(sig[3:4], ACLSHMEM_CMP_EQ, 1)
assert (bdst == pattern(far, BIG)).all(), f"pe {me}: large put_signal wrong"
bpriv = np.zeros(BIG, np.int64)
aclshmemx_udma_get_nbi(bpriv, bsrc, BIG, far)
aclshmemx_udma_quiet(far)
assert (bpriv == pattern(far, BIG)).all(), f"pe {me}: large get into a private array wrong"
aclshmem_barrier_all()

# an error CQE from another host's check (a wrong token value): nothing written, the detail names the segment;
# the queue runs again once the quiet reported it
from shmemx.layout import Opcode, pack_wqe
from shmemx.udma.layout import C_STATUS, C_USER_DATA
q = aclshmemx_udma_raw_queue(far, 0)
rmi = q.remote_mem_info
eid_lo, eid_hi = (int(x) for x in rmi["eid"])
dst[:] = -1
aclshmem_barrier_all()
good = dict(opcode=Opcode.WRITE, flag=0x20, tp_id=int(rmi["tpn"]), rmt_seg_id=int(rmi["tid"]),
            rmt_eid=eid_hi << 64 | eid_lo, rmt_token_value=int(rmi["rmt_token_value"]) ^ 0x8000_0000,
            rmt_va=q.remote_va(dst[:8]), sge_len=64, sge_va=q.local_va(src[:8]))
head = q.reserve(1)
q.ring_doorbell(q.write(head, pack_wqe(**good)), cqes=1)
try:
    aclshmemx_udma_quiet(far)
except CompletionError as exc:
    assert exc.cqe.status == 0x05 and "does not match segment tid" in str(exc), exc
else:
    raise AssertionError("a wrong token to another host completed")
aclshmemx_udma_put_nbi(dst[8:16], src[8:16], 8, far)
aclshmemx_udma_quiet(far)
aclshmem_barrier_all()
assert (dst[:8] == -1).all() and (dst[8:16] == pattern(far)[8:16]).all(), f"pe {me}: {dst[:16]}"

# a bad WQE inside a run of small WRITEs rung at once: the ones before it land, it fails, the rest are flushed
count, bad_at = 16, 5
rows_dst = shmemx.full((count, 8), -1, np.int64)
rows_src = shmemx.zeros((count, 8), np.int64)
rows_src[:] = pattern(me, count * 8).reshape(count, 8)
aclshmem_barrier_all()
built = q.build_writes(rmt_va=q.remote_va(rows_dst) + 64 * np.arange(count, dtype=np.uint64), sge_len=64,
                       sge_va=q.local_va(rows_src) + 64 * np.arange(count, dtype=np.uint64))
built[bad_at, 4] ^= 0x1  # the token value word
head = q.reserve(count)
q.ring_doorbell(q.write(head, built), cqes=count)
try:
    aclshmemx_udma_quiet(far)
except CompletionError as exc:
    assert exc.cqe.status == 0x05 and exc.cqe.user_data == head + bad_at, exc
else:
    raise AssertionError("a bad WQE inside a run completed")
cqes = q.cq.view(np.uint32).reshape(-1, 16)  # each CQE's user_data is its WQE's BB position
statuses = [int(cqes[np.flatnonzero(cqes[:, C_USER_DATA] == head + j)[-1], C_STATUS]) >> 24 for j in range(count)]
assert statuses == [0] * bad_at + [0x05] + [0x0A] * (count - bad_at - 1), statuses
aclshmem_barrier_all()
assert (rows_dst[:bad_at] == pattern(far, count * 8).reshape(count, 8)[:bad_at]).all() and \
    (rows_dst[bad_at:] == -1).all(), f"pe {me}: run rows {rows_dst[:, 0]}"
aclshmem_barrier_all()  # every PE checked its rows before any writes the last one again
aclshmemx_udma_put_nbi(rows_dst[-1], rows_src[-1], 8, far)  # the queue runs again
aclshmemx_udma_quiet(far)
aclshmem_barrier_all()

# MTE to another host is refused with a clear error
try:
    aclshmemx_mte_put_nbi(dst, src, 4, far)
except ValueError as exc:
    assert "another host" in str(exc), exc
else:
    raise AssertionError("MTE put to another host was not refused")
aclshmem_barrier_all()
print(f"pe {me}: hosts basics ok", flush=True)
