"""Host tiling of the two ops: row layouts, work splitting, and every check the seed lists, with CAM's messages.

The checks run on the host before the kernel is launched, as ``moe_dispatch_normal_tiling.cpp`` /
``moe_combine_normal_tiling.cpp`` do; a failing one raises ``TilingError`` (a ``ValueError``) whose message is
``pe <pe>: <Op> tiling: <CAM message>``, naming the value and the limit. The limits are the seed's (section 9.6);
the message texts are the CAM sources' (the seed quotes only the window one, which is kept verbatim:
``HCCL_BUFFSIZE is too SMALL, ... NEEDED_HCCL_BUFFSIZE=%luMB, HCCL_BUFFSIZE=%luMB.``).

Row layouts (seed 2.3, 3.4; the kernel's formula, not the "Ceil(h*2 + 44, 512)" of the seed's drawing, README A6)::

    hUBAlignSize    = Ceil(H * osz, 32) * 32          token payload, padded to 32 B (osz = 2 bf16/fp16, 1 int8)
    hScaleSizeAlign = hUBAlignSize + 32               + a 32 B scale slot (float32 dynamicScale in its first 4 B)
    hScaleIdxSize   = hScaleSizeAlign + 3 * 4         + the (epRankId, tokenIndex, topkIdx) int32 triple
    hOutGMAlignSize = Ceil(hScaleIdxSize, 512) * 512  row stride in the window; only hScaleIdxSize is copied
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from .constants import (BS_UPPER_BOUND, COMBINE_STATE_WIN_OFFSET, DISPATCH_STATUS_MAX_SUPPORT_NUM,
                        DOUBLE_DATA_BUFFER, EXPAND_IDX_INFO, H_MAX, H_MIN, K_MAX, MAX_EP_WORLD_SIZE,
                        MAX_OUT_DTYPE_SIZE, MAX_TP_WORLD_SIZE, MB, MB_SIZE, MIN_EP_WORLD_SIZE, MOE_EXPERT_MAX_NUM,
                        NOTIFY_DISPATCH_WIN_OFFSET, QUANT_MODE_DYNAMIC, QUANT_MODE_NONE, SCALE_EXPAND_IDX_BUFFER,
                        TILINGKEY_NO_QUANT, UB_ALIGN, WIN_512_ALIGN, WIN_ADDR_ALIGN, align_up)

__all__ = ["TilingError", "DispatchLayout", "MoeDispatchNormalInfo", "MoeCombineNormalInfo", "split",
           "check_dispatch_tiling", "check_combine_tiling", "window_needed_bytes", "needed_mb", "X_DTYPES",
           "tiling_key", "check_context"]

BF16 = np.dtype(ml_dtypes.bfloat16)
X_DTYPES = (BF16, np.dtype(np.float16))


class TilingError(ValueError):
    """A tiling check failed: the message names the op, the value and the limit."""


@dataclass(frozen=True)
class DispatchLayout:
    """Byte sizes of one dispatch row and one combine row for hidden size ``h``.

    Args:
        h: hidden size.
        out_size: ``sizeof(ExpandXOutType)``: 2 for bf16/fp16, 1 for int8 (DynamicQuant).
        x_size: ``sizeof(XType)`` (2).
    """

    h: int
    out_size: int = 2
    x_size: int = 2

    @property
    def h_ub_align_size(self) -> int:
        return align_up(self.h * self.out_size, UB_ALIGN)

    @property
    def h_scale_size_align(self) -> int:
        return self.h_ub_align_size + UB_ALIGN

    @property
    def expand_idx_start_idx(self) -> int:
        """int32 index of the triple inside a row."""
        return self.h_scale_size_align // 4

    @property
    def h_scale_idx_size(self) -> int:
        return self.h_scale_size_align + EXPAND_IDX_INFO * 4

    @property
    def h_out_gm_align_size(self) -> int:
        return align_up(self.h_scale_idx_size, WIN_ADDR_ALIGN)

    @property
    def h_size_align_combine(self) -> int:
        """Dispatch's name for the combine row stride: ``Ceil(H * sizeof(XType), 512) * 512``."""
        return align_up(self.h * self.x_size, WIN_ADDR_ALIGN)

    @property
    def h512_align_recv_x_len(self) -> int:
        """Combine's name for the same stride: ``Ceil(H * sizeof(RecvXType), 512) * 512``."""
        return align_up(self.h * self.x_size, WIN_512_ALIGN)


def split(total: int, block_num: int, block_idx: int) -> tuple[int, int]:
    """The seed's block split (``SplitCoreCal`` and its dispatch twins): ``[start, end)`` of block ``block_idx``.

    ``total // block_num`` items each, the first ``total % block_num`` blocks one more.
    """
    per, remain = divmod(total, block_num)
    start = per * block_idx
    if block_idx < remain:
        per += 1
        start += block_idx
    else:
        start += remain
    return start, start + per


def tiling_key(quant_mode: int, tp_world_size: int) -> int:
    """``10000 + quantMode``, +100 with TP 2 (CAM sources): 10000 non-quant, 10002 DynamicQuant."""
    return TILINGKEY_NO_QUANT + quant_mode + (100 if tp_world_size == 2 else 0)


@dataclass
class _OpInfo:
    """What both ops' tiling data hold: the op attributes (EP / TP domains) and the shapes the host checks."""

    ep_world_size: int
    tp_world_size: int
    ep_rank_id: int
    tp_rank_id: int
    moe_expert_num: int
    global_bs: int
    bs: int
    k: int
    h: int
    aiv_num: int
    total_win_size: int


def op_attrs(ctx, ep_world_size: int | None, ep_rank_id: int | None, tp_world_size: int | None,
             tp_rank_id: int | None) -> dict[str, int]:
    """The four domain attributes of an op call, each the context's where the caller gave None (a value that
    differs from the context is checked by the tiling and then rejected)."""
    return dict(ep_world_size=ctx.ep_world_size if ep_world_size is None else ep_world_size,
                tp_world_size=ctx.tp_world_size if tp_world_size is None else tp_world_size,
                ep_rank_id=ctx.ep_rank_id if ep_rank_id is None else ep_rank_id,
                tp_rank_id=ctx.tp_rank_id if tp_rank_id is None else tp_rank_id)


@dataclass
class MoeDispatchNormalInfo(_OpInfo):
    """The dispatch tiling data (seed 8.1, ``MoeDispatchNormalInfo``), plus what the host checks need."""

    quant_mode: int
    is_enable_diagnose: bool = False
    topk_rows: int | None = None  # rows of topk_idx (must equal bs)
    x_dtype: np.dtype | None = None

    @property
    def is_quant(self) -> bool:
        return self.quant_mode == QUANT_MODE_DYNAMIC


@dataclass
class MoeCombineNormalInfo(_OpInfo):
    """The combine tiling data, plus what the host checks need (``global_bs`` 0 means ``bs * epWorldSize``)."""

    recv_x_dtype: np.dtype | None = None
    ep_recv_counts_len: int | None = None
    token_src_info_len: int | None = None
    recv_rows: int | None = None  # rows of recv_x that combine will send (epRecvCount[E-1])
    is_enable_diagnose: bool = False


def _fail(pe: int, op: str, message: str) -> None:
    raise TilingError(f"pe {pe}: {op} tiling: {message}")


def _check_domains(info, op: str) -> None:
    pe, R, tp = info.ep_rank_id, info.ep_world_size, info.tp_world_size
    if not MIN_EP_WORLD_SIZE <= R <= MAX_EP_WORLD_SIZE:
        _fail(pe, op, f"epWorldSize is invalid, only support [{MIN_EP_WORLD_SIZE}, {MAX_EP_WORLD_SIZE}], but got "
                      f"epWorldSize={R}.")
    if not 0 <= tp <= MAX_TP_WORLD_SIZE:
        _fail(pe, op, f"tpWorldSize is invalid, only support [0, {MAX_TP_WORLD_SIZE}], but got tpWorldSize={tp}.")
    if not 0 <= info.ep_rank_id < R:
        _fail(pe, op, f"epRankId is invalid, only support [0, {R}), but got epRankId={info.ep_rank_id}.")
    if tp > 1 and not 0 <= info.tp_rank_id < tp:
        _fail(pe, op, f"tpRankId is invalid, only support [0, {tp}), but got tpRankId={info.tp_rank_id}.")
    if tp <= 1 and info.tp_rank_id != 0:
        _fail(pe, op, f"tpRankId is invalid, NoTp mode only support 0, but got tpRankId={info.tp_rank_id}.")
    E = info.moe_expert_num
    if not 0 < E <= MOE_EXPERT_MAX_NUM:
        _fail(pe, op, f"moeExpertNum is invalid, only support (0, {MOE_EXPERT_MAX_NUM}], but got moeExpertNum={E}.")


def window_needed_bytes(max_bs: int, k: int, h: int, *, combine_only: bool = False) -> int:
    """Seed 8.2's ``actualSize``: ``(maxBs*k*(tokenNeedSizeCombine + tokenNeedSizeDispatch) + 4 MB + 204 MB) * 2``.

    ``combine_only`` drops the dispatch term (the combine op's own check). The tiling assumes 2 B per element
    even for int8 rows, as the seed's ``h * 2`` does.
    """
    token_actual_len = align_up(h * MAX_OUT_DTYPE_SIZE, UB_ALIGN) + SCALE_EXPAND_IDX_BUFFER
    need_dispatch = 0 if combine_only else align_up(token_actual_len, WIN_ADDR_ALIGN)
    need_combine = align_up(h * MAX_OUT_DTYPE_SIZE, WIN_ADDR_ALIGN)
    return (max_bs * k * (need_combine + need_dispatch) + COMBINE_STATE_WIN_OFFSET
            + NOTIFY_DISPATCH_WIN_OFFSET) * DOUBLE_DATA_BUFFER


def _check_window(info, op: str, max_bs: int, combine_only: bool) -> None:
    actual = window_needed_bytes(max_bs, info.k, info.h, combine_only=combine_only)
    if actual <= info.total_win_size:
        return
    token_actual_len = align_up(info.h * MAX_OUT_DTYPE_SIZE, UB_ALIGN) + SCALE_EXPAND_IDX_BUFFER
    need_dispatch = align_up(token_actual_len, WIN_ADDR_ALIGN)
    need_combine = align_up(info.h * MAX_OUT_DTYPE_SIZE, WIN_ADDR_ALIGN)
    local = info.moe_expert_num // info.ep_world_size
    if combine_only:
        sizes, formula = (f"tokenNeedSizeCombine = {need_combine}, ",
                          "(maxBs * k * tokenNeedSizeCombine + 4MB + 204MB) * 2")
    else:
        sizes, formula = (f"tokenNeedSizeDispatch = {need_dispatch}, tokenNeedSizeCombine = {need_combine}, ",
                          "(maxBs * k * (tokenNeedSizeDispatch + tokenNeedSizeCombine) + 4MB + 204MB) * 2")
    _fail(info.ep_rank_id, op,
          f"HCCL_BUFFSIZE is too SMALL, maxBs = {max_bs}, h = {info.h}, epWorldSize = {info.ep_world_size}, "
          f"localMoeExpertNum = {local}, {sizes}k = {info.k}, {formula} = {actual} B: "
          f"NEEDED_HCCL_BUFFSIZE={actual // MB_SIZE + 1}MB, HCCL_BUFFSIZE={info.total_win_size // MB_SIZE}MB.")


def _check_shape_limits(info, op: str, h_name: str, k_name: str) -> None:
    pe, E = info.ep_rank_id, info.moe_expert_num
    if not H_MIN <= info.h <= H_MAX:
        _fail(pe, op, f"{h_name} should be in [{H_MIN}, {H_MAX}], but got {info.h}.")
    if not 0 < info.k <= min(K_MAX, E):
        _fail(pe, op, f"{k_name} should be in (0, min({K_MAX}, moeExpertNum={E})], but got {k_name}={info.k}.")


def check_dispatch_tiling(info: MoeDispatchNormalInfo) -> None:
    """Every host check of ``moe_dispatch_normal``; raises ``TilingError`` on the first that fails."""
    op, pe = "MoeDispatchNormal", info.ep_rank_id
    _check_domains(info, op)
    R, E = info.ep_world_size, info.moe_expert_num
    if info.quant_mode not in (QUANT_MODE_NONE, 1, QUANT_MODE_DYNAMIC):
        _fail(pe, op, f"quantMode is invalid, only support [0, {QUANT_MODE_DYNAMIC}], but got "
                      f"quantMode={info.quant_mode}.")
    if info.quant_mode == 1:
        _fail(pe, op, "quantMode=1 (static quant) has no window-mode kernel: only 0 (tiling key 10000) and 2 "
                      "(DynamicQuant, tiling key 10002) exist.")
    if E // R * R > DISPATCH_STATUS_MAX_SUPPORT_NUM:
        _fail(pe, op, f"The moe experts num must meet the conditions, (moeExpertNum / epWorldSize * epWorldSize <= "
                      f"{DISPATCH_STATUS_MAX_SUPPORT_NUM}, but cur is {E // R * R}.")
    if E % R:
        _fail(pe, op, f"moeExpertNum should be divisible by epWorldSize, but moeExpertNum={E}, epWorldSize={R}.")
    if not 1 <= info.bs <= BS_UPPER_BOUND:
        _fail(pe, op, f"xDim0(BS) is invalid. Should be between [1, {BS_UPPER_BOUND}], but got xDim0={info.bs}.")
    if info.global_bs <= 0:
        _fail(pe, op, f"globalBS is invalid, should be positive, but got globalBS={info.global_bs}.")
    _check_shape_limits(info, op, "xShape dims1(H)", "expertIdShape's dim1(k)")
    if info.topk_rows is not None and info.topk_rows != info.bs:
        _fail(pe, op, f"xShape's dim0 not equal to expertIdShape's dim0, xShape's dim0 is {info.bs}, "
                      f"expertIdShape's dim0 is {info.topk_rows}.")
    if info.x_dtype is not None and np.dtype(info.x_dtype) not in X_DTYPES:
        _fail(pe, op, f"x dataType is invalid, dataType should be bf16 or float16, but is {np.dtype(info.x_dtype)}.")
    max_bs = info.global_bs // R
    if info.bs > max_bs:  # emulator check (README A18): the combine area is sized for globalBs / R rows
        _fail(pe, op, f"bs={info.bs} exceeds globalBS / epWorldSize = {info.global_bs} / {R} = {max_bs}: the "
                      f"window's combine area is sized for maxBs * k rows.")
    _check_window(info, op, max_bs, combine_only=False)


def check_combine_tiling(info: MoeCombineNormalInfo) -> int:
    """Every host check of ``moe_combine_normal``; returns the effective globalBs (0 means ``bs * R``)."""
    op, pe = "MoeCombineNormal", info.ep_rank_id
    _check_domains(info, op)
    R, E = info.ep_world_size, info.moe_expert_num
    if E % R:
        _fail(pe, op, f"moeExpertNum should be divisible by epWorldSize, but got moeExpertNum={E}, epWorldSize={R}.")
    if not 1 <= info.bs <= BS_UPPER_BOUND:
        _fail(pe, op, f"Invalid topkWeights dims0(BS) {info.bs}. Should be between [1, {BS_UPPER_BOUND}].")
    global_bs = info.global_bs
    if global_bs != 0 and (global_bs < R * info.bs or global_bs % R):
        _fail(pe, op, f"globalBS is invalid, only support 0 or maxBs(maxBs is the largest bs on all ranks) * "
                      f"epWorldSize, but got globalBS={global_bs}, bs={info.bs}, epWorldSize={R}.")
    global_bs = global_bs or info.bs * R
    _check_shape_limits(info, op, "recvX's dim1(H)", "topkWeights's dim1(K)")
    if info.recv_x_dtype is not None and np.dtype(info.recv_x_dtype) not in X_DTYPES:
        _fail(pe, op, f"recvX dataType is invalid, dataType should be bf16 or float16, but is "
                      f"{np.dtype(info.recv_x_dtype)}.")
    if info.ep_recv_counts_len is not None and info.ep_recv_counts_len < E:
        _fail(pe, op, f"Invalid sendCount dims0 {info.ep_recv_counts_len}. Should not be smaller than {E}.")
    if info.token_src_info_len is not None and info.recv_rows is not None \
            and info.token_src_info_len < 3 * info.recv_rows:
        _fail(pe, op, f"Invalid srcInfo dims0 {info.token_src_info_len}. Should not be smaller than "
                      f"{3 * info.recv_rows}.")
    _check_window(info, op, global_bs // R, combine_only=True)
    return global_bs


def needed_mb(max_bs: int, k: int, h: int) -> int:
    """The ``NEEDED_HCCL_BUFFSIZE`` the dispatch check reports (MB; always one more than the floor)."""
    return window_needed_bytes(max_bs, k, h) // MB + 1


def check_context(ctx, info, op: str) -> None:
    """The attributes must describe the context's domains (after the CAM checks, so their messages win)."""
    me = ctx.ep_rank_id
    pairs = (("ep_world_size", info.ep_world_size, ctx.ep_world_size), ("ep_rank_id", info.ep_rank_id, me),
             ("tp_world_size", max(info.tp_world_size, 1), max(ctx.tp_world_size, 1)),
             ("tp_rank_id", info.tp_rank_id, ctx.tp_rank_id))
    for name, given, actual in pairs:
        if given != actual:
            raise ValueError(f"pe {me}: {op}: {name}={given} does not match the WindowContext ({actual})")
