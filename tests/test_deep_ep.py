"""``shmemx.deep_ep`` (DeepEP's legacy API) and the defaults that make ``moe.Buffer(T, H, K, E)`` run as is.

Pure parts (configs, hints, events, the tensor bridge, the test helpers, the internode heads and layouts) are
tested without a job. Multi-rank tests check every engine with numpy against the plain-numpy references, with
payloads that encode their origin (``moe.reference.origin_x``): intranode (``moe.Buffer``), internode (2 servers
x 2 and x 4: seed 003's notify, the two-tier dispatch, DeepEP's two-rounding combine, the handle's fields
recomputed here from every rank's routing), low latency (the packed layout, FP8 / UE8M0, hooks, both halves).
DeepEP's own tests, ported (``scripts/deep_ep``), run at CI size through ``shmemx run -n 8`` (torch installed).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import shmemx
from shmemx import deep_ep
from shmemx.deep_ep import reference as dref
from shmemx.deep_ep import utils
from shmemx.deep_ep.event import EventHandle, EventOverlap
from shmemx.deep_ep.internode import RowLayout, _head, plan_internode
from shmemx.deep_ep.intranode import fit_tokens
from shmemx.deep_ep.low_latency import LL_ALIGN_SLACK, ll_layout
from shmemx.deep_ep.tensors import Converter, to_numpy
from shmemx.kernels import moe
from shmemx.kernels.moe import reference as ref
from shmemx.kernels.moe.routing import channel_bounds

ROOT = Path(__file__).resolve().parent.parent
bf16, FP8 = ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn
T, H, K, E = 40, 256, 4, 32


def _inputs(rank: int, n_tok: int = T, none_rate: float = 0.1):
    rng = np.random.default_rng(500 + rank)
    idx = np.argsort(rng.random((n_tok, E)), axis=1)[:, :K].astype(np.int64)
    idx[rng.random((n_tok, K)) < none_rate] = -1
    return ref.origin_x(rank, n_tok, H), idx, (rng.random((n_tok, K)) + 0.5).astype(np.float32)


def _same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.tobytes() == b.tobytes()


# --- pure parts ------------------------------------------------------------------------------------------------


def test_config_is_checked_and_tables_are_deepeps():
    c = deep_ep.Config(24, 8, 256, 16, 100)
    assert c.num_max_rdma_chunked_recv_tokens == 112 and c.num_channels == 12  # rounded up to the send chunk
    for bad in ((24, 8, 8), (24, 0, 256), (24, 8, 256, 16, 16), (-2, 6, 256)):
        with pytest.raises(ValueError):
            deep_ep.Config(*bad)
    assert deep_ep.Buffer.get_dispatch_config(8) == deep_ep.Config(20, 6, 256, 6, 128)
    assert deep_ep.Buffer.get_combine_config(16) == deep_ep.Config(20, 4, 288, 12, 128)
    with pytest.raises(ValueError, match="no default config for 6 ranks"):
        deep_ep.Buffer.get_dispatch_config(6)
    with pytest.raises(ValueError, match="even"):
        deep_ep.Buffer.set_num_sms(23)


def test_size_hints_follow_deepeps_formulas():
    # DeepEP's LowLatencyLayout at N=128, H=7168, E=256: 1,908,410,496 bytes (reference/deepep.md 1.2)
    assert deep_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256) == 1_908_410_496
    c = deep_ep.Config()
    assert c.get_rdma_buffer_size_hint(7168 * 2, 8) == 0  # one server: no RDMA ring
    nvl = c.get_nvl_buffer_size_hint(7168 * 2, 8)
    per_slot = 7168 * 2 + 8 + 128 * 8 + 128 * 4 + 128 * 4
    assert nvl == -(-(10 * 8 * (2 * 1 + 3) * 4 + 10 * 8 * 256 * per_slot) // 128) * 128
    assert c.get_rdma_buffer_size_hint(7168 * 2, 16) > 0 and nvl % 128 == 0
    # the low-latency workspace fits in the hint it is sized by (but for region alignment in tiny shapes)
    for n_tok, hidden, ranks, experts in ((128, 7168, 8, 288), (16, 512, 4, 16), (1, 2048, 2, 2)):
        layout = ll_layout(ranks, n_tok, hidden, experts)
        hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(n_tok, hidden, ranks, experts)
        assert layout.total <= hint + LL_ALIGN_SLACK and (n_tok == 1 or layout.total <= hint)


def test_events_are_complete():
    ev = deep_ep.Buffer.capture()
    assert isinstance(ev, EventOverlap) and isinstance(ev.event, EventHandle)
    ran = []
    ev.register_hook_after_wait(lambda: ran.append(1))
    with pytest.raises(ValueError, match="already registered"):
        ev.register_hook_after_wait(lambda: None)
    ev.current_stream_wait()
    assert ran == [1]
    with ev(release_handle=True):
        pass
    assert ev.event is None
    with pytest.raises(ValueError, match="holds no event"):
        ev.current_stream_wait()


def test_numpy_stays_numpy():
    arrays = (np.arange(6, dtype=np.int64), np.zeros((2, 3), bf16))
    conv = Converter(*arrays)
    assert not conv.torch and all(conv.out(a) is a for a in arrays)
    assert to_numpy(None) is None and to_numpy([1, 2]).tolist() == [1, 2]


def test_torch_tensors_cross_without_copies():
    torch = pytest.importorskip("torch")
    for dtype, np_dtype in ((torch.bfloat16, bf16), (torch.float8_e4m3fn, FP8), (torch.int64, np.int64),
                            (torch.bool, np.bool_)):
        t = torch.zeros((4, 3), dtype=torch.float32).to(dtype)
        a = to_numpy(t)
        assert a.dtype == np.dtype(np_dtype) and a.ctypes.data == t.data_ptr()  # a view, not a copy
        back = Converter(t).out(a)
        assert back.dtype == dtype and back.data_ptr() == t.data_ptr()
    strided = torch.randn(8, 5).T  # column-major views cross too
    assert to_numpy(strided).strides == (4, 20)


def test_torch_is_never_imported_by_shmemx():
    code = "import sys, shmemx, shmemx.deep_ep, shmemx.deep_ep.utils; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_test_helpers():
    rng = np.random.default_rng(3)
    x = rng.integers(-1, 6, size=(50, 7))
    want = [sorted({v for v in row if v >= 0}, reverse=True) for row in x]
    utils.inplace_unique(x, 6)
    for row, w in zip(x, want):
        assert row[:len(w)].tolist() == w and (row[len(w):] == -1).all()
    y = rng.standard_normal((9, 300)).astype(bf16)
    data, scales = utils.per_token_cast_to_fp8(y)
    assert data.dtype == FP8 and scales.shape == (9, 3)
    assert utils.calc_diff(utils.per_token_cast_back(data, scales), y) < 1e-3
    assert utils.calc_diff(y, y) == pytest.approx(0, abs=1e-12)
    ue8m0 = np.full((2, 1), 127 | 128 << 8 | 126 << 16 | 127 << 24, np.uint32).view(np.int32)  # 1, 2, 0.5, 1
    back = utils.per_token_cast_back(np.ones((2, 512), FP8), ue8m0).astype(np.float32)
    assert back[0, ::128].tolist() == [1, 2, 0.5, 1]
    assert utils.hash_tensor(np.arange(4, dtype=np.int32)) == 6
    scores = np.ones((2, 8), np.float32)
    grouped = utils.create_grouped_scores(scores, np.array([[1], [3]]), 4)
    assert grouped.tolist() == [[0, 0, 1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 1, 1]]


def test_heads_count_within_channels():
    rng = np.random.default_rng(4)
    mask = rng.random((23, 3)) < 0.5
    bounds = channel_bounds(23, 4)
    head = _head(mask, bounds)
    for c in range(4):
        for d in range(3):
            lo, hi = bounds[c], bounds[c + 1]
            sel = np.flatnonzero(mask[lo:hi, d])
            assert head[lo:hi, d][sel].tolist() == list(range(len(sel)))
    assert (head[~mask] == -1).all()


def test_internode_workspace_fits_its_budgets():
    rows = RowLayout(7168, 8)
    assert rows.bytes % 16 == 0 and rows.weights + 32 <= rows.bytes and rows.scales == 14336
    layout, rdma, nvl = plan_internode(n_pes=8, server_size=4, max_tokens=64, hidden=256, num_topk=4, num_experts=32,
                                       num_channels=4, rdma_qps=2)
    assert rdma + nvl <= layout.total <= rdma + nvl + 1024
    tokens = fit_tokens(10 << 20, lambda m: plan_internode(
        n_pes=8, server_size=4, max_tokens=m, hidden=256, num_topk=4, num_experts=32, num_channels=4,
        rdma_qps=2)[2])
    size = plan_internode(n_pes=8, server_size=4, max_tokens=tokens, hidden=256, num_topk=4, num_experts=32,
                          num_channels=4, rdma_qps=2)[2]
    assert size <= 10 << 20 and tokens > 500


def test_two_tier_reference_rounds_twice():
    """Two servers of two: a token of rank 0 sent to ranks 0, 1 (server 0) and 2 (server 1) comes back as
    bf16(bf16(x0 + x1) + x2) (DeepEP's forwarder rounds), not bf16(x0 + x1 + x2)."""
    idx = [np.array([[0, 8, 16]])] + [np.zeros((0, 3), np.int64)] * 3
    rows = [np.full((1, 1), v, np.float32).astype(bf16) for v in (1.0, 2 ** -10, 2 ** -8)] + [np.zeros((0, 1), bf16)]
    two_tier, _ = dref.reference_internode_combine(rows, idx, 32, 0, 2)
    one_sum, _ = ref.reference_combine(rows, idx, 32, 0)
    assert float(two_tier[0, 0]) == 1.0  # 1 + 2^-10 rounds to 1 at the forwarder; 1 + 2^-8 to 1 (even)
    assert float(one_sum[0, 0]) == 1.0078125  # 1 + 2^-10 + 2^-8 is past the midpoint


# --- the defaults: a plain init and moe.Buffer(T, H, K, E) -----------------------------------------------------


def _plain_defaults_job():
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    assert shmemx.heap_info().size == 1 << 30 and shmemx.qp_num() == 1
    buf = moe.Buffer(T, H, K, E)
    allin = [_inputs(r) for r in range(n)]
    x, idx, w = allin[me]
    res = buf.dispatch(x, topk_idx=idx, topk_weights=w)
    want = ref.reference_dispatch([a[0] for a in allin], [a[1] for a in allin], [a[2] for a in allin], E, me)
    assert _same(res.recv_x.view(np.uint16), want.recv_x.view(np.uint16))
    assert _same(res.recv_topk_idx, want.recv_topk_idx)
    comb = buf.combine(res.recv_x, res.handle, res.recv_topk_weights)
    recv = [ref.reference_dispatch([a[0] for a in allin], [a[1] for a in allin], None, E, r).recv_x for r in range(n)]
    assert _same(comb.combined_x.view(np.uint16), ref.reference_combine(recv, [a[1] for a in allin], E, me)[0]
                 .view(np.uint16))
    buf.close()


@pytest.mark.parametrize("n", [2, 4, 8])
def test_plain_init_and_default_buffer_run(run_ok, n):
    run_ok(n, _plain_defaults_job, timeout=120)


def test_heap_larger_than_dev_shm_is_a_clear_error():
    total = os.statvfs("/dev/shm").f_blocks * os.statvfs("/dev/shm").f_frsize
    with pytest.raises(shmemx.HeapExhaustedError, match="cannot be backed by /dev/shm"):
        shmemx.init(heap_size=total + (1 << 30))
    assert not shmemx.is_initialized()
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"shmemx_{os.getpid():x}")]  # nothing left behind


def test_prefault_that_tmpfs_cannot_back_raises(monkeypatch):
    import errno

    from shmemx.shm.segment import Segment

    seg = Segment(f"shmemx_test{os.getpid():x}_prefault", 1 << 20, create=True)
    try:
        class Full:
            def madvise(self, *args):
                raise OSError(errno.EFAULT, "Bad address")

        monkeypatch.setattr(seg, "mm", Full())
        with pytest.raises(shmemx.HeapExhaustedError, match="cannot back 1048576 B"):
            seg.prefault()
    finally:
        monkeypatch.undo()
        seg.close()
        os.unlink(seg.path)


# --- intranode with numpy --------------------------------------------------------------------------------------


def _intranode_job():
    buf = deep_ep.Buffer(None, int(1e8))  # initialises shmemx itself
    me, n = buf.rank, buf.group_size
    allin = [_inputs(r) for r in range(n)]
    x, idx, w = allin[me]
    per_rank, per_rdma, per_expert, in_rank, event = buf.get_dispatch_layout(idx, E)
    assert per_rdma is None and isinstance(event, EventOverlap)
    out = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                       topk_idx=idx, topk_weights=w, expert_alignment=4)
    assert len(out) == 6 and isinstance(out[4], deep_ep.IntranodeHandle) and isinstance(out[5], EventOverlap)
    recv_x, recv_idx, recv_w, counts, handle, _ = out
    want = ref.reference_dispatch([a[0] for a in allin], [a[1] for a in allin], [a[2] for a in allin], E, me,
                                  expert_alignment=4)
    assert _same(recv_x.view(np.uint16), want.recv_x.view(np.uint16)) and counts == want.num_recv_tokens_per_expert_list
    assert _same(handle.rank_prefix_matrix, want.rank_prefix_matrix) and _same(handle.recv_src_idx, want.recv_src_idx)
    cached = buf.dispatch(x, handle=handle)
    assert cached[1:5] == (None, None, None, None) and _same(cached[0].view(np.uint16), recv_x.view(np.uint16))
    bias = (ref.origin_x(me + 7, T, H), ref.origin_x(me + 9, T, H))
    combined, weights, _ = buf.combine(recv_x, handle, topk_weights=recv_w, bias=bias)
    recv = [ref.reference_dispatch([a[0] for a in allin], [a[1] for a in allin], None, E, r).recv_x for r in range(n)]
    plain = ref.reference_combine(recv, [a[1] for a in allin], E, me)[0]
    with_bias = (bias[0].astype(np.float32) + bias[1].astype(np.float32))
    mask = in_rank
    for r in range(n):  # the bias first, then the ranks in ascending order, in float32
        toks = np.flatnonzero(mask[:, r])
        start = int(want.rank_prefix_matrix[me - 1, r]) if me else 0
        rows = ref.reference_dispatch([a[0] for a in allin], [a[1] for a in allin], None, E, r).recv_x
        with_bias[toks] += rows[start:start + len(toks)].astype(np.float32)
    assert _same(combined.view(np.uint16), with_bias.astype(bf16).view(np.uint16))
    assert not _same(combined.view(np.uint16), plain.view(np.uint16))
    worst = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                         topk_idx=idx, topk_weights=w, num_worst_tokens=T * n)
    assert worst[3] == [] and len(worst[0]) == T * n and (worst[1][len(recv_x):] == -1).all()
    with pytest.raises(ValueError, match="allocate_on_comm_stream"):
        buf.dispatch(x, handle=handle, allocate_on_comm_stream=True)
    fp8 = ref.per_token_cast_to_fp8(x)
    got = buf.dispatch((fp8[0], np.asfortranarray(fp8[1])), handle=handle)[0]
    assert got[0].dtype == FP8 and _same(got[1], ref.reference_dispatch(
        [ref.per_token_cast_to_fp8(a[0]) for a in allin], [a[1] for a in allin], None, E, me).recv_x[1])


@pytest.mark.parametrize("n", [2, 4])
def test_intranode_against_reference(run_ok, n):
    run_ok(n, _intranode_job, timeout=120)


# --- internode -------------------------------------------------------------------------------------------------


def _internode_expected(allin: list, me: int, server_size: int, num_channels: int):
    """The internode handle's fields of rank ``me``, computed from every rank's routing."""
    n = len(allin)
    servers = n // server_size
    lays = [moe.get_dispatch_layout(a[1], E, n) for a in allin]
    in_rank = lays[me].is_token_in_rank
    in_server = in_rank.reshape(len(in_rank), servers, server_size).any(2)
    bounds = channel_bounds(len(in_rank), num_channels)
    counts = np.array([[in_server[bounds[c]:bounds[c + 1], b].sum() for c in range(num_channels)]
                       for b in range(servers)])
    a, lane = divmod(me, server_size)
    fwd = [lays[b * server_size + lane].is_token_in_rank for b in range(servers)]  # what I forward, per source
    forwarded = [f.reshape(len(f), servers, server_size)[:, a].any(1).sum() for f in fwd]
    received = [lays[i].num_tokens_per_rank[me] for i in range(n)]
    per_rank = np.array([[in_rank[bounds[c]:bounds[c + 1], r].sum() for c in range(num_channels)] for r in range(n)])
    from_sources = []  # per source server b: channel prefix of what (b, lane) sends to server a
    for f in fwd:
        to_me = f.reshape(len(f), servers, server_size)[:, a].any(1)
        fb = channel_bounds(len(f), num_channels)
        from_sources.append(np.cumsum([to_me[fb[c]:fb[c + 1]].sum() for c in range(num_channels)]))
    head = np.full(in_server.shape, -1)
    for c in range(num_channels):
        for b in range(servers):
            k = 0
            for t in range(bounds[c], bounds[c + 1]):
                if in_server[t, b]:
                    head[t, b], k = k, k + 1
    return {"rdma_channel_prefix_matrix": np.cumsum(counts, axis=1), "gbl_channel_prefix_matrix":
            np.cumsum(per_rank, axis=1), "recv_rdma_channel_prefix_matrix": np.array(from_sources),
            "recv_rdma_rank_prefix_sum": np.cumsum(forwarded), "recv_gbl_rank_prefix_sum": np.cumsum(received),
            "send_rdma_head": head}


def _internode_job(server_size: int):
    buf = deep_ep.Buffer(None, int(2e8), int(1e8), server_size=server_size)
    me, n = buf.rank, buf.group_size
    assert buf.num_rdma_ranks == n // server_size > 1
    allin = [_inputs(r) for r in range(n)]
    x, idx, w = allin[me]
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    assert per_rdma.tolist() == in_rank.reshape(T, -1, server_size).any(2).sum(0).tolist()
    want = ref.reference_dispatch([a[0] for a in allin], [a[1] for a in allin], [a[2] for a in allin], E, me)
    recv = [ref.reference_dispatch([a[0] for a in allin], [a[1] for a in allin], [a[2] for a in allin], E, r)
            for r in range(n)]
    for rep in range(2):  # twice: the second reuses every region after the credits
        recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
        assert isinstance(handle, deep_ep.InternodeHandle) and len(handle) == 10
        assert _same(recv_x.view(np.uint16), want.recv_x.view(np.uint16))
        assert _same(recv_idx, want.recv_topk_idx) and _same(recv_w, want.recv_topk_weights)
        assert counts == want.num_recv_tokens_per_expert_list
        for name, value in _internode_expected(allin, me, server_size, buf._normal.num_channels).items():
            assert _same(getattr(handle, name), value.astype(np.int32)), name
        meta = handle.recv_src_meta.view(np.int32)  # SourceMeta: source server, mask of this server's ranks
        assert _same(meta[:, 0], want.recv_src_rank // server_size)
        assert ((meta[:, 1] >> (me % server_size)) & 1).all()
        starts = handle.recv_gbl_channel_prefix_matrix
        assert (np.diff(starts, axis=1) >= 0).all() and _same(starts[:, 0], np.concatenate(
            [[0], handle.recv_gbl_rank_prefix_sum[:-1]]).astype(np.int32))
        ys = [ref.origin_x(r + 3, len(recv[r].recv_src_idx), H) for r in range(n)]
        bias = (ref.origin_x(me + 20, T, H), ref.origin_x(me + 30, T, H))
        combined, weights, _ = buf.combine(ys[me], handle, topk_weights=recv_w, bias=bias)
        want_x, want_w = dref.reference_internode_combine(ys, [a[1] for a in allin], E, me, server_size,
                                                          recv_topk_weights=[r.recv_topk_weights for r in recv],
                                                          bias=bias)
        assert _same(combined.view(np.uint16), want_x.view(np.uint16))
        np.testing.assert_allclose(weights, want_w, rtol=1e-6)
        cached = buf.dispatch(x, handle=handle)[0]
        assert _same(cached.view(np.uint16), want.recv_x.view(np.uint16))
    worst = buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                         num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, num_worst_tokens=T * n)
    assert worst[3] == [] and len(worst[0]) == T * n and _same(worst[0][:len(want.recv_x)].view(np.uint16),
                                                               want.recv_x.view(np.uint16))
    # low-latency calls on the same Buffer (both live in num_rdma_bytes: one workspace at a time), then normal again
    recv_ll, count, _, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
    want_ll = dref.reference_low_latency_dispatch([a[0] for a in allin], [a[1] for a in allin], E, me, use_fp8=False)
    for e, (rows, _, _) in enumerate(want_ll):
        assert _same(recv_ll[e, :int(count[e])].view(np.uint16), rows.view(np.uint16))
    again = buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                         num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    assert _same(again[0].view(np.uint16), want.recv_x.view(np.uint16))


@pytest.mark.parametrize("n, server_size", [(4, 2), (8, 4)])
def test_internode_against_reference(run_ok, n, server_size):
    run_ok(n, _internode_job, server_size, timeout=180)


def test_barrier_block_timeout_names_rank_and_slot(run_ok):
    """Rank 0 enters barrier_block, rank 1 does not (until later): the timeout names rank 0's slot 1."""
    run_ok(2, _barrier_timeout_two_ranks, timeout=60)


def _barrier_timeout_two_ranks():
    import time

    from shmemx.deep_ep.notify import Tiers, barrier_block

    shmemx.init(timeout=2.0)
    me = shmemx.my_pe()
    slots = shmemx.zeros(2, np.int32, name="barrier")
    tiers = Tiers(me, 2, 2, {"barrier": slots}, 1)
    if me == 0:
        with pytest.raises(shmemx.WaitTimeoutError, match=r"rank = 0, thread = 1, value = 1024"):
            barrier_block(tiers)
    else:
        time.sleep(3.0)  # rank 1 stays away past rank 0's 2 s deadline (not a synchronisation: an absence)
    shmemx.aclshmem_barrier_all()


# --- low latency -----------------------------------------------------------------------------------------------


def _low_latency_job():
    n_max, hidden, experts, k = 12, 512, 16, 3
    n = int(os.environ["SHMEMX_SIZE"])
    buf = deep_ep.Buffer(None, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(n_max, hidden, n, experts),
                         low_latency_mode=True, num_qps_per_rank=experts // n)
    me = buf.rank
    local = experts // n
    rng = [np.random.default_rng(40 + r) for r in range(n)]
    xs = [(rng[r].standard_normal((n_max - r % 2, hidden)) * (r + 1)).astype(bf16) for r in range(n)]
    idxs = [np.argsort(rng[r].random((len(xs[r]), experts)), 1)[:, :k].astype(np.int64) for r in range(n)]
    for r in range(n):
        idxs[r][0, 0] = -1
    x, idx = xs[me], idxs[me]
    weights = np.abs(np.random.default_rng(me).standard_normal(idx.shape)).astype(np.float32)
    for use_fp8, round_scale, ue8m0 in ((False, False, False), (True, False, False), (True, True, True)):
        stats = np.zeros(local, np.int32)
        recv_x, count, handle, _, hook = buf.low_latency_dispatch(
            x, idx, n_max, experts, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=ue8m0,
            cumulative_local_expert_recv_stats=stats, return_recv_hook=True)
        assert count.sum() == 0  # nothing received before the hook
        hook()
        want = dref.reference_low_latency_dispatch(xs, idxs, experts, me, use_fp8=use_fp8, round_scale=round_scale)
        assert _same(stats, count)
        for e in range(local):
            rows, src, per_src = want[e]
            m = int(count[e])
            assert m == len(src) and _same(handle.layout_range[e] & 0xFFFFFFFF, per_src)
            assert _same(handle.layout_range[e] >> 32, np.cumsum(per_src) - per_src)
            assert _same(handle.src_info[e, :m], src)
            if use_fp8:
                assert recv_x[1].strides[1] == 4 and _same(recv_x[0][e, :m].view(np.uint8), rows[0].view(np.uint8))
                if ue8m0:
                    exps = ((rows[1].view(np.uint32) >> 23) & 0xFF).astype(np.uint8).reshape(m, -1)
                    assert _same(np.ascontiguousarray(recv_x[1][e, :m]).view(np.uint8), exps)
                else:
                    assert _same(recv_x[1][e, :m], rows[1])
            else:
                assert _same(recv_x[e, :m].view(np.uint16), rows.view(np.uint16))
        expert_out = np.zeros((local, n * n_max, hidden), bf16)
        for e in range(local):
            m = int(count[e])
            expert_out[e, :m] = (np.arange(m)[:, None] % 7 + e + me).astype(bf16)  # a row says (expert, slot)
        for zero_copy in (False, True):
            if zero_copy:
                buf.get_next_low_latency_combine_buffer(handle)[...] = expert_out
            out = np.empty((len(x), hidden), bf16)
            combined, _, hook = buf.low_latency_combine(expert_out, idx, weights, handle, zero_copy=zero_copy, out=out)
            assert combined is out and hook is None
            gathered = utils.all_gather(np.ascontiguousarray(expert_out).view(np.uint16)).view(bf16)
            infos = utils.all_gather(np.asarray(handle.src_info))
            rows = [dict() for _ in range(experts)]
            for owner in range(n):
                for e in range(local):
                    ranges = utils.all_gather(np.asarray(handle.layout_range))[owner, e]
                    b, c = int(ranges[me] >> 32), int(ranges[me] & 0xFFFFFFFF)
                    for j in range(c):
                        rows[owner * local + e][int(infos[owner, e, b + j])] = gathered[owner, e, b + j]
            assert _same(combined.view(np.uint16),
                         dref.reference_low_latency_combine(rows, idx, weights, experts, me).view(np.uint16))
    # at most two calls in flight: a third on the half of an un-received call is refused
    buf.low_latency_dispatch(x, idx, n_max, experts, return_recv_hook=True)
    _, _, _, _, hook2 = buf.low_latency_dispatch(x, idx, n_max, experts, return_recv_hook=True)
    with pytest.raises(RuntimeError, match="at most two calls may be in flight"):
        buf.low_latency_dispatch(x, idx, n_max, experts)


@pytest.mark.parametrize("n", [2, 4])
def test_low_latency_against_reference(run_ok, n):
    run_ok(n, _low_latency_job, timeout=120)


# --- construction: heap, groups, server sizes ------------------------------------------------------------------


def _construction_job():
    shmemx.init(heap_size="64M")
    with pytest.raises(shmemx.HeapExhaustedError, match=r"needs \d+ B of symmetric heap.*--heap-size"):
        deep_ep.Buffer(None, int(1e9))
    with pytest.raises(ValueError, match="not a whole number of servers of 3"):
        deep_ep.Buffer(None, int(1e6), server_size=3)

    class Group:  # a process group of another shape
        def rank(self):
            return 0

        def size(self):
            return 1

    with pytest.raises(TypeError, match="group must be None, a shmemx team or a torch.distributed ProcessGroup"):
        deep_ep.Buffer(Group(), int(1e6))
    buf = deep_ep.Buffer(None, int(1e7), explicitly_destroy=True)
    buf.destroy()
    with pytest.raises(shmemx.ClosedError):
        buf.get_dispatch_layout(np.zeros((1, 1), np.int64), 4)


def test_construction_errors(run_ok):
    run_ok(4, _construction_job, timeout=60)


def _torch_group_job(init_file: str):
    import torch
    import torch.distributed as dist

    me, n = int(os.environ["SHMEMX_RANK"]), int(os.environ["SHMEMX_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=me, world_size=n)
    buf = deep_ep.Buffer(dist.group.WORLD, int(1e8), num_qps_per_rank=1)
    x, idx, w = _inputs(me)
    xt, idxt, wt = (torch.from_numpy(x.view(np.int16)).view(torch.bfloat16), torch.from_numpy(idx),
                    torch.from_numpy(w))
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idxt, E)
    recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(xt, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                          num_tokens_per_expert=per_expert, topk_idx=idxt,
                                                          topk_weights=wt)
    assert recv_x.dtype == torch.bfloat16 and isinstance(handle[0], torch.Tensor) and recv_idx.dtype == torch.int64
    allin = [_inputs(r) for r in range(n)]
    want = ref.reference_dispatch([a[0] for a in allin], [a[1] for a in allin], None, E, me)
    assert _same(to_numpy(recv_x).view(np.uint16), want.recv_x.view(np.uint16))
    combined, weights, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
    assert combined.dtype == torch.bfloat16 and weights.dtype == torch.float32
    dist.destroy_process_group()


def test_a_torch_distributed_group_is_accepted(run_ok, tmp_path):
    pytest.importorskip("torch")
    run_ok(2, _torch_group_job, str(tmp_path / "gloo_init"), timeout=120)


# --- DeepEP's own tests, ported, through the real command ------------------------------------------------------

_CI_SIZES = {
    "test_intranode.py": ["--num-tokens", "64", "--hidden", "256", "--num-topk", "4", "--num-experts", "32",
                          "--no-tune"],
    "test_internode.py": ["--num-tokens", "64", "--hidden", "256", "--num-topk", "4", "--num-experts", "32",
                          "--no-tune"],
    "test_low_latency.py": ["--num-tokens", "16", "--hidden", "512", "--num-topk", "4", "--num-experts", "16",
                            "--no-bench"],
}


@pytest.mark.parametrize("script", sorted(_CI_SIZES))
def test_ported_deepep_test_at_8_ranks(script):
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHMEMX_")}
    cmd = [sys.executable, "-m", "shmemx", "run", "-n", "8", "--timeout", "400",
           str(ROOT / "scripts" / "deep_ep" / script), *_CI_SIZES[script]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=480, env=env)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert f"{script[:-3]}: PASS" in proc.stdout
