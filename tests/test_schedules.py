"""The topology-aware schedules (fullmesh, groups, hierarchy) x routing plans against the numpy reference.

Payloads encode their origin (``reference.origin_x``), so a misrouted row fails the exact comparison. Every rank
regenerates every rank's inputs from per-rank seeds (uniform or Zipf-skewed expert choice) and checks what it
received against ``reference.reference_dispatch`` and what came back against ``reference.reference_combine``:
dispatch exactly for every schedule, combine bit-exact for fullmesh and groups and within
``hierarchy.combine_bound`` for the hierarchy (weights exactly). The 128-PE runs are marked slow.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import shmemx
from shmemx.kernels import moe
from shmemx.kernels.moe import reference as ref
from shmemx.kernels.moe.hierarchy import arrived, combine_bound
from shmemx.kernels.moe.measure import in_degree
from shmemx.kernels.moe.topology import GroupMap, Topology

H, K = 64, 4


def topk_for(rank: int, n_tok: int, num_experts: int, skew: str) -> tuple[np.ndarray, np.ndarray]:
    """``([T, K] int64, [T, K] float32)``: distinct experts per token, uniform or Zipf(1.2)-weighted by expert."""
    rng = np.random.default_rng(500 + rank)
    if skew == "zipf":
        p = 1.0 / np.arange(1, num_experts + 1) ** 1.2
        p = p[rng.permutation(num_experts)] if False else p
        keys = rng.random((n_tok, num_experts)) ** (1.0 / (p / p.sum() * num_experts))
        idx = np.argsort(-keys, axis=1)[:, :K].astype(np.int64)
    else:
        idx = np.argsort(rng.random((n_tok, num_experts)), axis=1)[:, :K].astype(np.int64)
    idx[rng.random((n_tok, K)) < 0.1] = -1
    if n_tok > 3:
        idx[3] = -1  # a token routed nowhere
    return idx, (rng.random((n_tok, K)) + 0.5).astype(np.float32)


def _inputs(n: int, n_tok: int, num_experts: int, skew: str):
    out = []
    for r in range(n):
        idx, w = topk_for(r, n_tok, num_experts, skew)
        out.append((ref.origin_x(r, n_tok, H), idx, w))
    return out


def check_schedule(buf, allin, num_experts: int, exact_combine: bool) -> None:
    """Dispatch (fresh and cached) and combine of one schedule against the reference, on this PE."""
    me, n = shmemx.my_pe(), shmemx.n_pes()
    x, idx, w = allin[me]
    xs, idxs, ws = [a[0] for a in allin], [a[1] for a in allin], [a[2] for a in allin]
    want = ref.reference_dispatch(xs, idxs, ws, num_experts, me)
    res = buf.dispatch(x, topk_idx=idx, topk_weights=w)
    np.testing.assert_array_equal(res.recv_x.view(np.uint16), want.recv_x.view(np.uint16))
    np.testing.assert_array_equal(res.handle.recv_src_idx, want.recv_src_idx)
    np.testing.assert_array_equal(res.recv_topk_idx, want.recv_topk_idx)
    np.testing.assert_array_equal(res.recv_topk_weights, want.recv_topk_weights)
    assert res.num_recv_tokens_per_expert_list == want.num_recv_tokens_per_expert_list
    cached = buf.dispatch(x, handle=res.handle)
    np.testing.assert_array_equal(cached.recv_x.view(np.uint16), want.recv_x.view(np.uint16))
    # expert outputs: the received rows scaled by (receiver + 1), so every contributor differs
    expert_out = (res.recv_x.astype(np.float32) * (me + 1)).astype(ref.bf16)
    comb = buf.combine(expert_out, res.handle, res.recv_topk_weights)
    outs = []
    for r in range(n):
        d = ref.reference_dispatch(xs, idxs, ws, num_experts, r)
        outs.append(((d.recv_x.astype(np.float32) * (r + 1)).astype(ref.bf16), d.recv_topk_weights))
    want_x, want_w = ref.reference_combine([o[0] for o in outs], idxs, num_experts, me, [o[1] for o in outs])
    np.testing.assert_array_equal(comb.combined_topk_weights, want_w)
    if exact_combine:
        np.testing.assert_array_equal(comb.combined_x.view(np.uint16), want_x.view(np.uint16))
    else:
        mask = moe.get_dispatch_layout(idx, num_experts, n).is_token_in_rank
        abs_sum = np.zeros(x.shape, np.float64)
        f32_sum = np.zeros(x.shape, np.float64)
        for r in range(n):
            toks = np.flatnonzero(mask[:, r])
            lo = int(want.rank_prefix_matrix[me - 1, r]) if me else 0
            rows = outs[r][0][lo:lo + len(toks)].astype(np.float64)
            f32_sum[toks] += rows
            abs_sum[toks] += np.abs(rows)
        err = np.abs(comb.combined_x.astype(np.float64) - f32_sum)
        assert (err <= combine_bound(abs_sum) + 1e-30).all(), float((err - combine_bound(abs_sum)).max())


SCHEDULES_16 = [  # (name, Buffer settings) run in one job per PE count
    ("fullmesh", dict(schedule="fullmesh")),
    ("fullmesh compact", dict(schedule="fullmesh", routing="compact", qp_policy="four_rr")),
    ("groups", dict(schedule="groups", group_width=4, qp_policy="two_3_1")),
    ("groups compact 2:2", dict(schedule="groups", group_width=8, routing="compact", token_blocks=2,
                                weight_blocks=2, qp_policy="one", aggregate=False)),
    ("hierarchy", dict(schedule="hierarchy")),
    ("hierarchy compact", dict(schedule="hierarchy", routing="compact")),
]


def _schedules_job(server_size, skews, names, n_tok, num_experts):
    shmemx.aclshmemx_set_qp_num(shmemx.ACLSHMEM_DATA_OP_UDMA, 4)
    shmemx.init(sq_depth=256)
    n = shmemx.n_pes()
    buf = moe.Buffer(n_tok, H, K, num_experts, qp_num=4, server_size=server_size)
    for skew in skews:
        allin = _inputs(n, n_tok, num_experts, skew)
        for name, settings in SCHEDULES_16:
            if name not in names:
                continue
            buf.set_schedule(**{"group_width": 0, "token_blocks": 0, "weight_blocks": 0, "routing": "scan",
                                "qp_policy": "two_3_1", "aggregate": True, **settings,
                                "group_width": min(settings.get("group_width", 0), n)})
            check_schedule(buf, allin, num_experts, exact_combine=settings["schedule"] != "hierarchy")
    buf.close()
    shmemx.finalize()


ALL_NAMES = [s[0] for s in SCHEDULES_16]


@pytest.mark.parametrize("n,server_size", [(16, 4), (32, 8)])
def test_every_schedule_equals_reference(run_ok, n, server_size):
    run_ok(n, _schedules_job, server_size, ("uniform", "zipf"), ALL_NAMES, 24, 2 * n, timeout=600,
           heap_size="32M")


@pytest.mark.slow
def test_every_schedule_at_128_pes(run_ok):
    run_ok(128, _schedules_job, 16, ("uniform", "zipf"), ["fullmesh", "groups", "hierarchy",
                                                          "hierarchy compact"], 8, 256, timeout=1800,
           heap_size="16M")
