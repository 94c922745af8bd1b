"""``moe_combine_normal``: the CAM window-mode combine kernel (seed section 7), on ``aiv_num`` AIV blocks.

Every block runs, with no SyncAll between them (seed 7.4)::

    InitMagic                       read this block's magic word (Exp + 975 KB + 512*b) and flip it; half p = magic
    CopyBufferToShareAndSetStatus   for received rows a in the block's split of epRecvCount[E-1]: with
                                    (srcRank, srcTok, srcTopk) = tokenSrcInfo[a], write recv_x[a] into srcRank's In
                                    window at p*W/2 + 208 MB + (srcTok*K + srcTopk) * h512AlignRecvXLen, then eight
                                    1.0f at p*W/2 + 204 MB + (srcTok*K + srcTopk) * 32
    ReadBufferFromRemote            for own tokens t in the block's split of bs: WaitBuffCopy (sum the K*8 floats of
                                    t's slots until 8K, clear them), then ReadBufferAndWeightedSum: acc = 0 (fp32);
                                    for k in 0..K-1: acc = acc + fp32(row(t, k)) * w[t, k]; x[t] = RNE(acc)

The combine flags live in the In window, in front of the combine data area (README A20). Emulation: the rows and
flags of one destination rank are vectorised stores through ``aclshmem_ptr`` views, rows before flags; the last
flag for each destination goes through ``aclshmemx_mte_put_nbi`` to wake it. A destination on another host gets
the same rows and flags over UDMA, the rows quiet before the flags, all of them posted by block 0 for every block
(one submitter per queue; ``far``). The receive side waits on all
of its pending tokens at once (``aclshmem_wait_until_any`` on the flag bits, excluding finished tokens) and
processes whichever tokens are complete, in token order; the seed walks its tokens strictly in order, which only
changes when a token is summed, not the result.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

import shmemx

from . import far
from .constants import FLOAT_NUM_PER_ALIGN, TOKEN_SRC_INFO_LEN, UB_32_ALIGN
from .dispatch import BlockResults, _out, cost_stats
from .tiling import DispatchLayout, MoeCombineNormalInfo, check_combine_tiling, check_context, op_attrs, split
from .window import WindowContext, flip_half

__all__ = ["CombineOutput", "moe_combine_normal"]

_ONES8 = np.ones(FLOAT_NUM_PER_ALIGN, np.float32)
_ZERO = np.float32(0.0)
_CHUNK_BYTES = 1 << 20  # rows per vectorised send step: about 1 MB
_SUM_TOKENS = 8  # tokens per weighted-sum step: accumulator and widened row stay in cache (measured fastest)


class CombineOutput(NamedTuple):
    """What ``moe_combine_normal`` returns on this rank.

    Attributes:
        x: ``[bs, H]`` (recv_x's dtype): per own token, ``RNE(sum_k fp32(expert row (t, k)) * w[t, k])``.
        send_cost_stats: ``[R] int32`` microseconds spent sending rows to each token-owner rank (diagnose).
        magic: the magic (ping-pong half) this call used.
        flags_written: combine flag slots this rank wrote (one per returned row).
        bytes_copied: bytes this rank's kernel copied (rows out to the owners, K rows per own token back in).
    """

    x: np.ndarray
    send_cost_stats: np.ndarray | None
    magic: int
    flags_written: int
    bytes_copied: int


class _Run(BlockResults):
    """Everything the blocks of one combine call share (read-only, except the per-block results)."""

    def __init__(self, ctx, recv_x: np.ndarray, src_info: np.ndarray, weights: np.ndarray,
                 info: MoeCombineNormalInfo, layout: DispatchLayout, rows: int, x_out: np.ndarray | None):
        self.ctx, self.info, self.layout = ctx, info, layout
        self.recv_x = recv_x
        self.src_info = src_info[:rows * TOKEN_SRC_INFO_LEN].reshape(rows, TOKEN_SRC_INFO_LEN).astype(np.int64)
        self.weights = weights
        self.rows = rows  # selfSendCnt_ = epRecvCount[E-1]
        self.me, self.R, self.K, self.H = info.ep_rank_id, info.ep_world_size, info.k, info.h
        self.slots = info.bs * info.k  # own (t, k) slots this call waits for
        self.max_slots = info.global_bs // self.R * info.k  # rows a combine data area holds
        self.out = _out(x_out, "x_out", (info.bs, info.h), recv_x.dtype, self.me)
        self.diagnose = info.is_enable_diagnose
        self.any_far = ctx.ep.any_far  # ranks on other hosts (far): their rows and flags go over UDMA
        super().__init__(info.aiv_num, self.R, np.float64)
        self.chunk = max(1, _CHUNK_BYTES // (layout.h512_align_recv_x_len))

    def buffer(self, rank: int, magic: int) -> np.ndarray:
        """``[maxBs*K, H]``: rank ``rank``'s combine data rows (half ``magic``), as recv_x's dtype."""
        stride = self.layout.h512_align_recv_x_len
        area = self.ctx.get_buffer_addr_by_rank_id(rank, magic, self.max_slots * stride)
        return area.reshape(self.max_slots, stride)[:, :self.H * self.recv_x.itemsize].view(self.recv_x.dtype)

    def state(self, rank: int, magic: int) -> np.ndarray:
        """``[maxBs*K, 8] float32``: rank ``rank``'s combine flag slots (half ``magic``)."""
        area = self.ctx.get_state_addr_by_rank_id(rank, magic, self.max_slots * UB_32_ALIGN)
        return area.view(np.float32).reshape(self.max_slots, FLOAT_NUM_PER_ALIGN)


def _init_magic(run: _Run, b: int) -> int:
    run.states[b] = magic = flip_half(run.ctx.magic_word(b))
    return magic


def _copy_buffer_to_share_and_set_status(run: _Run, b: int, B: int, magic: int) -> None:
    """Send the block's received rows ``[start, end)`` back to their token owners, rows before flags.

    Rows come in (local expert, source rank) segments, so the rows for one owner are runs of consecutive rows.
    Owner by owner, each run is stored as one vectorised copy into the owner's combine data area followed by its
    flags; the owner's very last flag goes through ``aclshmemx_mte_put_nbi``, which wakes the owner once (a wake
    per run cost more than the copies).
    """
    start, end = split(run.rows, B, b)
    local_state = run.state(run.me, magic)  # symmetric address of every rank's flag slots
    if b == 0 and run.any_far:  # every block's rows to ranks of other hosts: block 0 sends them (far)
        far_runs = _owner_runs(run, 0, run.rows)
        with far.section() as udma:
            for dst in sorted(d for d in far_runs if not run.ctx.ep.near(d)):
                _timed(run, dst, _send_far, udma, dst, far_runs[dst], magic, local_state)
    if start >= end:
        return
    runs = _owner_runs(run, start, end)
    for dst in sorted(d for d in runs if run.ctx.ep.near(d)):
        _timed(run, dst, _send_near, dst, runs[dst], magic, local_state)
    run.flags_written[b] += end - start
    run.bytes_copied[b] += (end - start) * run.H * run.recv_x.itemsize


def _owner_runs(run: _Run, start: int, end: int) -> dict[int, list[tuple[int, int]]]:
    """Received rows ``[start, end)`` as runs of consecutive rows per token owner: owner -> [(r0, r1)]."""
    dst_of = run.src_info[start:end, 0]
    breaks = np.flatnonzero(np.diff(dst_of)) + 1
    runs: dict[int, list[tuple[int, int]]] = {}
    for r0, r1 in zip(np.concatenate([[0], breaks]), np.concatenate([breaks, [end - start]])):
        runs.setdefault(int(dst_of[r0]), []).append((start + int(r0), start + int(r1)))
    return runs


def _timed(run: _Run, dst: int, send, *args) -> None:
    """``send(run, *args)``, its time added to the diagnose cost of rank ``dst``."""
    t0 = time.perf_counter()
    send(run, *args)
    if run.diagnose:
        spent = (time.perf_counter() - t0) * 1e6
        with run.lock:
            run.stats[dst] += spent


def _send_near(run: _Run, dst: int, runs: list[tuple[int, int]], magic: int, local_state: np.ndarray) -> None:
    """Rows ``runs`` (``[r0, r1)`` of recv_x) into rank ``dst``'s combine data area through its window view, each
    chunk's flags after its rows; the very last flag by an MTE put, which wakes ``dst``."""
    buffer, state = run.buffer(dst, magic), run.state(dst, magic)
    chunks = [(c0, min(c0 + run.chunk, r1)) for r0, r1 in runs for c0 in range(r0, r1, run.chunk)]
    for i, (c0, c1) in enumerate(chunks):
        slot = run.src_info[c0:c1, 1] * run.K + run.src_info[c0:c1, 2]  # srcTokenId * K + srcTopkId
        buffer[slot] = run.recv_x[c0:c1]  # CopyBufferToShare
        state[slot[:-1] if i == len(chunks) - 1 else slot] = 1.0  # SetStatusBySrcInfo: 8 x 1.0f, after rows
    shmemx.aclshmemx_mte_put_nbi(local_state[slot[-1]], _ONES8, FLOAT_NUM_PER_ALIGN, run.ctx.ep.pes[dst])


def _send_far(run: _Run, udma: far.FarSection, dst: int, runs: list[tuple[int, int]], magic: int,
              local_state: np.ndarray) -> None:
    """The same rows and flags to rank ``dst`` of another host over UDMA (addressed by this rank's own combine
    area and flag slots: the symmetric address); the rows are quiet before any flag is written."""
    own, pe = run.buffer(run.me, magic), run.ctx.ep.pes[dst]
    rows = np.concatenate([np.arange(r0, r1) for r0, r1 in runs])
    slots = (run.src_info[rows, 1] * run.K + run.src_info[rows, 2]).tolist()
    for a, slot in zip(rows.tolist(), slots):
        udma.put(own[slot], run.recv_x[a], pe)  # CopyBufferToShare
    udma.quiet()  # every row is at the owner before its flags
    for slot in slots:
        udma.flag(local_state[slot], pe)  # SetStatusBySrcInfo


def _runs(tokens: np.ndarray) -> list[tuple[int, int]]:
    """``[start, end)`` runs of consecutive ids in the sorted array ``tokens``."""
    breaks = np.flatnonzero(np.diff(tokens) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(tokens)]])
    return [(int(tokens[a]), int(tokens[b - 1]) + 1) for a, b in zip(starts, ends)]


def _weighted_sum(run: _Run, tokens: np.ndarray, magic: int) -> None:
    """ReadBufferAndWeightedSum for ``tokens`` (sorted): fp32 accumulation in k order, then RNE to the output.

    Per token: ``acc = 0; for k: acc = acc + fp32(row(t, k)) * w[t, k]`` (Cast, Muls, Add; no fused multiply-add),
    vectorised over ``_SUM_TOKENS`` consecutive tokens at a time, whose K rows each are consecutive in the window.
    The chunk is small so that the fp32 accumulator and the widened row stay in cache (as the UB does on the
    device): 1.8x faster than widening all K rows of many tokens at once. The widening cast is exact.
    """
    K, H = run.K, run.H
    rows = run.buffer(run.me, magic)
    acc_all, tmp_all = _sum_scratch(H)
    for lo, hi in _runs(tokens):
        for c0 in range(lo, hi, _SUM_TOKENS):
            c1 = min(c0 + _SUM_TOKENS, hi)
            n = c1 - c0
            acc, tmp = acc_all[:n], tmp_all[:n]
            by_k = rows[c0 * K:c1 * K].reshape(n, K, H)
            for k in range(K):
                np.copyto(tmp, by_k[:, k], casting="unsafe")  # Cast CAST_NONE (exact)
                np.multiply(tmp, run.weights[c0:c1, k, None], out=tmp)  # Muls by w[t, k]
                if k:
                    np.add(acc, tmp, out=acc)  # Add, in k order
                else:  # acc = 0 + tmp: tmp + 0 is the same value bit for bit (-0 included), without a zero fill
                    np.add(tmp, _ZERO, out=acc)
            run.out[c0:c1] = acc  # Cast CAST_RINT (numpy's float32 -> bfloat16 rounds to nearest even)


_sums: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}


def _sum_scratch(h: int) -> tuple[np.ndarray, np.ndarray]:
    """This block's ``[_SUM_TOKENS, h] float32`` accumulator and widened row, kept across calls (the block threads
    are new every launch: kept per block index, no page faults per call)."""
    key = (shmemx.get_block_idx(), h)
    found = _sums.get(key)
    if found is None:
        found = _sums[key] = (np.zeros((_SUM_TOKENS, h), np.float32), np.zeros((_SUM_TOKENS, h), np.float32))
    return found


def _read_buffer_from_remote(run: _Run, b: int, B: int, magic: int) -> None:
    start, end = split(run.info.bs, B, b)
    if start >= end:
        return
    K8 = run.K * FLOAT_NUM_PER_ALIGN
    state = run.state(run.me, magic)[start * run.K:end * run.K].reshape(end - start, K8)
    bits = run.state(run.me, magic).view(np.int32)[start * run.K:end * run.K].reshape(-1)
    target = np.float32(K8)  # 1.0f * K * FLOAT_NUM_PER_ALIGN
    pending = np.ones(end - start, bool)
    while True:
        sums = state.sum(axis=1, dtype=np.float32)
        ready = np.flatnonzero(pending & (sums == target))
        if len(ready):
            if run.any_far:  # rows and flags of ranks on other hosts are UDMA writes: taken by a wait (met at once)
                far.acquire(bits, ready, K8)
            state[ready] = 0.0  # WaitBuffCopy's clear
            pending[ready] = False
            _weighted_sum(run, start + ready, magic)
            run.bytes_copied[b] += len(ready) * run.K * run.H * run.recv_x.itemsize
            continue
        if not pending.any():
            return
        snap = bits.copy()
        if (snap.view(np.float32).reshape(end - start, K8).sum(axis=1, dtype=np.float32)[pending] == target).any():
            continue  # completed between the sums and the snapshot
        done = np.repeat(~pending, K8).astype(np.int32)
        try:
            shmemx.aclshmem_wait_until_any(bits, shmemx.ACLSHMEM_CMP_NE, snap, status=done)
        except shmemx.WaitTimeoutError as exc:
            missing = [int(t) for t in start + np.flatnonzero(pending)]
            raise shmemx.WaitTimeoutError(
                f"pe {run.me}: moe_combine_normal WaitBuffCopy (block {b}, half {magic}): {len(missing)} tokens "
                f"still incomplete, first {missing[:8]} (each waits for its K={run.K} slots of 8 x 1.0f); {exc}"
            ) from None


def _kernel(run: _Run) -> None:
    b, B = shmemx.get_block_idx(), shmemx.get_block_num()
    magic = _init_magic(run, b)
    _copy_buffer_to_share_and_set_status(run, b, B, magic)
    _read_buffer_from_remote(run, b, B, magic)


def _check_rows(info: MoeCombineNormalInfo, recv_x: np.ndarray, token_src_info: np.ndarray, rows: int) -> None:
    """That recv_x holds the ``rows`` rows combine sends and each of their (rank, token, topk) triples in
    ``token_src_info`` is inside ``[0, R) x [0, maxBs) x [0, K)``."""
    me, R = info.ep_rank_id, info.ep_world_size
    if recv_x.shape[0] < rows:
        raise ValueError(f"pe {me}: moe_combine_normal: recv_x has {recv_x.shape[0]} rows, ep_recv_counts[E-1] "
                         f"says {rows}")
    src = token_src_info[:rows * 3].reshape(rows, 3)
    bounds = np.array([R, info.global_bs // R, info.k])
    if rows and ((src.min(axis=0) < 0).any() or (src.max(axis=0) >= bounds).any()):
        raise ValueError(f"pe {me}: moe_combine_normal: token_src_info holds a (rank, token, topk) triple outside "
                         f"[0, {R}) x [0, maxBs={info.global_bs // R}) x [0, {info.k})")


def moe_combine_normal(ctx: WindowContext, recv_x: np.ndarray, token_src_info: np.ndarray, ep_recv_counts: np.ndarray,
                       recv_topk_weights: np.ndarray, *, moe_expert_num: int, global_bs: int = 0,
                       diagnose: bool = False, send_cost_stats: np.ndarray | None = None,
                       tp_recv_counts: np.ndarray | None = None, ep_world_size: int | None = None,
                       ep_rank_id: int | None = None, tp_world_size: int | None = None, tp_rank_id: int | None = None,
                       x_out: np.ndarray | None = None) -> CombineOutput:
    """Return the expert outputs to their tokens and sum them with the top-k weights. Collective over EP.

    Args:
        ctx: the ``WindowContext`` the paired dispatch used.
        recv_x: ``[A', H]`` bfloat16/float16 expert outputs in dispatch's row order; rows ``[0, A)`` are sent,
            ``A = ep_recv_counts[E-1]``.
        token_src_info: ``[>= 3A] int32``: dispatch's ``assist_info_for_combine``.
        ep_recv_counts: ``[>= E] int32``: dispatch's ``ep_recv_counts`` (the ``recv_count`` input).
        recv_topk_weights: ``[bs, K] float32``: the weights of this rank's own tokens.
        moe_expert_num: E.
        global_bs: globalBs, as dispatch had it; 0 means ``bs * R``.
        diagnose: collect the per-destination-rank send cost (``send_cost_stats``, microseconds).
        send_cost_stats: optional ``[R] int32`` array the costs are added into; implies ``diagnose``.
        tp_recv_counts: accepted and unused, as in the CAM kernel.
        ep_world_size, ep_rank_id, tp_world_size, tp_rank_id: op attributes; default the context's.
        x_out: optional ``[>= bs, H]`` output buffer (recv_x's dtype); the result is its first bs rows.

    Returns:
        ``CombineOutput``.
    """
    me = ctx.ep_rank_id
    recv_x = np.asarray(recv_x)
    weights = np.asarray(recv_topk_weights)
    token_src_info = np.asarray(token_src_info).reshape(-1)
    ep_recv_counts = np.asarray(ep_recv_counts).reshape(-1)
    if recv_x.ndim != 2 or weights.ndim != 2:
        raise ValueError(f"pe {me}: moe_combine_normal: recv_x must be [A, H] and recv_topk_weights [bs, K], got "
                         f"{list(recv_x.shape)} and {list(weights.shape)}")
    E = int(moe_expert_num)
    rows = int(ep_recv_counts[E - 1]) if 0 < E <= len(ep_recv_counts) else 0
    info = MoeCombineNormalInfo(
        **op_attrs(ctx, ep_world_size, ep_rank_id, tp_world_size, tp_rank_id),
        moe_expert_num=E, global_bs=int(global_bs), bs=weights.shape[0], k=weights.shape[1], h=recv_x.shape[1],
        aiv_num=ctx.aiv_num, total_win_size=ctx.total_win_size, recv_x_dtype=recv_x.dtype,
        ep_recv_counts_len=len(ep_recv_counts), token_src_info_len=len(token_src_info), recv_rows=rows,
        is_enable_diagnose=diagnose or send_cost_stats is not None)
    info.global_bs = check_combine_tiling(info)
    check_context(ctx, info, "moe_combine_normal")
    _check_rows(info, recv_x, token_src_info, rows)
    layout = DispatchLayout(info.h, recv_x.itemsize, recv_x.itemsize)
    run = _Run(ctx, np.ascontiguousarray(recv_x), token_src_info, weights.astype(np.float32), info, layout, rows,
               x_out)
    shmemx.launch(_kernel, ctx.aiv_num, run)
    if len(set(run.states)) != 1:
        raise RuntimeError(f"pe {me}: moe_combine_normal: AIV blocks read different magic words {run.states}: "
                           f"aiv_num changed between calls on this WindowContext")
    stats = cost_stats(send_cost_stats, run.stats) if info.is_enable_diagnose else None
    return CombineOutput(run.out, stats, int(run.states[0]), sum(run.flags_written), sum(run.bytes_copied))
