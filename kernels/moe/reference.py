"""Plain-numpy reference of DeepEP-style dispatch and combine over every PE's inputs, and the test helpers.

Nothing here communicates: give it the inputs of all PEs (tests regenerate them from per-rank seeds) and it
computes what one PE must receive. It follows the semantics in ``reference/deepep.md`` (section 1.4, 1.5):

* receiver ``me`` gets, source rank by source rank and in token order within a source, each token that has at
  least one expert on ``me``: its row, its source index, its top-k experts as local indices (-1 for experts
  elsewhere) and their weights (0 there);
* ``num_recv_tokens_per_expert_list[j]`` is the (token, slot) selections of local expert j over all sources,
  rounded up to ``expert_alignment``;
* combine returns to each source token the float32 sum, in ascending rank order, of the rows the ranks it went
  to send back, rounded once to bfloat16 (round to nearest even).

Also here: ``calc_diff`` (DeepEP's test metric), per-128-column float8 e4m3 / int8 casts and their inverse,
and ``origin_x``, a payload that encodes (source rank, token) exactly in bfloat16.
"""

from __future__ import annotations

from typing import NamedTuple

import ml_dtypes
import numpy as np

from .routing import get_dispatch_layout

__all__ = [
    "RefDispatch",
    "reference_dispatch",
    "reference_combine",
    "rank_prefix_matrix",
    "calc_diff",
    "per_token_cast_to_fp8",
    "per_token_cast_to_int8",
    "per_token_cast_back",
    "origin_x",
    "bf16",
    "FP8",
]

bf16 = ml_dtypes.bfloat16
FP8 = ml_dtypes.float8_e4m3fn
FP8_MAX = 448.0
INT8_MAX = 127.0


class RefDispatch(NamedTuple):
    """What PE ``me`` receives: ``recv_x`` ([n, H], or (data, scales)), ``recv_topk_idx [n, K] int64``,
    ``recv_topk_weights [n, K] float32``, ``num_recv_tokens_per_expert_list`` (list of int),
    ``recv_src_idx [n] int32``, ``recv_src_rank [n] int32``, ``rank_prefix_matrix [P, P] int32``."""

    recv_x: object
    recv_topk_idx: np.ndarray | None
    recv_topk_weights: np.ndarray | None
    num_recv_tokens_per_expert_list: list
    recv_src_idx: np.ndarray
    recv_src_rank: np.ndarray
    rank_prefix_matrix: np.ndarray


def rank_prefix_matrix(topk_idxs: list, num_experts: int) -> np.ndarray:
    """``[P, P] int32``: ``[i][j]`` = tokens sent to j by ranks 0..i (inclusive prefix over sources)."""
    n = len(topk_idxs)
    counts = np.stack([get_dispatch_layout(t, num_experts, n).num_tokens_per_rank for t in topk_idxs])
    return np.cumsum(counts, axis=0).astype(np.int32)


def reference_dispatch(xs: list, topk_idxs: list, topk_weights: list | None, num_experts: int, me: int, *,
                       expert_alignment: int = 1) -> RefDispatch:
    """What PE ``me`` receives from a dispatch of every PE's tokens.

    Args:
        xs: per source rank, ``[T_s, H]`` array or a pair (data ``[T_s, H]``, scales ``[T_s, H/128]``).
        topk_idxs: per source rank, ``[T_s, K]`` int64, -1 = no expert.
        topk_weights: per source rank, ``[T_s, K]`` float32, or None.
        num_experts: E.
        me: the receiving PE.
    """
    n = len(xs)
    local = num_experts // n
    quantised = isinstance(xs[0], tuple)
    rows, scales, src_idx, src_rank, idx_out, w_out = [], [], [], [], [], []
    per_expert = np.zeros(local, np.int64)
    for s in range(n):
        idx = np.asarray(topk_idxs[s], np.int64)
        on_me = (idx >= me * local) & (idx < (me + 1) * local)
        toks = np.flatnonzero(on_me.any(1))
        per_expert += np.bincount(idx[on_me] - me * local, minlength=local)
        data = xs[s][0] if quantised else xs[s]
        rows.append(np.asarray(data)[toks])
        if quantised:
            scales.append(np.asarray(xs[s][1])[toks])
        src_idx.append(toks.astype(np.int32))
        src_rank.append(np.full(len(toks), s, np.int32))
        idx_out.append(np.where(on_me[toks], idx[toks] - me * local, -1))
        if topk_weights is not None:
            w_out.append(np.where(on_me[toks], np.asarray(topk_weights[s], np.float32)[toks], 0).astype(np.float32))
    recv_x = np.concatenate(rows)
    if quantised:
        recv_x = (recv_x, np.concatenate(scales).astype(np.float32))
    counts = [int(-(-c // expert_alignment) * expert_alignment) for c in per_expert]
    return RefDispatch(recv_x, np.concatenate(idx_out).astype(np.int64),
                       np.concatenate(w_out) if topk_weights is not None else None, counts,
                       np.concatenate(src_idx), np.concatenate(src_rank), rank_prefix_matrix(topk_idxs, num_experts))


def reference_combine(recv_xs: list, topk_idxs: list, num_experts: int, me: int,
                      recv_topk_weights: list | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """What source PE ``me`` gets back from a combine.

    Args:
        recv_xs: per rank r, the ``[n_r, H]`` bfloat16 rows r combines (aligned with what r received).
        topk_idxs: per source rank, ``[T_s, K]`` (the routing of the dispatch being undone).
        num_experts: E.
        me: the source PE whose tokens are combined.
        recv_topk_weights: per rank r, ``[n_r, K]`` float32, or None.

    Returns:
        ``combined_x [T_me, H] bfloat16`` and ``combined_topk_weights [T_me, K] float32`` (or None).
    """
    n = len(recv_xs)
    prefix = rank_prefix_matrix(topk_idxs, num_experts)
    mask = get_dispatch_layout(topk_idxs[me], num_experts, n).is_token_in_rank
    n_tok, hidden = mask.shape[0], np.asarray(recv_xs[0]).shape[1]
    acc = np.zeros((n_tok, hidden), np.float32)
    k = np.asarray(topk_idxs[me]).shape[1]
    wacc = np.zeros((n_tok, k), np.float32) if recv_topk_weights is not None else None
    for r in range(n):  # ascending rank, as DeepEP's kernel sums
        toks = np.flatnonzero(mask[:, r])
        start = int(prefix[me - 1, r]) if me > 0 else 0
        acc[toks] += np.asarray(recv_xs[r][start:start + len(toks)]).astype(np.float32)
        if wacc is not None:
            wacc[toks] += np.asarray(recv_topk_weights[r][start:start + len(toks)], np.float32)
    return acc.astype(bf16), wacc


def calc_diff(x: np.ndarray, y: np.ndarray) -> float:
    """DeepEP's test metric: ``1 - 2 sum(xy) / sum(x^2 + y^2)`` over both shifted by +1, in float64
    (0 = identical)."""
    a = np.asarray(x).astype(np.float64) + 1
    b = np.asarray(y).astype(np.float64) + 1
    denom = float((a * a + b * b).sum())
    return float(1 - 2 * (a * b).sum() / denom) if denom else 0.0


def _blocks(x) -> tuple[np.ndarray, int]:
    x = np.asarray(x).astype(np.float32)
    t, h = x.shape
    pad = -(-h // 128) * 128
    if pad != h:
        x = np.concatenate([x, np.zeros((t, pad - h), np.float32)], axis=1)
    return x.reshape(t, pad // 128, 128), h


def per_token_cast_to_fp8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """DeepEP's cast: per 128-column block, amax (at least 1e-4) scales the block to 448 in float8 e4m3.

    Returns ``(data [T, H] float8_e4m3fn, scales [T, ceil(H/128)] float32)`` with x ~= data * scales."""
    blocks, h = _blocks(x)
    amax = np.maximum(np.abs(blocks).max(2), 1e-4)
    data = (blocks * (FP8_MAX / amax)[:, :, None]).astype(FP8).reshape(blocks.shape[0], -1)[:, :h]
    return np.ascontiguousarray(data), (amax / FP8_MAX).astype(np.float32)


def per_token_cast_to_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The int8 analogue: per 128-column block, scale = amax / 127, data = round(x / scale).

    Returns ``(data [T, H] int8, scales [T, ceil(H/128)] float32)``."""
    blocks, h = _blocks(x)
    amax = np.maximum(np.abs(blocks).max(2), 1e-4)
    scale = (amax / INT8_MAX).astype(np.float32)
    data = np.clip(np.rint(blocks / scale[:, :, None]), -127, 127).astype(np.int8)
    return np.ascontiguousarray(data.reshape(blocks.shape[0], -1)[:, :h]), scale


def per_token_cast_back(data: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """``data * scales`` per 128-column block, as ``[T, H] float32``."""
    data = np.asarray(data).astype(np.float32)
    t, h = data.shape
    cols = np.repeat(np.asarray(scales, np.float32), 128, axis=1)[:, :h]
    return data * cols


def origin_x(rank: int, num_tokens: int, hidden: int) -> np.ndarray:
    """``[T, H] bfloat16`` rows that say where they come from, exactly representable in bfloat16.

    Columns: 0 = rank + 1, 1 = token // 128, 2 = token % 128, the rest (rank + 1) + (column % 4) / 4; every
    value is small with few significant bits, so rows compare exactly after a trip through bfloat16.
    """
    x = np.empty((num_tokens, hidden), np.float32)
    x[:] = (rank + 1) + (np.arange(hidden) % 4) / 4
    t = np.arange(num_tokens)
    x[:, 0] = rank + 1
    if hidden > 2:
        x[:, 1] = t // 128
        x[:, 2] = t % 128
    return x.astype(bf16)
