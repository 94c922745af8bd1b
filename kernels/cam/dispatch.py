"""``moe_dispatch_normal``: the CAM window-mode dispatch kernel (seed section 3), on ``aiv_num`` AIV blocks.

Every block runs the seed's four phases in order, with ``SyncAll`` (``shmemx.sync_all``) where the seed has it::

    Init           read this block's dataState word (Exp + 950 KB + 512*b) and flip it; half p = dataState
    InputToShare   pairs p in the block's token split: row (epRankId, t, k) -> OWN In window, half p, at
                   hOutGMAlignSize * (send_offset[expert] + send_tokenIdx[p]); data, pad, scale slot, triple
    SetStatus      SyncAll; for experts i in the block's status split: 32 B of 1.0f into rank i / E_loc's Exp
                   window at p * 500 KB + 32 * (epRankId + (i % E_loc) * R)
    WaitStatus     sum float[0] of the block's own flag slots until it equals the slot count; clear them (32 B
                   zeros each); SyncAll
    ShareToOutput  for status s = le*R + src of the block: recv_count[s] - recv_count[s-1] rows from src's In
                   window (half p, row recv_offset[s]) -> expandXOut, the triples -> expandIdxOut (+ scales)

The writer stores its rows into its own window and the readers pull them (the seed's code: ``shareGM =
GetWindAddrByRankId(COMM_EP_IDX, epRankId)``; README A1). The flags are stores, not adds: a slot is 0 or 1.0, and
each is written once per call by exactly one sender, so the sum reaches the target only when every sender of the
block's slots has finished its rows. Ping-pong: call n uses half n % 2 of both windows, so a flag of call n can
only be seen by call n + 2, and by then the reader has cleared it (README "ping-pong").

Emulation: peer windows are ``aclshmem_ptr`` views (direct MTE loads/stores); each block's work is vectorised
numpy. A rank of another host (``shmemx run --hosts``) is reached over UDMA (``far``): its flags are UDMA flag
writes, its rows UDMA reads, all posted by block 0 for every block (one submitter per queue), the reads after
WaitStatus' SyncAll and followed by one more SyncAll (only in a job with such ranks). Flag stores to one peer are plain stores except the last, which goes through ``aclshmemx_mte_put_nbi`` so
that the peer's sleeping waiters wake; the wait is ``aclshmem_wait_until_any(flag bits != last snapshot)`` around
the seed's sum, so no thread busy-polls.
"""

from __future__ import annotations

import threading
import time
from typing import NamedTuple

import numpy as np

import shmemx

from . import far
from .constants import COMM_EP_IDX, EXPAND_IDX_INFO, FLOAT_NUM_PER_ALIGN, QUANT_MODE_DYNAMIC, STATE_OFFSET
from .quant import dynamic_quant
from .tiling import DispatchLayout, MoeDispatchNormalInfo, check_context, check_dispatch_tiling, op_attrs, split
from .window import WindowContext, flip_half

__all__ = ["DispatchOutput", "moe_dispatch_normal"]

_ONES8 = np.ones(FLOAT_NUM_PER_ALIGN, np.float32)
_CHUNK_BYTES = 1 << 20  # rows per vectorised step: about 1 MB, so the gathered rows stay in cache


class DispatchOutput(NamedTuple):
    """What ``moe_dispatch_normal`` returns on this rank (A = ``recv_count[E-1]`` received rows).

    Attributes:
        recv_x: ``[A, H]`` expandXOut: x's dtype, or int8 with DynamicQuant. Row order: local expert, then source
            rank, then the sender's (t, k) order.
        x_scales: ``[A] float32`` dynamicScalesOut (DynamicQuant), else None.
        assist_info_for_combine: ``[3A] int32`` expandIdxOut: (source rank, source token, topk slot) per row.
        ep_recv_counts: ``[E] int32``: the ``recv_count`` input (inclusive prefix by status), as combine takes it.
        recv_counts: ``[E_loc, R] int32``: rows received per (local expert, source rank).
        expert_token_nums: ``[E_loc] int64``: rows received per local expert.
        wait_recv_cost_stats: ``[R] int32`` microseconds (diagnose), else None.
        data_state: the dataState (ping-pong half) this call used.
        flags_written: dispatch flags this rank wrote (one per global expert).
        bytes_copied: bytes this rank's kernel copied (rows into its window, rows out of peers' windows).
    """

    recv_x: np.ndarray
    x_scales: np.ndarray | None
    assist_info_for_combine: np.ndarray
    ep_recv_counts: np.ndarray
    recv_counts: np.ndarray
    expert_token_nums: np.ndarray
    wait_recv_cost_stats: np.ndarray | None
    data_state: int
    flags_written: int
    bytes_copied: int


class Routing(NamedTuple):
    """The routing inputs of ``notify_dispatch`` (checked integer vectors): ``send_offset [E]``,
    ``send_token_idx [bs*K]``, ``recv_offset [E]``, ``recv_count [E]`` (inclusive prefix by status)."""

    send_offset: np.ndarray
    send_token_idx: np.ndarray
    recv_offset: np.ndarray
    recv_count: np.ndarray


class BlockResults:
    """What the AIV blocks of one call report back: per block the ping-pong half it used (``states``), the flags
    it wrote and the bytes it copied; the diagnose costs per rank (``stats [R]``, added under ``lock``)."""

    def __init__(self, aiv_num: int, ranks: int, stats_dtype: type) -> None:
        self.stats = np.zeros(ranks, stats_dtype)
        self.lock = threading.Lock()
        self.states: list[int | None] = [None] * aiv_num
        self.flags_written = [0] * aiv_num
        self.bytes_copied = [0] * aiv_num


class _Run(BlockResults):
    """Everything the blocks of one dispatch call share (read-only, except the per-block results).

    ``outs``: the caller's (recv_x_out, x_scales_out, assist_info_out), each None or a buffer of >= A rows."""

    def __init__(self, ctx, x: np.ndarray, topk_idx: np.ndarray, routing: Routing, info: MoeDispatchNormalInfo,
                 layout: DispatchLayout, outs: tuple):
        self.ctx, self.info, self.layout = ctx, info, layout
        self.x = x
        self.topk_flat = np.ascontiguousarray(topk_idx).reshape(-1).astype(np.int64)
        self.send_offset, self.send_token_idx, self.recv_offset, self.recv_count = (
            v.astype(np.int64) for v in routing)
        self.me, self.R, self.E = info.ep_rank_id, info.ep_world_size, info.moe_expert_num
        self.e_loc = self.E // self.R
        self.quant = info.quant_mode == QUANT_MODE_DYNAMIC
        self.out_dtype = np.dtype(np.int8) if self.quant else x.dtype
        self.max_rows = info.global_bs // self.R * info.k  # rows a dispatch area holds
        # winDataSizeOffset's second term: skip the combine data area (globalBs / R * K * hSizeAlignCombine)
        self.combine_area = info.global_bs // self.R * info.k * layout.h_size_align_combine
        A = int(self.recv_count[-1]) if self.E else 0
        recv_x_out, x_scales_out, assist_info_out = outs
        self.recv_x = _out(recv_x_out, "recv_x_out", (A, info.h), self.out_dtype, self.me)
        self.x_scales = _out(x_scales_out, "x_scales_out", (A,), np.float32, self.me) if self.quant else None
        self.expand_idx = _out(assist_info_out, "assist_info_out", (A * EXPAND_IDX_INFO,), np.int32, self.me)
        self.recv_counts = np.zeros(self.E, np.int32)
        self.diagnose = info.is_enable_diagnose
        super().__init__(info.aiv_num, self.R, np.int64)
        self.chunk = max(1, _CHUNK_BYTES // (info.h * x.itemsize))  # tokens per InputToShare step
        self.any_far = ctx.ep.any_far  # ranks on other hosts (far): their flags and rows go over UDMA
        self.fetched: dict[int, np.ndarray] = {}  # status -> the rows read from a far rank (_fetch_far)

    def rows(self, rank: int, data_state: int) -> np.ndarray:
        """``[maxBs*K, hOutGMAlignSize] uint8``: rank ``rank``'s dispatch area in half ``data_state``."""
        off = self.ctx.dispatch_data_offset(data_state, self.combine_area)
        hout = self.layout.h_out_gm_align_size
        area = self.ctx.get_wind_addr_by_rank_id(COMM_EP_IDX, rank, off, self.max_rows * hout)
        return area.reshape(self.max_rows, hout)

    def flags(self, rank: int, data_state: int) -> np.ndarray:
        """``[E, 8] float32``: rank ``rank``'s dispatch flag slots (Exp window, half ``data_state``)."""
        area = self.ctx.get_wind_state_addr_by_rank_id(COMM_EP_IDX, rank, data_state, self.E * STATE_OFFSET)
        return area.view(np.float32).reshape(self.E, FLOAT_NUM_PER_ALIGN)


# --- the phases --------------------------------------------------------------------------------------------------


def _init(run: _Run, b: int) -> int:
    run.states[b] = data_state = flip_half(run.ctx.data_state_word(b))
    return data_state


def _input_to_share(run: _Run, b: int, B: int, own_rows: np.ndarray) -> None:
    """Write the block's pairs ``p = t*K + k`` in ``[start, end)`` into this rank's own dispatch area.

    Vectorised per (token chunk, k): the tokens of one k whose pairs fall in the block's range are consecutive,
    so their rows come straight from a slice of x (no gathered copy) and scatter to ``send_offset[expert] +
    send_tokenIdx[p]``. DynamicQuant quantises each token once per chunk; the seed quantises per pair, with the
    same result.
    """
    lay, K, H = run.layout, run.info.k, run.info.h
    start, end = split(run.info.bs * K, B, b)
    if start >= end:
        return
    data_bytes = H * run.out_dtype.itemsize
    tail_len = lay.h_scale_idx_size - data_bytes  # pad to 32 B, 32 B scale slot, 12 B triple
    scale_at, triple_at = lay.h_ub_align_size - data_bytes, lay.h_scale_size_align - data_bytes
    data = own_rows[:, :data_bytes].view(run.out_dtype)
    first, last = start // K, (end - 1) // K + 1  # tokens touched by the block
    for c0 in range(first, last, run.chunk):
        c1 = min(c0 + run.chunk, last)
        src, scale = run.x[c0:c1], None
        if run.quant:
            src, scale = dynamic_quant(src)
        for k in range(K):
            lo, hi = max(c0, -(-(start - k) // K)), min(c1, (end - 1 - k) // K + 1)
            if lo >= hi:
                continue
            t = np.arange(lo, hi)
            p = t * K + k
            dst = run.send_offset[run.topk_flat[p]] + run.send_token_idx[p]  # hOutGMAlignSize * (offset + count)
            data[dst] = src[lo - c0:hi - c0]
            tail = np.zeros((hi - lo, tail_len), np.uint8)
            if run.quant:
                tail[:, scale_at:scale_at + 4] = scale[lo - c0:hi - c0].view(np.uint8).reshape(-1, 4)
            triple = np.stack([np.full(hi - lo, run.me), t, np.full(hi - lo, k)], axis=1).astype("<i4")
            tail[:, triple_at:triple_at + 12] = triple.view(np.uint8).reshape(-1, 12)  # FillTriple
            own_rows[dst, data_bytes:lay.h_scale_idx_size] = tail
    run.bytes_copied[b] += (end - start) * lay.h_scale_idx_size


def _set_status(run: _Run, b: int, B: int, data_state: int) -> None:
    start, end = split(run.E, B, b)  # startExpId / endExpId (global expert ids)
    shmemx.sync_all()  # SyncAll<true>: every block's rows are in the window before any flag
    if len(set(run.states)) != 1:
        raise RuntimeError(f"pe {run.me}: moe_dispatch_normal: AIV blocks read different dataState words "
                           f"{run.states}: aiv_num changed between calls on this WindowContext")
    local = run.flags(run.me, data_state)  # the symmetric address of every rank's flag slots
    if b == 0 and run.any_far:
        _far_flags(run, local)
    if start >= end:
        return
    experts = np.arange(start, end)
    targets = experts // run.e_loc
    slots = run.me + experts % run.e_loc * run.R  # offset / STATE_OFFSET: slot (local expert, me)
    for target in np.unique(targets).tolist():
        if not run.ctx.ep.near(target):
            continue  # (block 0 sent it: _far_flags)
        mine = slots[targets == target]
        peer = run.flags(target, data_state)
        peer[mine[:-1]] = 1.0  # all 8 floats 1.0f (0x3F800000), as the seed's Duplicate
        shmemx.aclshmemx_mte_put_nbi(local[mine[-1]], _ONES8, FLOAT_NUM_PER_ALIGN, run.ctx.ep.pes[target])
    run.flags_written[b] += end - start


def _far_flags(run: _Run, local: np.ndarray) -> None:
    """The flags of every expert on a rank of another host, each a UDMA flag write (``far``), by block 0 for
    every block (one submitter per queue); the rows they announce are all in this rank's window (SyncAll)."""
    experts = np.arange(run.E)
    far_experts = experts[[not run.ctx.ep.near(int(t)) for t in experts // run.e_loc]]
    with far.section() as udma:
        for e in far_experts.tolist():
            udma.flag(local[run.me + e % run.e_loc * run.R], run.ctx.ep.pes[e // run.e_loc])


def _missing(run: _Run, start: int, bits: np.ndarray) -> str:
    lost = [(int(s) // run.R, int(s) % run.R) for s in start + np.flatnonzero(bits == 0)]
    shown = ", ".join(f"(local expert {le}, src rank {src})" for le, src in lost[:8])
    return f"{len(lost)} flag{'s' if len(lost) != 1 else ''} missing: {shown}{' ...' if len(lost) > 8 else ''}"


def _wait_status(run: _Run, b: int, B: int, data_state: int, stats: np.ndarray) -> None:
    start, end = split(run.E, B, b)  # startStatusId / endStatusId
    if start >= end:
        shmemx.sync_all()
        return
    flags = run.flags(run.me, data_state)
    # the block's slots as contiguous int32 words (all 8 per slot), so that the wait (and a hang report) covers
    # exactly the memory the block owns; the seed's sum counts float[0] of each slot
    words = flags.view(np.int32)[start:end].reshape(-1)
    target = np.float32(end - start)  # compareTarget = 1.0f * statusNumPerCore
    seen = np.zeros(end - start, np.int32)
    t0 = time.perf_counter()
    while True:
        snap = words.copy()
        first = snap[::FLOAT_NUM_PER_ALIGN]
        if run.diagnose:
            now_us = int((time.perf_counter() - t0) * 1e6)
            new = np.flatnonzero(first != seen)
            np.add.at(stats, (start + new) % run.R, now_us)  # by source rank s % R
            seen = first
        if first.view(np.float32).sum(dtype=np.float32) == target:
            break
        try:
            shmemx.aclshmem_wait_until_any(words, shmemx.ACLSHMEM_CMP_NE, snap)
        except shmemx.WaitTimeoutError as exc:
            raise shmemx.WaitTimeoutError(f"pe {run.me}: moe_dispatch_normal WaitStatus (block {b}, half "
                                          f"{data_state}, slots {start}..{end - 1}): {_missing(run, start, first)}; "
                                          f"{exc}") from None
    if run.any_far:  # flags of ranks on other hosts are UDMA writes: taken by a wait (met at once) before use
        shmemx.aclshmem_wait_until_all(words, shmemx.ACLSHMEM_CMP_EQ, far.ONE_BITS)
    flags[start:end] = 0  # clear all 32 B of each slot (README A3)
    shmemx.sync_all()


def _share_to_output(run: _Run, b: int, B: int, data_state: int) -> None:
    """ShareToOutput for the block's experts ``[start, end)``: expert i's ``count`` rows come from source rank
    ``i % R``'s window at ``recv_offset[i]`` and go to ``recv_x[pre:pre + count]`` (pre = ``recv_count[i-1]``),
    their triples to ``assist_info_for_combine``.

    The offsets and counts of all of the block's experts are worked out at once and each rank's window is viewed
    once, so that the loop over the E experts only copies (its per-expert Python was ~40% of the dispatch).
    """
    start, end = split(run.E, B, b)
    if start >= end:
        return
    lay, H = run.layout, run.info.h
    data_bytes = H * run.out_dtype.itemsize
    triple_at = lay.h_scale_size_align
    cum = run.recv_count[start:end]
    pre = np.concatenate([run.recv_count[start - 1:start] if start else [0], cum[:-1]])
    counts = cum - pre
    run.recv_counts[start:end] = counts
    live = np.flatnonzero(counts > 0)
    if not len(live):
        return
    windows = [run.rows(r, data_state) if run.ctx.ep.near(r) else None for r in range(run.R)]  # [maxBs*K, hOut]
    out_rows = run.recv_x.view(np.uint8).reshape(len(run.recv_x), -1)
    triples = run.expand_idx.reshape(-1, 3)
    scales = run.x_scales
    for i, p, n, o in zip((start + live).tolist(), pre[live].tolist(), counts[live].tolist(),
                          run.recv_offset[start + live].tolist()):
        rows = windows[i % run.R][o:o + n] if windows[i % run.R] is not None else run.fetched[i]
        out_rows[p:p + n] = rows[:, :data_bytes]
        triples[p:p + n] = rows[:, triple_at:triple_at + 12].view(np.int32)
        if scales is not None:
            scales[p:p + n] = rows[:, lay.h_ub_align_size:lay.h_ub_align_size + 4].view(np.float32)[:, 0]
    moved = int(counts[live].sum())
    run.bytes_copied[b] += moved * (data_bytes + 12 + (4 if run.quant else 0))


def _fetch_far(run: _Run, data_state: int) -> None:
    """Block 0, for every block: the rows of every status whose source rank is on another host, read over UDMA
    from that rank's dispatch area (the symmetric address: this rank's own area) into ``run.fetched`` (status
    -> ``[count, hOut]``); every flag is in (WaitStatus' SyncAll), the blocks meet again after it."""
    own = run.rows(run.me, data_state)
    counts = np.diff(run.recv_count, prepend=0)
    with far.section() as udma:
        for i in np.flatnonzero(counts > 0).tolist():
            if not run.ctx.ep.near(i % run.R):
                o, n = int(run.recv_offset[i]), int(counts[i])
                run.fetched[i] = np.empty((n, own.shape[1]), np.uint8)
                udma.get(run.fetched[i], own[o:o + n], run.ctx.ep.pes[i % run.R])


def _kernel(run: _Run) -> None:
    b, B = shmemx.get_block_idx(), shmemx.get_block_num()
    data_state = _init(run, b)
    _input_to_share(run, b, B, run.rows(run.me, data_state))
    _set_status(run, b, B, data_state)
    stats = np.zeros(run.R, np.int64)
    _wait_status(run, b, B, data_state, stats)
    if run.any_far:  # ranks of other hosts: block 0 reads their rows for every block (far)
        if b == 0:
            _fetch_far(run, data_state)
        shmemx.sync_all()
    _share_to_output(run, b, B, data_state)
    if run.diagnose:
        with run.lock:  # SetAtomicAdd<int32_t> into the GM output
            run.stats += stats


def _out(given, name: str, shape: tuple, dtype, me: int) -> np.ndarray:
    """The first ``shape[0]`` rows of a caller's output buffer (checked), or a new array."""
    if given is None:
        return np.empty(shape, dtype)
    if not isinstance(given, np.ndarray) or given.dtype != np.dtype(dtype) or given.shape[1:] != shape[1:] \
            or given.shape[0] < shape[0] or not given.flags.c_contiguous:
        raise ValueError(f"pe {me}: {name} must be a C-contiguous {np.dtype(dtype)} array of shape "
                         f"[>= {shape[0]}{''.join(f', {n}' for n in shape[1:])}], got "
                         f"{getattr(given, 'dtype', type(given).__name__)}{list(getattr(given, 'shape', ()))}")
    return given[:shape[0]]


# --- the op --------------------------------------------------------------------------------------------------


def cost_stats(given: np.ndarray | None, costs: np.ndarray) -> np.ndarray:
    """The ``[R] int32`` diagnose output: ``costs`` (microseconds per rank) added into ``given`` (CAM's optional
    output) or into a new array."""
    stats = given if given is not None else np.zeros(len(costs), np.int32)
    stats += costs.astype(np.int32)
    return stats


def _int32_vector(name: str, arr, length: int, me: int) -> np.ndarray:
    arr = np.asarray(arr)
    if arr.ndim != 1 or arr.shape[0] != length or arr.dtype.kind not in "iu":
        raise ValueError(f"pe {me}: moe_dispatch_normal: {name} must be a [{length}] integer vector, got "
                         f"{arr.dtype}{list(arr.shape)}")
    return arr


def _routing(info: MoeDispatchNormalInfo, topk_idx: np.ndarray, *vectors) -> Routing:
    """The routing inputs checked: every expert id of ``topk_idx [bs, K]`` in ``[0, E)`` and the four vectors'
    lengths (``Routing``'s order)."""
    me, E = info.ep_rank_id, info.moe_expert_num
    if topk_idx.min() < 0 or topk_idx.max() >= E:
        raise ValueError(f"pe {me}: moe_dispatch_normal: expert id outside [0, {E}) in topk_idx (the window path "
                         f"has no -1 masking, README A24)")
    return Routing(*(_int32_vector(name, arr, n, me) for name, arr, n in zip(
        Routing._fields, vectors, (E, info.bs * info.k, E, E))))


def _output(run: _Run, recv_count: np.ndarray, wait_recv_cost_stats: np.ndarray | None) -> DispatchOutput:
    """The call's ``DispatchOutput`` once its blocks have run (the diagnose costs added into the caller's array)."""
    stats = cost_stats(wait_recv_cost_stats, run.stats) if run.diagnose else None
    recv_counts = run.recv_counts.reshape(run.e_loc, run.R)
    return DispatchOutput(run.recv_x, run.x_scales, run.expand_idx, np.asarray(recv_count, np.int32).copy(),
                          recv_counts, recv_counts.sum(axis=1, dtype=np.int64), stats, int(run.states[0]),
                          sum(run.flags_written), sum(run.bytes_copied))


def moe_dispatch_normal(ctx: WindowContext, x: np.ndarray, topk_idx: np.ndarray, send_offset: np.ndarray,
                        send_token_idx: np.ndarray, recv_offset: np.ndarray, recv_count: np.ndarray, *,
                        moe_expert_num: int, global_bs: int, quant_mode: int = 0, diagnose: bool = False,
                        wait_recv_cost_stats: np.ndarray | None = None, ep_world_size: int | None = None,
                        ep_rank_id: int | None = None, tp_world_size: int | None = None, tp_rank_id: int | None = None,
                        recv_x_out: np.ndarray | None = None, x_scales_out: np.ndarray | None = None,
                        assist_info_out: np.ndarray | None = None) -> DispatchOutput:
    """Dispatch this rank's tokens to the experts' ranks through the HCCL windows. Collective over the EP domain.

    Every rank must make the same sequence of dispatch / combine calls on the same ``WindowContext`` with the same
    ``moe_expert_num``, ``global_bs``, K, H and dtypes (the receivers compute the senders' addresses from their
    own state; README A23).

    Args:
        ctx: the ``WindowContext`` (windows, aiv_num, TP domain).
        x: ``[bs, H]`` bfloat16 or float16 tokens.
        topk_idx: ``[bs, K]`` integer expert ids in ``[0, moe_expert_num)``.
        send_offset, send_token_idx, recv_offset, recv_count: the routing inputs of ``notify_dispatch``
            (``[E]``, ``[bs*K]``, ``[E]``, ``[E]`` int32).
        moe_expert_num: E (global experts), divisible by the EP world size.
        global_bs: globalBs; ``global_bs // R`` (maxBs) bounds every rank's bs and sizes the combine area.
        quant_mode: 0 (none: rows keep x's dtype) or 2 (DynamicQuant: int8 rows and float32 scales).
        diagnose: collect the per-source-rank wait cost (``wait_recv_cost_stats``, microseconds).
        wait_recv_cost_stats: optional ``[R] int32`` array the costs are added into (CAM's optional output);
            implies ``diagnose``.
        ep_world_size, ep_rank_id, tp_world_size, tp_rank_id: the op attributes; default the context's (a
            value that differs from the context is checked by the tiling and then rejected).
        recv_x_out, x_scales_out, assist_info_out: optional output buffers with at least A rows (``[A_cap, H]``,
            ``[A_cap]``, ``[3 A_cap]``), as aclnn callers pass them; the outputs are their first A rows. Reusing
            buffers across calls saves the page faults of fresh arrays.

    Returns:
        ``DispatchOutput``.

    Raises:
        TilingError: a host check failed (limits, window size "HCCL_BUFFSIZE is too SMALL").
        WaitTimeoutError: a sender's flags did not arrive (the message lists the missing slots).
    """
    me = ctx.ep_rank_id
    x, topk_idx = np.asarray(x), np.asarray(topk_idx)
    if x.ndim != 2 or topk_idx.ndim != 2:
        raise ValueError(f"pe {me}: moe_dispatch_normal: x must be [bs, H] and topk_idx [bs, K], got "
                         f"{list(x.shape)} and {list(topk_idx.shape)}")
    info = MoeDispatchNormalInfo(
        **op_attrs(ctx, ep_world_size, ep_rank_id, tp_world_size, tp_rank_id),
        moe_expert_num=int(moe_expert_num), quant_mode=int(quant_mode), global_bs=int(global_bs),
        bs=x.shape[0], k=topk_idx.shape[1], h=x.shape[1], aiv_num=ctx.aiv_num, total_win_size=ctx.total_win_size,
        is_enable_diagnose=diagnose or wait_recv_cost_stats is not None, topk_rows=topk_idx.shape[0],
        x_dtype=x.dtype)
    check_dispatch_tiling(info)
    check_context(ctx, info, "moe_dispatch_normal")
    routing = _routing(info, topk_idx, send_offset, send_token_idx, recv_offset, recv_count)
    layout = DispatchLayout(info.h, 1 if info.is_quant else x.dtype.itemsize, x.dtype.itemsize)
    run = _Run(ctx, np.ascontiguousarray(x), topk_idx, routing, info, layout,
               (recv_x_out, x_scales_out, assist_info_out))
    shmemx.launch(_kernel, ctx.aiv_num, run)
    return _output(run, routing.recv_count, wait_recv_cost_stats)
