"""DeepEP-style MoE dispatch and combine on the emulated UDMA engine, checked against a plain-numpy reference.

    shmemx run -n 8 scripts/examples/moe_demo.py [--tokens 128] [--hidden 1024] [--policy two_3_1]

Every rank routes its tokens to the top-8 of 64 experts (8 per rank), dispatches them (notify, then one AIV
block per channel posting raw WQEs on two QPs, 3:1 by channel, a fenced completion signal per (rank, QP)),
checks that every received row, top-k index and weight is exactly what the reference says it must receive,
combines the rows back and checks the sums. Prints PASS/FAIL per rank and a short summary on rank 0: tokens sent
and received, WQEs and bytes per QP, and the times of each phase. Exit status 1 on any mismatch.
"""

import argparse
import sys

import numpy as np

import shmemx
from shmemx.kernels import moe
from shmemx.kernels.moe import reference as ref

ap = argparse.ArgumentParser()
ap.add_argument("--tokens", type=int, default=128)
ap.add_argument("--hidden", type=int, default=1024)
ap.add_argument("--topk", type=int, default=8)
ap.add_argument("--experts", type=int, default=64)
ap.add_argument("--policy", default="two_3_1", choices=moe.QP_POLICIES)
ap.add_argument("--channels", type=int, default=None, help="AIV blocks per kernel (default: the Buffer's)")
ap.add_argument("--lanes", default=None, choices=("batch", "rounds"), help="shared lanes (default: the Buffer's)")
args = ap.parse_args()
T, H, K, E = args.tokens, args.hidden, args.topk, args.experts

shmemx.aclshmemx_set_qp_num(shmemx.ACLSHMEM_DATA_OP_UDMA, moe.POLICY_QPS[args.policy])
shmemx.init()
me, n = shmemx.my_pe(), shmemx.n_pes()
E = max(E // n, 1) * n  # a multiple of the number of ranks


def routing(rank):
    """Rank ``rank``'s routing: top-k experts of random scores ``[T, K] int64`` and weights ``[T, K] float32``."""
    rng = np.random.default_rng(rank)
    topk = np.argsort(rng.random((T, E)), axis=1)[:, :min(K, E)].astype(np.int64)
    return topk, rng.random(topk.shape, np.float32)


class EveryRanksRows:
    """Every rank's tokens ``[T, H] bfloat16`` (rows that encode (rank, token)) as the reference reads them: rank
    r's made when it asks for them, so that a rank holds one other rank's rows at a time, not all n ranks'
    (64 MiB each at 256 ranks)."""

    def __len__(self):
        return n

    def __getitem__(self, rank):
        return ref.origin_x(rank, T, H)


routings = [routing(r) for r in range(n)]  # every rank can compute every rank's inputs: the reference needs them
x = ref.origin_x(me, T, H)
topk, weights = routings[me]
opts = {k: v for k, v in (("num_channels", args.channels), ("shared_lanes", args.lanes)) if v is not None}
buf = moe.Buffer(T, H, topk.shape[1], E, qp_policy=args.policy, **opts)

layout = buf.get_dispatch_layout(topk)
with shmemx.region("dispatch"):  # regions: what a trace and a replay (shmemx run --record) time
    got = buf.dispatch(x, topk_idx=topk, topk_weights=weights, num_tokens_per_rank=layout.num_tokens_per_rank,
                       is_token_in_rank=layout.is_token_in_rank, num_tokens_per_expert=layout.num_tokens_per_expert)
d_stats = buf.last_stats
with shmemx.region("combine"):
    back = buf.combine(got.recv_x, got.handle, got.recv_topk_weights)
c_stats = buf.last_stats

want = ref.reference_dispatch(EveryRanksRows(), [r[0] for r in routings], [r[1] for r in routings], E, me)
checks = {
    "rows": np.array_equal(got.recv_x.view(np.uint16), want.recv_x.view(np.uint16)),
    "topk": np.array_equal(got.recv_topk_idx, want.recv_topk_idx)
    and np.array_equal(got.recv_topk_weights, want.recv_topk_weights),
    "counts": got.num_recv_tokens_per_expert_list == want.num_recv_tokens_per_expert_list,
}
went = layout.is_token_in_rank.sum(1)
sent = went > 0
diff = ref.calc_diff(back.combined_x[sent].astype(np.float64) / went[sent, None], x[sent].astype(np.float64))
checks["combine"] = diff < 5e-6 and np.array_equal(back.combined_topk_weights, weights)
ok = all(checks.values())
print(f"{'PASS' if ok else 'FAIL'}: sent {d_stats.sent_rows + d_stats.local_rows} rows "
      f"({d_stats.local_rows} to itself), received {len(got.recv_x)} from {n} ranks; combine calc_diff {diff:.1e}"
      + ("" if ok else f"; failed: {[k for k, v in checks.items() if not v]}"))

# a summary on rank 0: every rank's counters through the heap
vec = np.concatenate([d_stats.vector(4), c_stats.vector(4)])
table = shmemx.zeros((n, len(vec)), np.float64, name="demo summary")
table[me] = vec
shmemx.aclshmem_barrier_all()
if me == 0:
    rows = np.empty_like(table)  # (a get, not aclshmem_ptr: a job over several hosts maps no other host's heap)
    for p in range(n):
        shmemx.aclshmem_getmem(rows[p], table[p], rows[p].nbytes, p)
    half = len(vec) // 2
    print(f"\nDeepEP-style dispatch + combine, {n} ranks, T={T} H={H} K={topk.shape[1]} E={E}, "
          f"schedule [{buf.schedule}], {buf.num_channels} channels")
    for label, k in (("dispatch", 0), ("combine", 1)):
        per_pe = [moe.CallStats.unpack(r[k * half:(k + 1) * half], 4) for r in rows]
        q = buf.schedule.num_qps
        wqes = sum(s["qp_wqes"] for s in per_pe)[:q]
        mb = sum(s["qp_bytes"] for s in per_pe)[:q] / 1e6
        wall = [s["wall"] * 1e3 for s in per_pe]
        print(f"  {label:<8}: {int(sum(s['recv_rows'] for s in per_pe))} rows received in all; per QP "
              + ", ".join(f"qp{i} {int(w)} WQEs {m:.2f} MB" for i, (w, m) in enumerate(zip(wqes, mb)))
              + f"; {np.mean(wall):.1f} ms mean, {max(wall):.1f} ms slowest rank")
    print("  " + d_stats.summary().replace("; ", "\n    "))
shmemx.aclshmem_barrier_all()
buf.close()
shmemx.finalize()
sys.exit(0 if ok else 1)
