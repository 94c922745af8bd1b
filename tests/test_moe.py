"""DeepEP-style MoE dispatch and combine (``shmemx.kernels.moe``) against the plain-numpy reference.

The oracles are DeepEP's (reference/deepep.md section 2.2), with payloads that encode their origin: x rows say
(source rank, token) exactly in bfloat16 (``reference.origin_x``), so a misrouted row fails the exact comparison
with the reference. Every rank regenerates every rank's inputs from per-rank seeds and computes the reference of
what it must receive locally, so the checks need no extra communication.

Pure functions (layout, channels, schedule rounds, workspace layout, casts) are tested without a job. The
multi-rank tests run one launch per PE count with several schedules inside it (a launch per schedule would cost
more in start-up than the kernels); the exhaustive sweep of every QP policy x rotate x aggregate is marked slow,
CI runs every policy once at P = 8 and a few at P = 2 and 4.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import shmemx
from shmemx.kernels import moe
from shmemx.kernels.moe import reference as ref
from shmemx.kernels.moe.routing import channel_bounds, channel_counts, make_send_head
from shmemx.kernels.moe.schedule import QP_POLICIES, Schedule, channel_qp, plan_rounds
from shmemx.kernels.moe.workspace import REGION_ALIGN, MetaRecord, plan_workspace

T, H, K, E = 48, 256, 4, 32  # CI shapes: 48 tokens per rank, 2 scale columns, 4 of 32 experts
CHANNELS = 4
FP8_TOL, INT8_TOL, BF16_TOL = 1e-3, 1e-4, 5e-6  # calc_diff of combine(dispatch(x)) / #ranks vs x (documented)
ALL_SCHEDULES = [Schedule(p, r, a) for p, r, a in itertools.product(QP_POLICIES, (True, False), (True, False))]


# --- pure functions ----------------------------------------------------------------------------------------


def _random_topk(rng, n_tok, k, n_exp, none_rate=0.15):
    idx = np.argsort(rng.random((n_tok, n_exp)), axis=1)[:, :k].astype(np.int64)
    idx[rng.random((n_tok, k)) < none_rate] = -1
    return idx


def test_layout_matches_loops():
    rng = np.random.default_rng(1)
    for n_pes in (1, 2, 4, 8):
        idx = _random_topk(rng, 37, 6, 64)
        idx[3] = -1  # a token routed nowhere
        idx[4] = [0, 1, 2, -1, -1, 3]  # four experts of rank 0: counted once for the rank
        lay = moe.get_dispatch_layout(idx, 64, n_pes, server_size=2 if n_pes % 2 == 0 else None)
        local = 64 // n_pes
        in_rank = np.zeros((37, n_pes), bool)
        per_expert = np.zeros(64, np.int64)
        for t in range(37):
            for e in idx[t]:
                if e >= 0:
                    in_rank[t, e // local] = True
                    per_expert[e] += 1
        np.testing.assert_array_equal(lay.is_token_in_rank, in_rank)
        np.testing.assert_array_equal(lay.num_tokens_per_rank, in_rank.sum(0))
        np.testing.assert_array_equal(lay.num_tokens_per_expert, per_expert)
        assert lay.num_tokens_per_rank.dtype == np.int32 and lay.num_tokens_per_expert.dtype == np.int32
        if n_pes % 2 == 0:
            servers = in_rank.reshape(37, n_pes // 2, 2).any(2).sum(0)
            np.testing.assert_array_equal(lay.num_tokens_per_rdma_rank, servers)
        else:
            assert lay.num_tokens_per_rdma_rank is None


def test_layout_rejects_bad_input():
    with pytest.raises(ValueError, match=r"topk_idx\[1, 0\] = 64 is not an expert"):
        moe.get_dispatch_layout(np.array([[0, 1], [64, 2]]), 64, 4)
    with pytest.raises(ValueError, match="-2"):
        moe.get_dispatch_layout(np.array([[-2, 1]]), 64, 4)
    with pytest.raises(TypeError, match="integer"):
        moe.get_dispatch_layout(np.zeros((2, 2), np.float32), 64, 4)
    with pytest.raises(ValueError, match="multiple"):
        moe.get_dispatch_layout(np.zeros((2, 2), np.int64), 10, 4)


def test_channels_and_send_head():
    np.testing.assert_array_equal(channel_bounds(10, 4), [0, 3, 6, 9, 10])
    np.testing.assert_array_equal(channel_bounds(2, 4), [0, 1, 2, 2, 2])
    np.testing.assert_array_equal(channel_bounds(0, 3), [0, 0, 0, 0])
    rng = np.random.default_rng(2)
    mask = rng.random((23, 5)) < 0.5
    counts = channel_counts(mask, 4)
    b = channel_bounds(23, 4)
    for c in range(4):
        np.testing.assert_array_equal(counts[:, c], mask[b[c]:b[c + 1]].sum(0))
    head = make_send_head(mask)
    for r in range(5):
        np.testing.assert_array_equal(head[mask[:, r], r], np.arange(mask[:, r].sum()))
        assert (head[~mask[:, r], r] == -1).all()


def test_policy_channel_to_qp():
    assert [channel_qp("one", c) for c in range(8)] == [0] * 8
    assert [channel_qp("two_1_1", c) for c in range(8)] == [0, 1] * 4
    assert [channel_qp("two_3_1", c) for c in range(8)] == [0, 0, 0, 1] * 2
    assert [channel_qp("two_1_3", c) for c in range(8)] == [1, 1, 1, 0] * 2
    assert [channel_qp("four_rr", c) for c in range(8)] == [0, 1, 2, 3] * 2
    with pytest.raises(ValueError, match="per unit"):
        channel_qp("bytes", 0)
    with pytest.raises(ValueError, match="qp_policy 'three'"):
        Schedule("three")
    for s in ALL_SCHEDULES:
        assert Schedule.from_code(s.code) == s


@pytest.mark.parametrize("schedule", ALL_SCHEDULES, ids=str)
def test_plan_rounds_invariants(schedule):
    """Every unit once, one block per lane per round, one closer per remote lane in its last round."""
    rng = np.random.default_rng(3)
    for n_pes, n_ch in ((1, 1), (2, 8), (4, 3), (8, 8), (8, 4)):
        for me in {0, n_pes - 1}:
            rows = rng.integers(0, 5, (n_ch, n_pes))
            rows[0, :] = 0  # a channel with nothing to send
            plan = plan_rounds(me, n_pes, rows, schedule)
            seen = {}
            for c in range(n_ch):
                for k in range(plan.rounds):
                    for u in plan.by_block[c][k]:
                        assert u.channel == c and u.round == k
                        if u.rows:
                            assert (c, u.peer) not in seen
                            seen[c, u.peer] = u
                        if schedule.qp_policy != "bytes" and u.rows:
                            assert u.qp == channel_qp(schedule.qp_policy, c)
            assert {key: u.rows for key, u in seen.items()} == {
                (c, r): int(rows[c, r]) for c in range(n_ch) for r in range(n_pes) if rows[c, r]}
            lanes_in_round = {}
            for u in plan.units:
                if u.peer != me:
                    key = (u.round, u.peer, u.qp)
                    assert key not in lanes_in_round, f"two blocks on lane {u.peer}/{u.qp} in round {u.round}"
                    lanes_in_round[key] = u.channel
            for peer in range(n_pes):
                for q in range(schedule.num_qps):
                    lane = [u for u in plan.units if (u.peer, u.qp) == (peer, q)]
                    closers = [u for u in lane if u.closes]
                    if peer == me:
                        assert not closers
                    else:
                        assert len(closers) == 1 and closers[0].round == max(u.round for u in lane)
                    assert plan.lane_rows[peer, q] == sum(u.rows for u in lane)


@pytest.mark.parametrize("schedule", ALL_SCHEDULES, ids=str)
def test_batched_lanes_plan(schedule):
    """shared_lanes='batch': one round; each remote lane is one closing unit, posted by one of its sharers, whose
    parts are the sharers' channels as runs of consecutive channels with their rows; this PE's own rows stay one
    local unit per channel; the same lane rows as the rounds plan."""
    rng = np.random.default_rng(4)
    for n_pes, n_ch in ((1, 1), (2, 8), (4, 3), (8, 8), (8, 4), (5, 1)):
        for me in {0, n_pes - 1}:
            rows = rng.integers(0, 5, (n_ch, n_pes))
            rows[0, :] = 0
            plan = plan_rounds(me, n_pes, rows, schedule, batch=True)
            turns = plan_rounds(me, n_pes, rows, schedule)
            assert plan.rounds == 1
            np.testing.assert_array_equal(plan.lane_rows, turns.lane_rows)
            sent = {}
            lanes = {}
            for c in range(n_ch):
                for u in plan.by_block[c][0]:
                    assert u.channel == c and u.round == 0
                    if u.peer == me:
                        assert not u.closes and not u.segments and u.rows
                    else:
                        assert u.closes and (u.peer, u.qp) not in lanes
                        lanes[u.peer, u.qp] = u
                    assert sum(r for _, _, r in u.parts()) == u.rows
                    for c0, c1, r in u.parts() if u.rows else ():  # (a lane without rows: an empty closer)
                        assert c0 < c1 and r == int(rows[c0:c1, u.peer].sum())
                        for ch in range(c0, c1):
                            if rows[ch, u.peer]:
                                assert (ch, u.peer) not in sent
                                sent[ch, u.peer] = u.qp
                    if u.segments:  # the owner is one of the sharers; runs are maximal
                        assert any(c0 <= c < c1 for c0, c1, _ in u.segments)
                        assert all(a[1] < b[0] for a, b in zip(u.segments, u.segments[1:]))
            assert set(sent) == {(c, r) for c in range(n_ch) for r in range(n_pes) if rows[c, r]}
            if schedule.qp_policy != "bytes":
                assert all(q == channel_qp(schedule.qp_policy, c) for (c, _), q in sent.items())
            assert set(lanes) == {(r, q) for r in range(n_pes) if r != me for q in range(schedule.num_qps)}


def test_bytes_policy_balances_each_peer():
    rows = np.array([[10, 1], [1, 1], [6, 1], [5, 1]])
    plan = plan_rounds(0, 2, rows, Schedule("bytes"))
    np.testing.assert_array_equal(plan.lane_rows, [[11, 11], [2, 2]])  # LPT: 10+1 / 6+5 and 1+1 / 1+1


def test_one_channel_plan_is_the_general_plan():
    """The one-channel plan (the default Buffer's, made without the per-lane search) has the units, order,
    rounds and lane rows of the general loop, for every policy, rotation, rank and a peer without rows."""
    from shmemx.kernels.moe.schedule import _plan_general

    rng = np.random.default_rng(3)
    for n_pes, policy, rotate in itertools.product((1, 2, 5, 9), QP_POLICIES, (True, False)):
        rows = rng.integers(0, 3, (1, n_pes))
        rows[0, -1] = 0
        for me in range(n_pes):
            fast, slow = plan_rounds(me, n_pes, rows, Schedule(policy, rotate)), _plan_general(me, n_pes, rows,
                                                                                             Schedule(policy, rotate))
            assert fast.rounds == slow.rounds and fast.by_block == slow.by_block
            np.testing.assert_array_equal(fast.lane_rows, slow.lane_rows)
            assert sorted(fast.units, key=repr) == sorted(slow.units, key=repr)


def test_batched_plan_is_the_general_plan():
    """The batched plan (made on every call of a batched Buffer, without the general loop's per-lane search and
    sort) has the units, order and lane rows of the general loop with ``batch``, for every policy, rotation,
    rank, channel count and lanes without rows."""
    from shmemx.kernels.moe.schedule import _plan_batched, _plan_general

    rng = np.random.default_rng(4)
    for n_pes, channels, policy, rotate in itertools.product((1, 2, 5, 8), (2, 3, 4, 7), QP_POLICIES, (True, False)):
        rows = rng.integers(0, 3, (channels, n_pes))
        rows[:, -1] = 0
        for me in range(n_pes):
            fast = _plan_batched(me, n_pes, rows, Schedule(policy, rotate))
            slow = _plan_general(me, n_pes, rows, Schedule(policy, rotate), batch=True)
            assert fast.rounds == slow.rounds == 1 and fast.by_block == slow.by_block, (n_pes, channels, policy, me)
            np.testing.assert_array_equal(fast.lane_rows, slow.lane_rows)
            assert sorted(fast.units, key=repr) == sorted(slow.units, key=repr)
            assert fast.batched and slow.batched


def test_rotation_starts_each_rank_at_itself():
    rows = np.ones((8, 8), np.int64)
    for me in range(8):
        first = [u.peer for u in plan_rounds(me, 8, rows, Schedule("one", rotate=True)).by_block[0][0]]
        plain = [u.peer for u in plan_rounds(me, 8, rows, Schedule("one", rotate=False)).by_block[0][0]]
        assert first == [me] and plain == [0]


def test_tier_order_feeds_every_receiver_at_every_step():
    """Told the servers, the one-channel full mesh orders its peers per tier: every peer once, both tiers from
    the start, and at every step the ranks of a server reach distinct ranks of the other servers (no convoy at
    one receiver's inter-server ingress); the units are those of the rotated plan, in another order."""
    from shmemx.kernels.moe.schedule import tier_order

    for n_pes, size in ((16, 8), (32, 8), (12, 4)):
        servers = np.arange(n_pes) // size
        orders = [tier_order(me, servers) for me in range(n_pes)]
        for me, order in enumerate(orders):
            assert order[0] == me and sorted(order) == list(range(n_pes))
            head = order[1:2 + (n_pes - size) // (size - 1)]  # both tiers from the start, in proportion
            assert servers[order[1]] != servers[me] and servers[me] in servers[head]
        for sv in range(n_pes // size):
            senders = [orders[me] for me in range(n_pes) if servers[me] == sv]
            inter = [[p for p in o if servers[p] != sv] for o in senders]
            for step in range(len(inter[0])):
                assert len({o[step] for o in inter}) == size, (n_pes, sv, step)
        rows = np.arange(n_pes)[None, :] % 3
        for me in range(n_pes):
            told = plan_rounds(me, n_pes, rows, Schedule("two_3_1"), servers=servers)
            plain = plan_rounds(me, n_pes, rows, Schedule("two_3_1"))
            peers = list(dict.fromkeys(u.peer for u in told.by_block[0][0] if u.peer != me))
            assert peers == orders[me][1:]
            assert sorted(told.units, key=repr) == sorted(plain.units, key=repr)
    one = plan_rounds(3, 8, np.ones((1, 8), np.int64), Schedule("one"), servers=np.zeros(8, np.int64))  # one server
    assert [u.peer for u in one.by_block[0][0]] == [3, 4, 5, 6, 7, 0, 1, 2]


def test_workspace_regions_do_not_overlap():
    ws = plan_workspace(n_pes=8, max_tokens=512, hidden=7168, num_topk=8, num_experts=256, num_channels=8,
                        qp_num=4)
    regions = sorted(ws.regions.values(), key=lambda r: r.offset)
    for a, b in zip(regions, regions[1:]):
        assert a.offset + a.nbytes <= b.offset, (a.name, b.name)
    assert all(r.offset % REGION_ALIGN == 0 for r in regions)
    assert ws["signals"].shape == (2, 8, 4, 64) and ws["signals"].nbytes == 2 * 8 * 4 * 512  # 512 B a slot
    assert ws["x"].nbytes == 512 * 8 * 7168 * 2 and ws["combine_x"].shape == (512 * 8 + 1, 7168)
    assert regions[-1].offset + regions[-1].nbytes == ws.total
    assert "x_scales" in ws.describe() and ws["meta"].nbytes == 512 * 8 * MetaRecord.of(8).width == 512 * 8 * 104


def test_output_pool_reuses_dropped_outputs():
    from shmemx.kernels.moe.pool import OutputPool

    pool = OutputPool()
    a = pool.take((100, 64), np.float32)
    addr = a.__array_interface__["data"][0]
    small = pool.take(10, np.int32)  # must not take the big base
    assert small.__array_interface__["data"][0] != addr
    b = pool.take((100, 64), np.float32)  # a is still held: new memory
    assert b.__array_interface__["data"][0] != addr
    view = a[3:]
    del a
    c = pool.take((100, 64), np.float32)  # a view of a's base is alive: still not reused
    assert c.__array_interface__["data"][0] != addr
    del view
    d = pool.take((60, 64), np.float32)  # free, and at most twice the size asked: reused
    assert d.__array_interface__["data"][0] == addr and d.shape == (60, 64)
    assert pool.take((0, 64), np.float32).shape == (0, 64)


def test_native_reduce_is_the_numpy_sum():
    """The combine's native bfloat16 reduce gives the bits of the float32 sum in order, rounded once (NaN, inf,
    -0, subnormals, overflow to inf; with and without a bias), and refuses rows out of range."""
    reduce = pytest.importorskip("shmemx.kernels.moe._reduce").bf16_reduce
    rng = np.random.default_rng(3)
    R, H, n, W = 64, 200, 40, 5
    src = rng.standard_normal((R, H), np.float32).astype(ref.bf16).view(np.uint16)
    src[0, :6] = [0x7fc0, 0xffc1, 0x7f80, 0xff80, 0x8000, 0x0001]
    src[1] = 0x7f7f
    idx = rng.integers(0, R, (n, W)).astype(np.int64)
    idx[:2, :2] = [0, 1]
    cnt = rng.integers(0, W + 1, n).astype(np.int64)
    cnt[:2] = 2
    for bias in (None, rng.standard_normal((n, H), np.float32)):
        out = np.zeros((n, H), np.uint16)
        reduce(src, idx, cnt, out, bias, H)
        want = np.zeros((n, H), np.float32) if bias is None else bias.copy()
        for i in range(n):
            for j in range(cnt[i]):
                want[i] += src[idx[i, j]].view(ref.bf16).astype(np.float32)
        assert np.array_equal(out, want.astype(ref.bf16).view(np.uint16))
        split = np.zeros((n, H), np.uint16)  # rows from R - 9 on in a second buffer (a PE's own rows)
        reduce(np.ascontiguousarray(src[:R - 9]), idx, cnt, split, bias, H, np.ascontiguousarray(src[R - 9:]))
        assert np.array_equal(split, out)
    idx[3, 0] = R
    cnt[3] = 1
    with pytest.raises(IndexError, match="out of range"):
        reduce(src, idx, cnt, np.zeros((n, H), np.uint16), None, H)


def test_numpy_reduce_is_the_native_one():
    """The combine's numpy reduction (where the native module is missing) gives the native one's bits, a PE's own
    rows read from the input after the region's."""
    from types import SimpleNamespace

    from shmemx.kernels.moe import combine

    reduce = pytest.importorskip("shmemx.kernels.moe._reduce").bf16_reduce
    rng = np.random.default_rng(5)
    R, L, H, n, W = 50, 12, 96, 70, 6
    rows = rng.standard_normal((R + L, H), np.float32).astype(ref.bf16).view(np.uint16)
    rows[R - 1] = 0  # the region's zero row: the padding
    cnt = rng.integers(0, W + 1, n).astype(np.int64)
    idx = np.where(np.arange(W) < cnt[:, None], rng.integers(0, R + L, (n, W)), R - 1).astype(np.int64)
    want = np.zeros((n, H), np.uint16)
    reduce(rows[:R], idx, cnt, want, None, H, rows[R:])
    a = SimpleNamespace(bias=None, out_x=np.zeros((n, H), ref.bf16),
                        scratch=lambda block: (np.zeros((32, H), np.float32), np.zeros((32, H), np.uint16)))
    combine._reduce_numpy(a, 0, idx, cnt, (rows[:R], rows[R:]))
    assert np.array_equal(a.out_x.view(np.uint16), want)


def test_reference_helpers():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((16, 300)).astype(np.float32)
    assert ref.calc_diff(x, x) == 0.0
    assert ref.calc_diff(x, -x) > 0.5
    for cast, tol in ((ref.per_token_cast_to_fp8, 2e-3), (ref.per_token_cast_to_int8, 2e-4)):
        data, scales = cast(x)
        assert data.shape == x.shape and scales.shape == (16, 3) and scales.dtype == np.float32
        assert ref.calc_diff(ref.per_token_cast_back(data, scales), x) < tol
    o = ref.origin_x(5, 300, 16)
    assert o.dtype == ref.bf16
    assert (o.astype(np.float32)[:, 0] == 6).all()
    np.testing.assert_array_equal(o.astype(np.float32)[:, 1] * 128 + o.astype(np.float32)[:, 2], np.arange(300))


# --- multi-rank: dispatch and combine against the reference -------------------------------------------------


def _inputs(rank: int, n_pes: int, variant: str = "random"):
    """Rank ``rank``'s (x, topk_idx, topk_weights) for a routing ``variant``; the same on every PE."""
    rng = np.random.default_rng(1000 + rank)
    n_tok = T
    if variant == "silent" and rank == n_pes - 1:
        n_tok = 0  # a PE that sends nothing
    idx = _random_topk(rng, n_tok, K, E)
    if variant == "random" and n_tok > 5:
        idx[5] = -1  # a token routed nowhere
    if variant == "one_expert":
        idx[:] = -1
        idx[:, 0] = 3  # every token of every PE to expert 3
    w = rng.random((n_tok, K)).astype(np.float32) + 0.5
    return ref.origin_x(rank, n_tok, H), idx, w


def _expected_qp_totals(buf, is_token_in_rank, schedule, metadata_wqes: int, row_bytes: int, meta_bytes: int):
    """WQEs and bytes per QP that a dispatch must post: from the channel counts and the policy."""
    me, n = shmemx.my_pe(), shmemx.n_pes()
    rows = channel_counts(is_token_in_rank, buf.num_channels)  # [P, C]
    plan = plan_rounds(me, n, rows.T, schedule, buf.shared_lanes == "batch")
    wqes = np.zeros(schedule.num_qps, np.int64)
    nbytes = np.zeros(schedule.num_qps, np.int64)
    bounds = channel_bounds(is_token_in_rank.shape[0], buf.num_channels)
    for u in plan.units:
        if u.peer == me:
            continue
        for c0, c1, part_rows in u.parts():  # a batched lane: one range per run of consecutive channels
            if not part_rows:
                continue
            toks = np.flatnonzero(is_token_in_rank[bounds[c0]:bounds[c1], u.peer])
            runs = 1 + int((np.diff(toks) != 1).sum())  # per-token mode: a WQE per run of consecutive tokens
            wqes[u.qp] += (1 if schedule.aggregate else runs) + metadata_wqes
            nbytes[u.qp] += part_rows * (row_bytes + meta_bytes)
        if u.closes:
            wqes[u.qp] += 1
            nbytes[u.qp] += 32
    if schedule.qp_policy not in ("bytes",):  # static policies: QP q carries exactly its channels' rows
        for q in range(schedule.num_qps):
            mine = [c for c in range(buf.num_channels) if channel_qp(schedule.qp_policy, c) == q]
            remote = np.delete(rows[:, mine], me, axis=0).sum()
            assert nbytes[q] == remote * (row_bytes + meta_bytes) + 32 * (n - 1)
    return wqes, nbytes


def _check_dispatch_combine(buf, allin, schedule, num_experts=E):
    me, n = shmemx.my_pe(), shmemx.n_pes()
    x, idx, w = allin[me]
    xs, idxs, ws = [a[0] for a in allin], [a[1] for a in allin], [a[2] for a in allin]
    want = ref.reference_dispatch(xs, idxs, ws, num_experts, me, expert_alignment=4)
    lay = buf.get_dispatch_layout(idx)
    res = buf.dispatch(x, None, lay.num_tokens_per_rank, lay.is_token_in_rank, lay.num_tokens_per_expert, idx, w,
                       expert_alignment=4)
    stats = buf.last_stats
    # every row is what its source sent, rank-ordered blocks, token order within a block
    np.testing.assert_array_equal(res.recv_x.view(np.uint16), want.recv_x.view(np.uint16))
    np.testing.assert_array_equal(res.handle.recv_src_idx, want.recv_src_idx)
    np.testing.assert_array_equal(res.handle.rank_prefix_matrix, want.rank_prefix_matrix)
    prefix = res.handle.rank_prefix_matrix
    for s in range(n):
        lo = prefix[s - 1, me] if s else 0
        assert (res.recv_x[lo:prefix[s, me], 0].astype(np.float32) == s + 1).all()
    np.testing.assert_array_equal(res.recv_topk_idx, want.recv_topk_idx)
    np.testing.assert_array_equal(res.recv_topk_weights, want.recv_topk_weights)
    assert res.num_recv_tokens_per_expert_list == want.num_recv_tokens_per_expert_list
    local = num_experts // n
    assert ((res.recv_topk_idx == -1) | ((res.recv_topk_idx >= 0) & (res.recv_topk_idx < local))).all()
    for j in range(local):
        count = int((res.recv_topk_idx == j).sum())
        assert -(-count // 4) * 4 == res.num_recv_tokens_per_expert_list[j]
    assert (res.recv_topk_weights[res.recv_topk_idx < 0] == 0).all()
    np.testing.assert_array_equal(res.handle.send_head, make_send_head(lay.is_token_in_rank))
    # the measurements say what went on each QP
    # the metadata of a unit's rows is one WQE of their records (source index, top-k experts and weights, padded
    # to 8 bytes: ``MetaRecord``)
    wqes, nbytes = _expected_qp_totals(buf, lay.is_token_in_rank, schedule, 1, 2 * H, -(-(4 + 12 * K) // 8) * 8)
    np.testing.assert_array_equal(stats.qp_wqes, wqes)
    np.testing.assert_array_equal(stats.qp_bytes, nbytes)
    assert stats.recv_rows == len(want.recv_src_idx) and stats.schedule == str(schedule)

    # cached dispatch skips notify and gives the fresh result; a new x through the handle is rerouted alike
    cached = buf.dispatch(x, handle=res.handle)
    np.testing.assert_array_equal(cached.recv_x.view(np.uint16), res.recv_x.view(np.uint16))
    assert cached.recv_topk_idx is None and cached.num_recv_tokens_per_expert_list is None
    x2 = [ref.origin_x(r + n, len(a[0]), H) for r, a in enumerate(allin)]
    cached2 = buf.dispatch(x2[me], handle=res.handle)
    np.testing.assert_array_equal(cached2.recv_x.view(np.uint16),
                                  ref.reference_dispatch(x2, idxs, None, num_experts, me).recv_x.view(np.uint16))

    # num_worst_tokens: fixed rows, the fresh result first, padding after, no per-expert list
    worst = T * n
    padded = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_worst_tokens=worst)
    rows = len(want.recv_src_idx)
    assert padded.recv_x.shape == (worst, H) and padded.recv_topk_idx.shape == (worst, K)
    assert padded.num_recv_tokens_per_expert_list == []
    np.testing.assert_array_equal(padded.recv_x[:rows].view(np.uint16), res.recv_x.view(np.uint16))
    np.testing.assert_array_equal(padded.recv_topk_idx[:rows], res.recv_topk_idx)
    assert (padded.recv_x[rows:].view(np.uint16) == 0).all() and (padded.recv_topk_idx[rows:] == -1).all()
    assert (padded.recv_topk_weights[rows:] == 0).all()

    # combine (of the padded rows: only the first num_recv count) = x times the ranks each token went to
    comb = buf.combine(padded.recv_x, padded.handle, padded.recv_topk_weights)
    went = lay.is_token_in_rank.sum(1)
    sent = went > 0
    if sent.any():
        got = comb.combined_x[sent].astype(np.float64) / went[sent, None]
        assert ref.calc_diff(got, x[sent].astype(np.float64)) < BF16_TOL
    assert (comb.combined_x[~sent].astype(np.float32) == 0).all()  # tokens routed nowhere
    recv_all = [ref.reference_dispatch(xs, idxs, ws, num_experts, r) for r in range(n)]
    want_x, want_w = ref.reference_combine([d.recv_x for d in recv_all], idxs, num_experts, me,
                                           [d.recv_topk_weights for d in recv_all])
    np.testing.assert_array_equal(comb.combined_x.view(np.uint16), want_x.view(np.uint16))
    np.testing.assert_array_equal(comb.combined_topk_weights, want_w)
    np.testing.assert_array_equal(comb.combined_topk_weights, np.where(idx >= 0, w, 0))  # each slot from its rank
    cstats = buf.last_stats
    assert cstats.kind == "combine" and cstats.recv_rows == int(lay.num_tokens_per_rank.sum())


def _check_quantised(buf, allin):
    """int8 and float8 payloads: data and scales arrive as sent; combine of the dequantised rows ~ x."""
    me = shmemx.my_pe()
    xr = [np.random.default_rng(77 + r).standard_normal((len(a[0]), H)).astype(ref.bf16) for r, a in
          enumerate(allin)]
    idxs = [a[1] for a in allin]
    for cast, tol in ((ref.per_token_cast_to_int8, INT8_TOL), (ref.per_token_cast_to_fp8, FP8_TOL)):
        qs = [cast(v) for v in xr]
        res = buf.dispatch(qs[me], topk_idx=idxs[me], topk_weights=allin[me][2])
        want = ref.reference_dispatch(qs, idxs, None, E, me)
        data, scales = res.recv_x
        assert data.dtype == qs[me][0].dtype and scales.dtype == np.float32
        np.testing.assert_array_equal(data.view(np.uint8), want.recv_x[0].view(np.uint8))
        np.testing.assert_array_equal(scales, want.recv_x[1])
        expert_out = ref.per_token_cast_back(data, scales).astype(ref.bf16)
        comb = buf.combine(expert_out, res.handle)
        went = res.handle.is_token_in_rank.sum(1)
        ok = went > 0
        diff = ref.calc_diff(comb.combined_x[ok].astype(np.float64) / went[ok, None], xr[me][ok].astype(np.float64))
        assert diff < tol, (cast.__name__, diff)


def _moe_job(schedules, variants, quantised, errors, lanes=("batch",), splits=(None,)):
    """``lanes``: the shared-lane modes to check; ``splits``: with batched lanes, ``Lanes.split_blocks`` (None:
    the host's default; True: the blocks split the work, False: block 0 does it all)."""
    shmemx.aclshmemx_set_qp_num(shmemx.ACLSHMEM_DATA_OP_UDMA, 4)
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    buf = moe.Buffer(T, H, K, E, num_channels=CHANNELS, qp_num=4)
    default = buf.split_blocks
    for variant in variants:
        allin = [_inputs(r, n, variant) for r in range(n)]
        for schedule in schedules:
            buf.set_schedule(qp_policy=schedule.qp_policy, rotate=schedule.rotate, aggregate=schedule.aggregate)
            for mode in lanes:
                buf.shared_lanes = mode
                for split in splits if mode == "batch" else (None,):
                    buf.split_blocks = default if split is None else split
                    _check_dispatch_combine(buf, allin, schedule)
    buf.split_blocks = default if splits[-1] is None else splits[-1]
    if quantised:
        _check_quantised(buf, [_inputs(r, n) for r in range(n)])
    if errors:
        _check_errors(buf)
    buf.close()
    shmemx.finalize()


def _check_errors(buf):
    me, n = shmemx.my_pe(), shmemx.n_pes()
    allin = [_inputs(r, n, "one_expert") for r in range(n)]  # every token to rank 0
    x, idx, w = allin[me]
    # overflow of num_worst_tokens: only rank 0 receives more than T rows; it raises, nobody hangs
    if me == 0 and n > 1:
        with pytest.raises(ValueError, match=rf"{T * n} tokens arrived, more than num_worst_tokens={T}"):
            buf.dispatch(x, topk_idx=idx, topk_weights=w, num_worst_tokens=T)
    else:
        res = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_worst_tokens=T)
        assert res.recv_x.shape == (T, H) and (res.recv_topk_idx == -1).all()
    # the buffer still works afterwards (credits were given even by the failing rank)
    _check_dispatch_combine(buf, [_inputs(r, n) for r in range(n)], buf.schedule)
    with pytest.raises(ValueError, match=f"more than max_tokens={T}"):
        buf.dispatch(ref.origin_x(me, T + 1, H))
    with pytest.raises(TypeError, match="bfloat16"):
        buf.dispatch(np.zeros((4, H), np.float32))
    with pytest.raises(ValueError, match="together"):
        buf.dispatch(x, topk_idx=idx)
    with pytest.raises(ValueError, match="takes no topk_idx"):
        buf.dispatch(x, handle=buf.dispatch(x, topk_idx=idx, topk_weights=w).handle, topk_idx=idx)
    with pytest.raises(ValueError, match="needs 4 QPs per peer; this Buffer was made with qp_num=2"):
        moe.Buffer(T, H, K, E, qp_num=2, qp_policy="one").set_schedule(qp_policy="four_rr")
    if n > 1:  # PEs that disagree on the schedule fail on every PE, naming the other choice
        policy = "one" if me == 0 else "four_rr"
        with pytest.raises(ValueError, match="every pe must use the same schedule"):
            buf.set_schedule(qp_policy=policy)
    with pytest.raises(shmemx.HeapExhaustedError, match=r"needs a workspace of \d+ B \(.* MiB\) on every PE"):
        moe.Buffer(1 << 20, 7168, 8, 256)


# CI: every policy once at P = 8 (rotate and aggregate alternating), a few at P = 2 and 4
CI_SCHEDULES = {
    2: [Schedule("two_3_1", True, True), Schedule("one", False, False)],
    4: [Schedule("four_rr", True, False), Schedule("bytes", False, True)],
    8: [Schedule(p, i % 2 == 0, i % 3 != 1) for i, p in enumerate(QP_POLICIES)],
}


def _zero_copy_job():
    shmemx.aclshmemx_set_qp_num(shmemx.ACLSHMEM_DATA_OP_UDMA, 4)
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    buf = moe.Buffer(T, H, K, E, num_channels=CHANNELS, qp_num=4, qp_policy="two_1_1", zero_copy=True)
    allin = [_inputs(r, n) for r in range(n)]
    x, idx, w = allin[me]
    res = buf.dispatch(x, topk_idx=idx, topk_weights=w)
    assert np.shares_memory(res.recv_x, buf.views["x"])  # the workspace's receive rows, not a copy
    want = ref.reference_dispatch([a[0] for a in allin], [a[1] for a in allin], [a[2] for a in allin], E, me)
    np.testing.assert_array_equal(res.recv_x.view(np.uint16), want.recv_x.view(np.uint16))
    # the full DeepEP check sequence (cached, new x through the handle, num_worst_tokens, combine) on the same
    # buffer: back-to-back dispatches must wait for the credits each PE gives at its next dispatch
    for schedule in (Schedule("two_1_1", True, True), Schedule("one", False, False)):
        buf.set_schedule(qp_policy=schedule.qp_policy, rotate=schedule.rotate, aggregate=schedule.aggregate)
        _check_dispatch_combine(buf, allin, schedule)
    buf.close()
    shmemx.finalize()


@pytest.mark.parametrize("n", [2, 8])
def test_zero_copy_dispatch_returns_workspace_rows(run_ok, n):
    run_ok(n, _zero_copy_job, timeout=120)


def _slots_job():
    """The default dispatch's receive slots (moe/slots.py): recv_x lives where its rows landed, is never
    overwritten while held (a held pair of slots falls back to x and a copy), and slots are reused once dropped;
    a Buffer closed while a PE holds one keeps that allocation until no PE does."""
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    buf = moe.Buffer(T, H, K, E)
    allin = [_inputs(r, n) for r in range(n)]
    x, idx, w = allin[me]
    want = ref.reference_dispatch([a[0] for a in allin], [a[1] for a in allin], [a[2] for a in allin], E, me)
    held, slots = [], []
    for k in range(4):  # hold every result: slots 1, 2, then x (copied out) twice
        held.append(buf.dispatch((x.view(np.uint16) + k).view(x.dtype), topk_idx=idx, topk_weights=w))
        slots.append(buf.last_stats.extra["recv_slot"])
    assert slots == [1, 2, 0, 0], slots
    assert np.shares_memory(held[0].recv_x, buf.slots.block) and not np.shares_memory(held[2].recv_x, buf.views["x"])
    for k, res in enumerate(held):  # none was overwritten by a later call
        np.testing.assert_array_equal(res.recv_x.view(np.uint16), want.recv_x.view(np.uint16) + k)
    cached = buf.dispatch(x, handle=held[0].handle)  # a cached call lands in x and is copied out
    assert buf.last_stats.extra["recv_slot"] == 0
    np.testing.assert_array_equal(cached.recv_x.view(np.uint16), want.recv_x.view(np.uint16))
    np.testing.assert_array_equal(held[1].recv_x.view(np.uint16), want.recv_x.view(np.uint16) + 1)
    out = buf.combine(held[1].recv_x, held[1].handle)  # combine reads a slot like any array
    assert out.combined_x.shape == (len(x), H)
    first = held[0].recv_x
    del held[1:], cached, out
    res = buf.dispatch(x, topk_idx=idx, topk_weights=w)  # slot 2 was dropped (slot 1 is still held: first)
    assert buf.last_stats.extra["recv_slot"] == 2
    del res
    kept = first.copy()
    buf.close()  # first still views slot 1 on every PE: the allocation stays
    other = moe.Buffer(T, H, K, E)  # and makes room for a new Buffer's own
    got = other.dispatch(x, topk_idx=idx, topk_weights=w)
    assert other.last_stats.extra["recv_slot"] == 1
    np.testing.assert_array_equal(got.recv_x.view(np.uint16), want.recv_x.view(np.uint16))
    np.testing.assert_array_equal(first.view(np.uint16), kept.view(np.uint16))
    del first, held, got
    other.close()  # no PE holds the orphan any more: both allocations go
    from shmemx.kernels.moe import slots as slots_mod
    assert not slots_mod._ORPHANS
    shmemx.finalize()


@pytest.mark.parametrize("n", [2, 4])
def test_default_dispatch_receive_slots(run_ok, n):
    run_ok(n, _slots_job, timeout=120)


def _job_free(queue, words: np.ndarray) -> np.ndarray:
    """A ring's WQEs with the words that differ from job to job zeroed: the queue's TP, tokenId, EID and token,
    and a WRITE_WITH_NOTIFY's notify tokenId and token (checked against the queue's own first), and the source VAs
    of registered local arrays (their place in a page follows the array's address; the outputs check that they
    read the right rows)."""
    from shmemx.udma.layout import NOTIFY_CTX_OFFSET, NOTIFY_SGE_OFFSET, Opcode
    from shmemx.udma.segment import LOCAL_VA_BASE

    mine = queue.build_writes(rmt_va=0, sge_len=0, sge_va=0)[0, 1:5]
    info = queue.remote_mem_info
    key = np.uint64(int(info["tid"]) | int(info["rmt_token_value"]) << 32)
    k = 0
    while k < len(words):
        np.testing.assert_array_equal(words[k, 1:5], mine)
        words[k, 1:5] = 0
        notify = (int(words[k, 0]) >> 40) & 0xFF == Opcode.WRITE_WITH_NOTIFY
        if notify:
            assert words[k, NOTIFY_CTX_OFFSET // 8] == key
            words[k, NOTIFY_CTX_OFFSET // 8] = 0
        sge = words.reshape(-1)[8 * k + (NOTIFY_SGE_OFFSET // 8 + 1 if notify else 7):][:1]
        if sge[0] >= LOCAL_VA_BASE:
            sge[0] = 0
        k += 2 if notify else 1
    return words


def _batched_rings_job(mode: str, out_dir: str):
    """Dispatch + combine (and a cached dispatch); ``mode`` "batch": block 0 does every block's work where it
    may (``Lanes.one_block``), "split": the blocks split it (``Buffer.split_blocks``); writes every send queue's
    ring bytes and the call's outputs."""
    shmemx.aclshmemx_set_qp_num(shmemx.ACLSHMEM_DATA_OP_UDMA, 4)
    shmemx.init(sq_depth=1024)
    me, n = shmemx.my_pe(), shmemx.n_pes()
    allin = [_inputs(r, n) for r in range(n)]
    x, idx, w = allin[me]
    rings = {}
    for channels, lanes, schedules in (
            (1, "batch", [Schedule("one", True, False)]),
            (CHANNELS, "rounds", [Schedule("two_1_1", False, True), Schedule("bytes", True, False),
                                  Schedule("four_rr", True, True)]),
            (CHANNELS, "batch", [Schedule("two_3_1", True, False), Schedule("one", True, True),
                                 Schedule("bytes", True, False)])):  # units carrying several channels' rows (bytes:
        # in runs that are not consecutive, several segments to a unit)
        buf = moe.Buffer(T, H, K, E, num_channels=channels, qp_num=4, shared_lanes=lanes)
        buf.split_blocks = mode == "split"
        for schedule in schedules:
            buf.set_schedule(qp_policy=schedule.qp_policy, rotate=schedule.rotate, aggregate=schedule.aggregate)
            res = buf.dispatch(x, topk_idx=idx, topk_weights=w)
            out = buf.combine(res.recv_x, res.handle, topk_weights=res.recv_topk_weights)[0]
            again = buf.dispatch(x, handle=res.handle)
            np.testing.assert_array_equal(again.recv_x.view(np.uint16), res.recv_x.view(np.uint16))
            rings[f"out {channels} {lanes} {schedule}"] = out.view(np.uint16)
        for (peer, q), queue in buf.lanes.queues.items():
            assert queue.head < queue.depth
            rings[f"ring {channels} {lanes} {peer} {q}"] = _job_free(queue, queue.sq_words[:queue.head].copy())
        buf.close()
    np.savez(os.path.join(out_dir, f"pe{me}.npz"), **rings)
    shmemx.finalize()


def test_batched_rounds_post_the_same_wqes(run_ok, tmp_path):
    """A multi-channel call run by block 0 alone leaves the same WQE bytes in every send queue, in the same order,
    and the same outputs, as the blocks splitting the work (``Buffer.split_blocks``)."""
    n = 4
    modes = ("split", "batch")
    for mode in modes:
        (tmp_path / mode).mkdir()
        run_ok(n, _batched_rings_job, mode, str(tmp_path / mode), timeout=120)
    for pe in range(n):
        each, *others = (np.load(tmp_path / mode / f"pe{pe}.npz") for mode in modes)
        for mode, batch in zip(modes[1:], others):
            assert sorted(each.files) == sorted(batch.files)
            for key in each.files:
                np.testing.assert_array_equal(each[key], batch[key], err_msg=f"pe {pe}: {mode}: {key}")


def _one_cqe_job():
    """A closing unit asks for its completion's CQE alone (``Lanes.one_cqe_bbs``: half the ring): every payload
    WRITE of a call goes without a CQE, every WRITE_WITH_NOTIFY (notify's record, the lanes' completions, fenced)
    with one, the quiets take exactly those; with ``one_cqe_bbs`` 0 every WQE asks for one, and the results are
    the same bits."""
    from shmemx.udma.layout import Opcode

    shmemx.init(sq_depth=1024)
    me, n = shmemx.my_pe(), shmemx.n_pes()
    x, idx, w = _inputs(me, n)
    outs = []
    for one_cqe_bbs in (512, 0):
        buf = moe.Buffer(T, H, K, E)
        assert buf.lanes.one_cqe_bbs == 512
        buf.lanes.one_cqe_bbs = one_cqe_bbs
        queue = buf.lanes.queues[(me + 1) % n, 0]
        head, cqes = queue.head, queue.cqe_cnt
        res = buf.dispatch(x, topk_idx=idx, topk_weights=w)
        outs.append(buf.combine(res.recv_x, res.handle, topk_weights=res.recv_topk_weights)[0].view(np.uint16))
        kinds, asked = [], 0
        pos = head
        while pos < queue.head:
            word = int(queue.sq_words[pos % queue.depth, 0])
            opcode, flag = word >> 40 & 0xFF, word >> 16 & 0xFF
            kinds.append((opcode, bool(flag & 0x20)))
            asked += bool(flag & 0x20)
            pos += 2 if opcode == Opcode.WRITE_WITH_NOTIFY else 1
        assert queue.cqe_cnt - cqes == asked
        writes = [c for op, c in kinds if op == Opcode.WRITE]
        assert writes and all(c for op, c in kinds if op == Opcode.WRITE_WITH_NOTIFY), kinds
        assert not any(writes) if one_cqe_bbs else all(writes), kinds
        buf.close()
    np.testing.assert_array_equal(outs[0], outs[1])
    shmemx.finalize()


def test_closing_units_ask_for_one_cqe(run_ok):
    run_ok(4, _one_cqe_job, timeout=120)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_dispatch_combine_against_reference(run_ok, n):
    """Both ways of sharing a lane (batched, the default, and rounds) on every CI schedule."""
    run_ok(n, _moe_job, CI_SCHEDULES[n], ["random"], True, False, ("batch", "rounds"), (False, True), timeout=150)


@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("split", [False, True])
def test_edge_routings_and_errors(run_ok, n, split):
    """Tokens routed nowhere, every token to one expert, a PE that sends nothing; overflow and bad input; with
    the blocks splitting the work and with block 0 doing it all (``Lanes.one_block``)."""
    run_ok(n, _moe_job, [Schedule("two_3_1", True, True)], ["one_expert", "silent"], False, True, ("batch",),
           (split,), timeout=150)


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4, 8])
def test_every_schedule(run_ok, n):
    run_ok(n, _moe_job, ALL_SCHEDULES, ["random"], False, False, timeout=900)


# --- the demo and the benchmark, as users run them -----------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent


def _clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("SHMEMX_")}


@pytest.mark.parametrize("n", [2, 8])
def test_moe_demo_through_shmemx_run(n):
    """The README's main demo: every rank prints PASS, rank 0 the summary (WQEs and bytes per QP, times)."""
    cmd = [sys.executable, "-m", "shmemx", "run", "-n", str(n), "--timeout", "60",
           str(ROOT / "scripts" / "examples" / "moe_demo.py"), "--tokens", "64", "--hidden", "256"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90, env=_clean_env())
    report = f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert proc.returncode == 0, report
    passed = {int(m.group(1)) for m in re.finditer(r"^\[pe (\d+)\] PASS: sent \d+ rows", proc.stdout, re.M)}
    assert passed == set(range(n)) and "FAIL" not in proc.stdout, report
    assert re.search(r"dispatch: \d+ rows received in all; per QP qp0 \d+ WQEs [\d.]+ MB, qp1 \d+ WQEs", proc.stdout)
    assert "slowest block ms: route" in proc.stdout, report


def test_bench_moe_quick_prints_one_table():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_moe.py"), "--quick", "--no-cam"],
                          capture_output=True, text=True, timeout=180, env=_clean_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "MPI Alltoallv baseline: skipped (mpi4py is not importable)" in out or "MPI Alltoallv" in out
    for name in ("one, agg, 4 ch", "one, per-token, 4 ch", "four_rr, agg, 4 ch", "four_rr, per-token, 4 ch",
                 "copy lower bound"):
        assert re.search(rf"^{re.escape(name)} ", out, re.M), out
    assert re.search(r"^four_rr, agg, 4 ch .* \d+/\d+/\d+/\d+ ", out, re.M), out  # WQEs on each of 4 QPs
    assert re.search(r"^bar: best dispatch \+ combine = [\d.]+x .*: (PASS|MISS)$", out, re.M), out
    assert "dispatch slowest block per phase" in out
