"""CAM window-mode moe_dispatch_normal / moe_combine_normal against the plain-numpy reference.

Payloads encode their origin: row t of rank r holds (r, t, iteration) in its first three elements and the triple
(r, t, k) travels in the row, so a misrouted byte is caught; expert outputs depend on the topk slot and the top-k
weights are all different, so a row summed into the wrong (token, slot) changes the combined token.

Shapes are CI-sized (H = 1024, bs <= 8, K = 3 or 4, E = 2-3 experts per rank), with aiv_num = 3 so that both the
token split and the status split leave remainders. The window is the smallest that passes the seed's check.
"""

from __future__ import annotations

import time

import ml_dtypes
import numpy as np
import pytest

import shmemx
from shmemx.kernels import cam
from shmemx.kernels.cam import constants as C

BF16 = ml_dtypes.bfloat16
H, MAX_BS = 1024, 8
HEAP = "440M"  # >= needed_mb(MAX_BS, 4, H) = 417 MB window + 1 MB Exp window + the test's arrays


# --- inputs and the reference -----------------------------------------------------------------------------------


def _inputs(it: int, rank: int, R: int, K: int, E: int, dtype=BF16, skew: str = ""):
    """Tokens, routing and weights of ``rank`` in iteration ``it`` (every rank can rebuild every rank's)."""
    rng = np.random.default_rng([it, rank, R, K, E])
    bs = MAX_BS if rank % 3 else int(rng.integers(1, MAX_BS + 1))  # ranks with fewer tokens
    x = rng.standard_normal((bs, H), np.float32).astype(dtype)
    x[:, 0], x[:, 1], x[:, 2] = rank, np.arange(bs), it
    if skew == "one_expert":  # every token of every rank to expert 1 (and K-1 others)
        topk = np.stack([np.concatenate([[1], rng.choice(np.delete(np.arange(E), 1), K - 1, replace=False)])
                         for _ in range(bs)])
    else:
        topk = np.stack([rng.choice(E, K, replace=False) for _ in range(bs)])
    w = (rng.permutation(bs * K).reshape(bs, K).astype(np.float32) + 1) / (bs * K)  # all different
    return x, topk.astype(np.int32), w


def _expert(recv_x: np.ndarray, assist: np.ndarray) -> np.ndarray:
    """A deterministic 'expert': depends on the row and on its topk slot."""
    k = assist.reshape(-1, 3)[:, 2].astype(np.float32)
    return (recv_x.astype(np.float32) * 0.5 + (k + 1)[:, None]).astype(recv_x.dtype)


def _check_pair(ctx, it, R, K, E, *, quant_mode=0, dtype=BF16, skew="", diagnose=False):
    """One dispatch + combine on every rank, each checked against the reference; returns both outputs."""
    me = shmemx.my_pe()
    every = [_inputs(it, r, R, K, E, dtype, skew) for r in range(R)]
    x, topk, w = every[me]
    route = cam.notify_dispatch(ctx, topk, E)
    for got, want in zip(route, cam.reference.reference_notify([e[1] for e in every], E)[me]):
        np.testing.assert_array_equal(got, want)
    d = cam.moe_dispatch_normal(ctx, x, topk, *route, moe_expert_num=E, global_bs=MAX_BS * R,
                                quant_mode=quant_mode, diagnose=diagnose)
    ref = cam.reference.reference_dispatch([e[0] for e in every], [e[1] for e in every], E, quant_mode)
    mine = ref[me]
    assert d.recv_x.dtype == mine["recv_x"].dtype and d.recv_x.shape == mine["recv_x"].shape
    assert d.recv_x.tobytes() == mine["recv_x"].tobytes(), f"pe {me} iteration {it}: received rows differ"
    np.testing.assert_array_equal(d.assist_info_for_combine, mine["assist_info_for_combine"])
    np.testing.assert_array_equal(d.recv_counts, mine["recv_counts"])
    np.testing.assert_array_equal(d.expert_token_nums, mine["recv_counts"].sum(axis=1))
    np.testing.assert_array_equal(d.ep_recv_counts, route.recv_count)
    if quant_mode:
        assert d.x_scales.tobytes() == mine["x_scales"].tobytes()
    assert d.data_state == it % 2 and d.flags_written == E
    rows = [r["recv_x"] if not quant_mode else cam.dequantize_for_combine(r["recv_x"], r["x_scales"]) for r in ref]
    expert_out = [_expert(r, ref[i]["assist_info_for_combine"]) for i, r in enumerate(rows)]
    y = _expert(d.recv_x if not quant_mode else cam.dequantize_for_combine(d.recv_x, d.x_scales),
                d.assist_info_for_combine)
    c = cam.moe_combine_normal(ctx, y, d.assist_info_for_combine, d.ep_recv_counts, w, moe_expert_num=E,
                               global_bs=MAX_BS * R, diagnose=diagnose)
    want = cam.reference.reference_combine(expert_out, [r["assist_info_for_combine"] for r in ref],
                                           [e[2] for e in every])[me]
    _assert_within_bf16_rounding(c.x, want, f"pe {me} iteration {it}: combine")
    assert c.magic == it % 2 and c.flags_written == len(d.recv_x)
    return d, c


def _assert_within_bf16_rounding(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """At most one unit in the last place of the output dtype apart (the kernel is in fact bit-exact here)."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    g, w = got.view(np.int16).astype(np.int32), want.view(np.int16).astype(np.int32)
    ulps = np.abs(g - w)
    assert ulps.max(initial=0) <= 1, f"{what}: {int((ulps > 1).sum())} elements off by more than one ulp"


def _ctx(K=4, **kw):
    return cam.WindowContext(hccl_buffsize=cam.needed_mb(MAX_BS, K, H), **kw)


def _flag_areas(ctx, R, K, E):
    """Views of this rank's dispatch flag slots (per half ``[E, 8]``) and combine flag slots (``[MAX_BS*K, 8]``)."""
    exp = ctx.ep.local_windows_exp
    disp = [exp[h * C.WIN_STATE_OFFSET:h * C.WIN_STATE_OFFSET + E * 32].view(np.float32).reshape(E, 8)
            for h in (0, 1)]
    comb = [ctx.get_state_addr_by_rank_id(ctx.ep_rank_id, h, MAX_BS * K * 32).view(np.float32).reshape(-1, 8)
            for h in (0, 1)]
    return disp, comb


# --- no job needed: constants, layout, rounding, quantisation, tiling messages ----------------------------------


def test_constants_are_the_seeds():
    assert C.NOTIFY_DISPATCH_BUFF_OFFSET == 213_909_504 and C.COMBINE_STATE_WIN_OFFSET == 4 * 1024 * 1024
    assert (C.WIN_STATE_OFFSET, C.STATE_WIN_OFFSET, C.MAGIC_WIN_OFFSET) == (512_000, 972_800, 998_400)
    assert (C.WIN_ADDR_ALIGN, C.WIN_512_ALIGN, C.STATE_OFFSET, C.UB_ALIGN, C.FLOAT_NUM_PER_ALIGN) == (512, 512, 32,
                                                                                                    32, 8)
    assert (C.K_MAX, C.H_MIN, C.H_MAX, C.MOE_EXPERT_MAX_NUM, C.BS_UPPER_BOUND) == (16, 1024, 7168, 512, 8000)
    assert (C.MAX_EP_WORLD_SIZE, C.MAX_TP_WORLD_SIZE, C.DISPATCH_STATUS_MAX_SUPPORT_NUM) == (384, 2, 1280)
    assert (C.TILINGKEY_NO_QUANT, C.TILINGKEY_QUANT, C.CYCLE_TO_TIME, C.MAGIC_MASK) == (10000, 10002, 50,
                                                                                          0xFFFFFFFF00000000)
    assert cam.tiling.tiling_key(2, 0) == C.TILINGKEY_QUANT and cam.tiling.tiling_key(0, 2) == 10100


@pytest.mark.parametrize("h, out_size, ub, triple, idx_size, row, comb", [
    (7168, 2, 14336, 14368, 14380, 14848, 14336), (7168, 1, 7168, 7200, 7212, 7680, 14336),
    (4096, 2, 8192, 8224, 8236, 8704, 8192), (4096, 1, 4096, 4128, 4140, 4608, 8192),
    (1024, 2, 2048, 2080, 2092, 2560, 2048), (7000, 2, 14016, 14048, 14060, 14336, 14336)])
def test_row_layout(h, out_size, ub, triple, idx_size, row, comb):
    lay = cam.DispatchLayout(h, out_size)
    assert (lay.h_ub_align_size, lay.h_scale_size_align, lay.h_scale_idx_size, lay.h_out_gm_align_size,
            lay.h512_align_recv_x_len) == (ub, triple, idx_size, row, comb)
    assert lay.expand_idx_start_idx * 4 == triple


@pytest.mark.parametrize("max_bs, k, h, mb", [(16, 8, 7168, 424), (128, 8, 4096, 450), (4096, 8, 7168, 2241),
                                              (8000, 16, 7168, 7542)])
def test_needed_window_size(max_bs, k, h, mb):
    assert cam.needed_mb(max_bs, k, h) == mb


def test_split_is_the_seeds():
    for total in (0, 1, 5, 16, 37):
        for blocks in (1, 3, 4, 48):
            parts = [cam.split(total, blocks, b) for b in range(blocks)]
            assert parts[0][0] == 0 and parts[-1][1] == total
            assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
            sizes = [e - s for s, e in parts]
            assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1


def test_bf16_cast_is_round_to_nearest_even():
    # float32 bit patterns exactly halfway between two bfloat16 values round to the even one
    halfway = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x40498000], np.uint32).view(np.float32)
    assert cam.to_bf16(halfway).view(np.uint16).tolist() == [0x3F80, 0x3F82, 0xBF80, 0x404A]
    above = np.array([0x3F808001], np.uint32).view(np.float32)
    assert cam.to_bf16(above).view(np.uint16).tolist() == [0x3F81]
    bits = np.random.default_rng(1).integers(0, 0x7F000000, 100_000, dtype=np.uint32)
    rne = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    np.testing.assert_array_equal(cam.to_bf16(bits.view(np.float32)).view(np.uint16), rne)


def test_dynamic_quant():
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((64, H), np.float32) * rng.random((64, 1), np.float32) * 10).astype(BF16)
    x[3] = 0
    q, scale = cam.dynamic_quant(x)
    xf = x.astype(np.float32)
    amax = np.abs(xf).max(axis=1)
    ds = np.float32(127) / (amax + np.float32(1e-12))
    np.testing.assert_array_equal(q, np.rint(xf * ds[:, None]).astype(np.int8))
    np.testing.assert_array_equal(scale, np.float32(1) / ds)
    assert np.abs(q).max() <= 127 and not q[3].any() and 0 < scale[3] < 1e-14
    live = amax > 0
    np.testing.assert_allclose(scale[live], amax[live] / 127, rtol=1e-6)
    # the documented int8 tolerance: half a quantisation step per element
    err = np.abs(cam.dequantize(q, scale) - xf)
    assert (err <= scale[:, None] * 0.5 * (1 + 1e-5)).all()


def _dispatch_info(**kw):
    base = dict(ep_world_size=8, tp_world_size=0, ep_rank_id=0, tp_rank_id=0, moe_expert_num=256, quant_mode=0,
                global_bs=128, bs=16, k=8, h=7168, aiv_num=2, total_win_size=424 << 20)
    base.update(kw)
    return cam.MoeDispatchNormalInfo(**base)


def _combine_info(**kw):
    base = dict(ep_world_size=8, tp_world_size=0, ep_rank_id=0, tp_rank_id=0, moe_expert_num=256, global_bs=128,
                bs=16, k=8, h=7168, aiv_num=2, total_win_size=424 << 20)
    base.update(kw)
    return cam.MoeCombineNormalInfo(**base)


DISPATCH_ERRORS = [
    (dict(k=17), "expertIdShape's dim1(k) should be in (0, min(16, moeExpertNum=256)], but got "
                 "expertIdShape's dim1(k)=17."),
    (dict(k=0), "but got expertIdShape's dim1(k)=0."),
    (dict(moe_expert_num=8, k=9, ep_world_size=8), "(0, min(16, moeExpertNum=8)], but got expertIdShape's dim1(k)=9."),
    (dict(h=1023), "xShape dims1(H) should be in [1024, 7168], but got 1023."),
    (dict(h=7169), "xShape dims1(H) should be in [1024, 7168], but got 7169."),
    (dict(moe_expert_num=520), "moeExpertNum is invalid, only support (0, 512], but got moeExpertNum=520."),
    (dict(moe_expert_num=0), "moeExpertNum is invalid, only support (0, 512], but got moeExpertNum=0."),
    (dict(bs=8001, global_bs=8001 * 8), "xDim0(BS) is invalid. Should be between [1, 8000], but got xDim0=8001."),
    (dict(bs=0), "xDim0(BS) is invalid. Should be between [1, 8000], but got xDim0=0."),
    (dict(ep_world_size=385, moe_expert_num=385), "epWorldSize is invalid, only support [2, 384], but got "
                                                  "epWorldSize=385."),
    (dict(ep_world_size=1), "epWorldSize is invalid, only support [2, 384], but got epWorldSize=1."),
    (dict(tp_world_size=3), "tpWorldSize is invalid, only support [0, 2], but got tpWorldSize=3."),
    (dict(tp_world_size=2, tp_rank_id=2), "tpRankId is invalid, only support [0, 2), but got tpRankId=2."),
    (dict(tp_rank_id=1), "tpRankId is invalid, NoTp mode only support 0, but got tpRankId=1."),
    (dict(ep_rank_id=8), "epRankId is invalid, only support [0, 8), but got epRankId=8."),
    (dict(moe_expert_num=250), "moeExpertNum should be divisible by epWorldSize, but moeExpertNum=250, "
                               "epWorldSize=8."),
    (dict(quant_mode=3), "quantMode is invalid, only support [0, 2], but got quantMode=3."),
    (dict(quant_mode=1), "quantMode=1 (static quant) has no window-mode kernel"),
    (dict(global_bs=0), "globalBS is invalid, should be positive, but got globalBS=0."),
    (dict(bs=17), "bs=17 exceeds globalBS / epWorldSize = 128 / 8 = 16"),
    (dict(topk_rows=15), "xShape's dim0 not equal to expertIdShape's dim0, xShape's dim0 is 16, expertIdShape's "
                         "dim0 is 15."),
    (dict(x_dtype=np.float32), "x dataType is invalid, dataType should be bf16 or float16, but is float32."),
    (dict(total_win_size=200 << 20), "HCCL_BUFFSIZE is too SMALL, maxBs = 16, h = 7168, epWorldSize = 8, "
                                     "localMoeExpertNum = 32, tokenNeedSizeDispatch = 14848, tokenNeedSizeCombine "
                                     "= 14336, k = 8, (maxBs * k * (tokenNeedSizeDispatch + tokenNeedSizeCombine) + "
                                     "4MB + 204MB) * 2 = 443678720 B: NEEDED_HCCL_BUFFSIZE=424MB, "
                                     "HCCL_BUFFSIZE=200MB."),
    (dict(total_win_size=423 << 20), "NEEDED_HCCL_BUFFSIZE=424MB, HCCL_BUFFSIZE=423MB."),
]


@pytest.mark.parametrize("change, message", DISPATCH_ERRORS, ids=[str(c) for c, _ in DISPATCH_ERRORS])
def test_dispatch_tiling_errors(change, message):
    with pytest.raises(cam.TilingError) as err:
        cam.check_dispatch_tiling(_dispatch_info(**change))
    assert message in str(err.value)
    assert str(err.value).startswith("pe ") and "MoeDispatchNormal tiling: " in str(err.value)


def test_tiling_accepts_the_limits():
    cam.check_dispatch_tiling(_dispatch_info())  # 424 MB is exactly enough
    cam.check_dispatch_tiling(_dispatch_info(k=16, h=1024, moe_expert_num=512, ep_world_size=2, global_bs=32,
                                             total_win_size=1 << 30, quant_mode=2, tp_world_size=2, tp_rank_id=1))
    assert cam.check_combine_tiling(_combine_info(global_bs=0)) == 16 * 8


COMBINE_ERRORS = [
    (dict(k=17), "topkWeights's dim1(K) should be in (0, min(16, moeExpertNum=256)], but got topkWeights's "
                 "dim1(K)=17."),
    (dict(h=512), "recvX's dim1(H) should be in [1024, 7168], but got 512."),
    (dict(bs=9000), "Invalid topkWeights dims0(BS) 9000. Should be between [1, 8000]."),
    (dict(global_bs=100), "globalBS is invalid, only support 0 or maxBs(maxBs is the largest bs on all ranks) * "
                          "epWorldSize, but got globalBS=100, bs=16, epWorldSize=8."),
    (dict(recv_x_dtype=np.int8), "recvX dataType is invalid, dataType should be bf16 or float16, but is int8."),
    (dict(ep_recv_counts_len=100), "Invalid sendCount dims0 100. Should not be smaller than 256."),
    (dict(token_src_info_len=5, recv_rows=2), "Invalid srcInfo dims0 5. Should not be smaller than 6."),
    (dict(moe_expert_num=250), "moeExpertNum should be divisible by epWorldSize, but got moeExpertNum=250, "
                               "epWorldSize=8."),
    (dict(total_win_size=200 << 20), "HCCL_BUFFSIZE is too SMALL, maxBs = 16, h = 7168, epWorldSize = 8, "
                                     "localMoeExpertNum = 32, tokenNeedSizeCombine = 14336, k = 8, (maxBs * k * "
                                     "tokenNeedSizeCombine + 4MB + 204MB) * 2 = 439877632 B: "
                                     "NEEDED_HCCL_BUFFSIZE=420MB, HCCL_BUFFSIZE=200MB."),
]


@pytest.mark.parametrize("change, message", COMBINE_ERRORS, ids=[str(c) for c, _ in COMBINE_ERRORS])
def test_combine_tiling_errors(change, message):
    with pytest.raises(cam.TilingError) as err:
        cam.check_combine_tiling(_combine_info(**change))
    assert message in str(err.value) and "MoeCombineNormal tiling: " in str(err.value)


# --- jobs ----------------------------------------------------------------------------------------------------------


def _pairs(K, e_loc, iterations, skews):
    shmemx.init()
    R = shmemx.n_pes()
    ctx = _ctx(K, aiv_num=3)
    for it in range(iterations):
        _check_pair(ctx, it, R, K, e_loc * R, skew=skews[it % len(skews)])
    # an fp16 pair too (XType float16: rows and the combine output keep it)
    _check_pair(ctx, iterations, R, K, e_loc * R, dtype=np.float16)
    ctx.close()


@pytest.mark.parametrize("R", [2, 4, 8])
def test_dispatch_and_combine_match_the_reference(run_ok, R):
    run_ok(R, _pairs, 4 if R < 8 else 3, 2 if R < 8 else 3, 3, ["", "one_expert"], heap_size=HEAP, timeout=90)


def _errors_through_the_op():
    shmemx.init()
    me, R = shmemx.my_pe(), shmemx.n_pes()
    x, topk, w = _inputs(0, me, R, 3, 2 * R)
    with cam.WindowContext(aiv_num=2) as small:  # the seed's default HCCL_BUFFSIZE: 200 MB
        route = cam.notify_dispatch(small, topk, 2 * R)
        with pytest.raises(cam.TilingError, match=r"HCCL_BUFFSIZE is too SMALL, .* NEEDED_HCCL_BUFFSIZE=417MB, "
                                                  r"HCCL_BUFFSIZE=200MB\."):
            cam.moe_dispatch_normal(small, x, topk, *route, moe_expert_num=2 * R, global_bs=MAX_BS * R)
    ctx = _ctx(3, aiv_num=2)
    route = cam.notify_dispatch(ctx, topk, 2 * R)
    wide = np.repeat(topk, 6, axis=1)[:, :17]
    with pytest.raises(cam.TilingError, match=r"expertIdShape's dim1\(k\) should be in \(0, min\(16, "
                                              r"moeExpertNum=\d+\)\], but got expertIdShape's dim1\(k\)=17\."):
        cam.moe_dispatch_normal(ctx, x, wide, *route, moe_expert_num=2 * R, global_bs=MAX_BS * R)
    with pytest.raises(cam.TilingError, match=r"xShape dims1\(H\) should be in \[1024, 7168\], but got 1000\."):
        cam.moe_dispatch_normal(ctx, x[:, :1000], topk, *route, moe_expert_num=2 * R, global_bs=MAX_BS * R)
    with pytest.raises(ValueError, match=r"tp_world_size=2 does not match the WindowContext \(1\)"):
        cam.moe_dispatch_normal(ctx, x, topk, *route, moe_expert_num=2 * R, global_bs=MAX_BS * R, tp_world_size=2,
                                tp_rank_id=0)
    with pytest.raises(ValueError, match=r"expert id -1 outside \[0, 4\)"):
        cam.notify_dispatch(ctx, np.full_like(topk, -1), 2 * R)
    with pytest.raises(ValueError, match=r"recv_x_out must be a C-contiguous bfloat16 array"):
        cam.moe_dispatch_normal(ctx, x, topk, *route, moe_expert_num=2 * R, global_bs=MAX_BS * R,
                                recv_x_out=np.zeros((1, H), BF16))
    # none of the failed calls touched the windows: a real pair still works (and uses half 0)
    d = cam.moe_dispatch_normal(ctx, x, topk, *route, moe_expert_num=2 * R, global_bs=MAX_BS * R)
    assert d.data_state == 0
    with pytest.raises(cam.TilingError, match=r"topkWeights's dim1\(K\) should be in \(0, min\(16, "):
        cam.moe_combine_normal(ctx, d.recv_x, d.assist_info_for_combine, d.ep_recv_counts, np.ones((len(x), 17),
                               np.float32), moe_expert_num=2 * R, global_bs=MAX_BS * R)
    c = cam.moe_combine_normal(ctx, d.recv_x, d.assist_info_for_combine, d.ep_recv_counts, w, moe_expert_num=2 * R,
                               global_bs=MAX_BS * R)
    assert c.magic == 0
    ctx.close()


def test_tiling_errors_through_the_ops(run_ok):
    run_ok(2, _errors_through_the_op, heap_size="660M", timeout=60)


def _quant_and_diagnose(K, E_loc):
    shmemx.init()
    me, R = shmemx.my_pe(), shmemx.n_pes()
    ctx = _ctx(K, aiv_num=2, tp_world_size=2)
    assert (ctx.tp_rank_id, ctx.tp.rank_size, ctx.tp.pes) == (me % 2, 2, [me - me % 2, me - me % 2 + 1])
    assert ctx.context(C.COMM_TP_IDX) is ctx.tp and ctx.context(C.COMM_EP_IDX) is ctx.ep
    for it in range(2):
        d, c = _check_pair(ctx, it, R, K, E_loc * R, quant_mode=2, diagnose=True)
        # int8 path: dequantised rows are within half a quantisation step of the tokens they came from
        x_src = np.stack([_inputs(it, int(s), R, K, E_loc * R)[0][int(t)]
                          for s, t, _ in d.assist_info_for_combine.reshape(-1, 3)])
        err = np.abs(cam.dequantize(d.recv_x, d.x_scales) - x_src.astype(np.float32))
        assert (err <= d.x_scales[:, None] * 0.5 * (1 + 1e-5)).all()
        for stats in (d.wait_recv_cost_stats, c.send_cost_stats):
            assert stats.shape == (R,) and stats.dtype == np.int32 and (stats >= 0).all()
    # CAM's optional outputs are added into, not overwritten
    x, topk, w = _inputs(5, me, R, K, E_loc * R)
    acc_d, acc_c = np.full(R, 7, np.int32), np.full(R, 9, np.int32)
    route = cam.notify_dispatch(ctx, topk, E_loc * R)
    d = cam.moe_dispatch_normal(ctx, x, topk, *route, moe_expert_num=E_loc * R, global_bs=MAX_BS * R,
                                wait_recv_cost_stats=acc_d)
    c = cam.moe_combine_normal(ctx, d.recv_x, d.assist_info_for_combine, d.ep_recv_counts, w,
                               moe_expert_num=E_loc * R, global_bs=MAX_BS * R, send_cost_stats=acc_c)
    assert d.wait_recv_cost_stats is acc_d and (acc_d >= 7).all() and c.send_cost_stats is acc_c
    assert (acc_c >= 9).all()
    ctx.close()


def test_int8_path_diagnose_and_tp_context(run_ok):
    run_ok(4, _quant_and_diagnose, 3, 2, heap_size="880M", timeout=60)


def _twenty_iterations(K, E_loc, iterations):
    """Free-running pairs (no barrier between them) with random per-rank delays: ranks drift apart."""
    shmemx.init()
    me, R = shmemx.my_pe(), shmemx.n_pes()
    ctx = _ctx(K, aiv_num=3)
    rng = np.random.default_rng(me)
    for it in range(iterations):
        if rng.random() < 0.3:
            time.sleep(rng.random() * 0.02)  # skew only: correctness never depends on it
        _check_pair(ctx, it, R, K, E_loc * R, skew="one_expert" if it % 5 == 4 else "")
    shmemx.aclshmem_barrier_all()
    disp, comb = _flag_areas(ctx, R, K, E_loc * R)
    assert not any(a.any() for a in disp + comb), "a flag was left behind"
    ctx.close()


def test_twenty_iterations_without_stale_flags(run_ok):
    run_ok(8, _twenty_iterations, 3, 2, 20, heap_size=HEAP, timeout=120)


def _poisoned_other_half(K, E_loc, iterations):
    """Each pair consumes exactly its own half's flags: the other half, poisoned with 1.0f, is never read."""
    shmemx.init()
    me, R = shmemx.my_pe(), shmemx.n_pes()
    E = E_loc * R
    ctx = _ctx(K, aiv_num=3)
    disp, comb = _flag_areas(ctx, R, K, E)
    for it in range(iterations):
        used, other = it % 2, 1 - it % 2
        disp[other][:], comb[other][:] = 1.0, 1.0
        shmemx.aclshmem_barrier_all()
        _check_pair(ctx, it, R, K, E)
        shmemx.aclshmem_barrier_all()
        assert (disp[other] == 1.0).all() and (comb[other] == 1.0).all(), f"iteration {it} touched the other half"
        assert not disp[used].any() and not comb[used].any(), f"iteration {it} left a flag in its own half"
        disp[other][:], comb[other][:] = 0.0, 0.0
    ctx.close()


def test_each_pair_consumes_exactly_its_own_half(run_ok):
    run_ok(4, _poisoned_other_half, 3, 2, 4, heap_size=HEAP, timeout=60)


def _stale_flag_is_accepted_and_caught(K, E_loc):
    """Negative control: a flag left in the half a dispatch uses DOES release it early (the sum protocol cannot
    tell), and the origin-encoded rows then catch the data that was never sent. This is why every reader clears."""
    shmemx.init()
    me, R = shmemx.my_pe(), shmemx.n_pes()
    E = E_loc * R
    ctx = _ctx(K, aiv_num=2)
    go = shmemx.zeros(1, np.int32, name="go")
    _check_pair(ctx, 0, R, K, E)  # half 0, clean
    disp, _ = _flag_areas(ctx, R, K, E)
    every = [_inputs(1, r, R, K, E) for r in range(R)]
    x, topk, w = every[me]
    route = cam.notify_dispatch(ctx, topk, E)
    if me == 1:
        shmemx.aclshmem_wait_until(go, shmemx.ACLSHMEM_CMP_EQ, 1)  # pe 0 dispatches before pe 1 starts
    else:
        disp[1][1::R] = 1.0  # stale flags in half 1 from source rank 1: (local expert le, src 1) slots
    d = cam.moe_dispatch_normal(ctx, x, topk, *route, moe_expert_num=E, global_bs=MAX_BS * R)
    want = cam.reference.reference_dispatch([e[0] for e in every], [e[1] for e in every], E)[me]
    from_1 = want["assist_info_for_combine"].reshape(-1, 3)[:, 0] == 1
    if me == 0:
        assert from_1.any() and not from_1.all()
        assert d.recv_x[~from_1].tobytes() == want["recv_x"][~from_1].tobytes()  # pe 0's own rows were there
        assert d.recv_x[from_1].tobytes() != want["recv_x"][from_1].tobytes(), \
            "the stale flags released pe 0 before pe 1 wrote its rows, yet pe 1's rows look right"
        shmemx.aclshmemx_signal_op(go, 1, shmemx.ACLSHMEM_SIGNAL_SET, 1)
    else:
        assert d.recv_x.tobytes() == want["recv_x"].tobytes()  # pe 1 waited for real flags
    shmemx.aclshmem_barrier_all()
    disp[1][:] = 0.0  # pe 1's late flags to pe 0 are the leftovers of this broken call
    shmemx.aclshmem_barrier_all()
    ctx.close()


def test_a_stale_flag_would_be_caught(run_ok):
    run_ok(2, _stale_flag_is_accepted_and_caught, 3, 3, heap_size=HEAP, timeout=60)


def _missing_sender_is_named():
    from shmemx.runtime import runtime

    shmemx.init()
    me, R = shmemx.my_pe(), shmemx.n_pes()
    ctx = _ctx(3, aiv_num=2)
    x, topk, w = _inputs(0, me, R, 3, 2 * R)
    route = cam.notify_dispatch(ctx, topk, 2 * R)
    if me == 0:  # pe 1 never dispatches: pe 0's WaitStatus must say which flags are missing
        runtime().timeout = 1.5  # this PE's wait deadline only (pe 1 waits in the barrier meanwhile)
        with pytest.raises(shmemx.WaitTimeoutError, match=r"pe 0: moe_dispatch_normal WaitStatus \(block \d, half "
                                                          r"0, slots \d\.\.\d\): 1 flag missing: \(local expert "
                                                          r"\d, src rank 1\); .*wait_until_any on 16 words at "
                                                          r"'HCCL windowsExp EP'\+0x[0-9a-f]+ \(pe 0\) != \[") as err:
            cam.moe_dispatch_normal(ctx, x, topk, *route, moe_expert_num=2 * R, global_bs=MAX_BS * R)
        assert "np.int32(" not in str(err.value)  # the values print as plain numbers
        runtime().timeout = 30.0
    shmemx.aclshmem_barrier_all()
    ctx.close()


def test_a_missing_sender_is_named_in_the_timeout(run_ok):
    run_ok(2, _missing_sender_is_named, heap_size=HEAP, timeout=30)


# --- as a user runs them ---------------------------------------------------------------------------------------

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def test_demo_passes_on_8_ranks_through_shmemx_run(python):
    import subprocess

    out = subprocess.run([python, "-m", "shmemx", "run", "-n", "8", "--heap-size", "440M", "--timeout", "60",
                          str(ROOT / "scripts/examples/cam_moe_demo.py")], capture_output=True, text=True,
                         timeout=90)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("PASS: pe") == 8 and "FAIL" not in out.stdout


def test_bench_quick_prints_its_table(python):
    import subprocess

    out = subprocess.run([python, str(ROOT / "scripts/bench_cam.py"), "--quick", "--deepep"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "CAM window mode (bf16, aiv 1)" in out.stdout and "pair/bound" in out.stdout
    # the same-run comparison against DeepEP's best configuration (1 channel, zero copy) by default
    assert "DeepEP-style (one, 1 ch, zero copy)" in out.stdout and "DeepEP-style (bytes, 1 ch, zero copy)" in out.stdout
    assert "median of per-iteration ratios" in out.stdout
