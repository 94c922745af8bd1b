"""CAM window-mode MoE: one moe_dispatch_normal + moe_combine_normal on every rank, checked against the reference.

    shmemx run -n 8 --heap-size 440M scripts/examples/cam_moe_demo.py

Each rank builds the HCCL-style window context (an In window of NEEDED_HCCL_BUFFSIZE MB and a 1 MB Exp window on
the symmetric heap, never pre-faulted), exchanges its per-expert counts (notify), dispatches its tokens (rows that
encode their origin: rank, token), runs a toy expert that depends on the topk slot, combines with the top-k
weights, and compares everything with ``shmemx.kernels.cam.reference`` computed from every rank's inputs.
"""

import ml_dtypes
import numpy as np

import shmemx
from shmemx.kernels import cam

BS, H, K, E_LOC = 8, 1024, 4, 2  # tokens per rank, hidden, top-k, experts per rank


def inputs(rank: int, n: int):
    rng = np.random.default_rng(rank)
    x = rng.standard_normal((BS, H), np.float32).astype(ml_dtypes.bfloat16)
    x[:, 0], x[:, 1] = rank, np.arange(BS)  # origin in the row
    topk = np.stack([rng.choice(E_LOC * n, K, replace=False) for _ in range(BS)]).astype(np.int32)
    return x, topk, rng.random((BS, K), np.float32)


def expert(rows, assist):
    slot = assist.reshape(-1, 3)[:, 2].astype(np.float32)
    return (rows.astype(np.float32) * 2 + slot[:, None]).astype(rows.dtype)


shmemx.init()
me, n = shmemx.my_pe(), shmemx.n_pes()
E = E_LOC * n
every = [inputs(r, n) for r in range(n)]
x, topk, w = every[me]
with cam.WindowContext(hccl_buffsize=cam.needed_mb(BS, K, H), aiv_num=3) as ctx:
    route = cam.notify_dispatch(ctx, topk, E)
    d = cam.moe_dispatch_normal(ctx, x, topk, *route, moe_expert_num=E, global_bs=BS * n, diagnose=True)
    y = expert(d.recv_x, d.assist_info_for_combine)
    c = cam.moe_combine_normal(ctx, y, d.assist_info_for_combine, d.ep_recv_counts, w, moe_expert_num=E,
                               global_bs=BS * n, diagnose=True)

ref = cam.reference.reference_dispatch([e[0] for e in every], [e[1] for e in every], E)
want = cam.reference.reference_combine([expert(r["recv_x"], r["assist_info_for_combine"]) for r in ref],
                                       [r["assist_info_for_combine"] for r in ref], [e[2] for e in every])[me]
ok = (d.recv_x.tobytes() == ref[me]["recv_x"].tobytes()
      and np.array_equal(d.assist_info_for_combine, ref[me]["assist_info_for_combine"])
      and np.array_equal(d.recv_counts, ref[me]["recv_counts"]) and c.x.tobytes() == want.tobytes())
print(f"{'PASS' if ok else 'FAIL'}: pe {me} received {len(d.recv_x)} rows (per local expert "
      f"{d.expert_token_nums.tolist()}) in half {d.data_state}, wrote {d.flags_written} dispatch and "
      f"{c.flags_written} combine flags; wait cost by source rank {d.wait_recv_cost_stats.tolist()} us, send cost "
      f"by owner {c.send_cost_stats.tolist()} us")
shmemx.aclshmem_barrier_all()
raise SystemExit(0 if ok else 1)
