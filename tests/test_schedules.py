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
    # cross_server_bytes: hidden-row bytes to other servers; the hierarchy sends one per (token, remote server)
    topo = buf.topology
    mask = moe.get_dispatch_layout(idx, num_experts, n).is_token_in_rank
    remote = topo.server != topo.server[me]
    if buf.schedule.name == "hierarchy":
        per_server = mask.reshape(len(idx), topo.num_servers, topo.server_size).any(2)
        pairs = int(per_server[:, np.arange(topo.num_servers) != topo.server[me]].sum())
    else:
        pairs = int(mask[:, remote].sum())
    assert buf.last_stats.cross_server_bytes == pairs * H * 2, (buf.schedule, buf.last_stats.cross_server_bytes)
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
@pytest.mark.timeout(2400)  # the job's own deadline is 1800 s; 128 ranks share 2 cores
def test_every_schedule_at_128_pes(run_ok):
    run_ok(128, _schedules_job, 16, ("uniform", "zipf"), ["fullmesh", "groups", "hierarchy",
                                                          "hierarchy compact"], 8, 256, timeout=1800,
           heap_size="16M")


# --- pure: the maps, the topology, the arrival rule --------------------------------------------------------


def test_moonep_map_is_bijective_and_covers_every_peer_in_8_rounds():
    gm = GroupMap(128, 16)
    assert gm.two_frame and gm.rounds == 8
    gm.check()
    for g in range(8):
        dsts = [gm.dst(r, g, lane) for r in range(128) for lane in range(16)]
        assert np.bincount(dsts, minlength=128).tolist() == [16] * 128  # in-degree 16 for every receiver
        assert sorted(gm.dst_group[:, g].tolist()) == list(range(8))  # one source group per destination group
        for r in range(128):
            for lane in range(16):
                assert r in [gm.dst(gm.incoming(r, g, lane), g, x) for x in range(16)]
    for r in range(128):
        assert sorted(gm.dst(r, g, lane) for g in range(8) for lane in range(16)) == list(range(128))
    # the coordinates of the seed's kernels: frame 2 x 64, rows and columns of 8, groups of 4 x 4
    assert [gm.group_of[r] for r in (0, 4, 32, 36, 64, 100)] == [0, 1, 2, 3, 4, 7]
    assert gm.position_of[9] == 5 and gm.dst_group[1, 0] == 5  # right groups start in the other frame


@pytest.mark.parametrize("n,width", [(16, 4), (32, 8), (32, 32), (64, 16), (128, 32), (8, 2)])
def test_generalised_group_map(n, width):
    gm = GroupMap(n, width)
    gm.check()
    rounds = [[gm.dst(r, g, lane) for lane in range(width)] for r in range(n) for g in range(gm.rounds)]
    deg = in_degree([np.array([np.isin(np.arange(n), rounds[r * gm.rounds + g]) for g in range(gm.rounds)])
                     for r in range(n)])
    assert (deg == width).all()
    with pytest.raises(ValueError, match="divisor"):
        GroupMap(n, 3)


def test_topology_and_rank_table(tmp_path):
    topo = Topology(32, 8)
    assert topo.num_servers == 4 and topo.place(13).server == 1 and topo.place(13).lane == 5
    assert topo.relay(13, 3) == 29
    assert Topology(8).server_size == 8 and Topology(128).server_size == 16
    table = [{"rank": r, "server": r % 4, "lane": r // 4} for r in range(32)]  # round-robin placement
    path = tmp_path / "ranks.json"
    path.write_text(json.dumps({"server_size": 8, "ranks": table}))
    t2 = Topology(32, rank_table=str(path))
    assert t2.server[5] == 1 and t2.lane[5] == 1 and len(t2.mismatches()) == 30
    with pytest.warns(UserWarning, match="rank ids read as coordinates"):
        assert not t2.check("hierarchy")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert topo.check("groups") and t2.check("fullmesh")
    with pytest.raises(ValueError, match="holds two ranks"):
        Topology(4, 2, rank_table=[{"rank": r, "server": 0, "lane": 0} for r in range(4)])
    with pytest.raises(ValueError, match="missing"):
        Topology(4, 2, rank_table=[{"rank": 0, "server": 0, "lane": 0}])


def test_arrival_rule():
    flags = np.array([7, 7, 7, 0], np.uint64)  # three records of call 7, then an older slot
    assert arrived(flags, 7, False).tolist() == [True, True, False, False]  # the last needs the end flag
    assert arrived(flags, 7, True).tolist() == [True, True, True, False]
    assert arrived(np.array([7, 3, 7], np.uint64), 7, False).tolist() == [False, True, False]  # 2 proves 1


# --- metrics on a fixed routing, counted by hand ---------------------------------------------------------

FIXED = np.array([[0, 1], [4, 6], [2, 7], [-1, -1]], np.int64)  # E=8 on 4 ranks: 2 experts each


def _metrics_job():
    shmemx.aclshmemx_set_qp_num(shmemx.ACLSHMEM_DATA_OP_UDMA, 2)
    shmemx.init(sq_depth=256)
    me = shmemx.my_pe()
    x = ref.origin_x(me, 4, H)
    w = np.ones((4, 2), np.float32)
    buf = moe.Buffer(4, H, 2, 8, num_channels=1, qp_num=2, qp_policy="one", server_size=2)
    out = {}
    for name, extra in (("fullmesh", {}), ("hierarchy", {}), ("groups", dict(group_width=2, qp_policy="two_1_1"))):
        buf.set_schedule(schedule=name, **{"qp_policy": "one", **extra})
        buf.dispatch(x, topk_idx=FIXED, topk_weights=w)
        st = buf.last_stats
        out[name] = dict(st.totals(), cross=st.cross_server_bytes, wqes=st.qp_wqes.tolist(), peers=st.active_peers)
    if me == 0:  # token 0 -> rank 0, token 1 -> ranks 2 and 3, token 2 -> ranks 1 and 3, token 3 nowhere
        fm, hi, gr = out["fullmesh"], out["hierarchy"], out["groups"]
        # fullmesh, 1 channel, QP policy one: one lane per remote peer, the rows + their metadata records + the
        # closer
        assert fm["wqes"] == [9] and fm["peers"] == [3] and fm["cross"] == 3 * 2 * H
        # (one sync: every block's copy-out before the credits; the last round of posting ends without one)
        assert (fm["quiets"], fm["so_writes"], fm["flag_writes"], fm["credit_writes"], fm["syncs"]) == (3, 3, 3, 3, 1)
        assert fm["route_reads"] == 4 * 4 and fm["barriers"] == 0
        # hierarchy: 2 records (tokens 1 and 2) to rank 2 and the end flag; own token 2 to rank 1 and rank 2's
        # token 2 for rank 1 forwarded (2 copies each: the row, its metadata record); one barrier
        assert hi["cross"] == 2 * 2 * H and hi["wqes"] == [3] and hi["peers"] == [1, 1]
        assert (hi["so_writes"], hi["quiets"], hi["barriers"], hi["flag_writes"]) == (3, 1, 1, 2)
        assert (hi["mte_copies"], hi["credit_writes"]) == (4, 3)
        # groups of 2 (rounds: {0, 1} then {2, 3}): two token QPs, one SO generation write per (peer, QP);
        # round credits: one per lane for round 1, and the 3 buffer credits
        assert gr["peers"] == [1, 2] and gr["so_writes"] == 6 and gr["quiets"] == 6
        assert gr["credit_writes"] == 2 + 3 and gr["cross"] == 3 * 2 * H
    buf.close()
    shmemx.finalize()


def test_metrics_equal_hand_counts(run_ok):
    run_ok(4, _metrics_job, timeout=60)


def test_experiment_p2_quick_writes_csv_and_png(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "shmemx", "experiment", "P2", "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "P2.csv").stat().st_size > 0 and (tmp_path / "P2.png").stat().st_size > 0
    data = json.loads((tmp_path / "P2.json").read_text())
    assert data["verdict"] and len(data["rows"]) >= 6
    header = (tmp_path / "P2.csv").read_text().splitlines()[0]
    for col in ("qp_policy", "qp_wqes_max_min", "dispatch_ms_max", "wqes"):
        assert col in header, header
