"""Plain-numpy references of what ``shmemx.deep_ep`` computes, over every rank's inputs (nothing communicates).

* Dispatch, intranode and internode alike: ``shmemx.kernels.moe.reference.reference_dispatch`` (rows grouped by
  global source rank, token order within a source).
* ``reference_internode_combine``: DeepEP's two-tier numerics, a float32 sum per server rounded to bfloat16 at
  the forwarder, then the biases and those partial sums in float32 at the source, rounded once more.
* ``reference_low_latency_dispatch`` / ``reference_low_latency_combine``: the packed per-expert layout (sources in
  ascending order) and the weighted sum in top-k order.
"""

from __future__ import annotations

import numpy as np

from shmemx.kernels.moe import reference as _moe_ref
from shmemx.kernels.moe.routing import get_dispatch_layout

from .low_latency import cast_fp8_per_128

__all__ = ["reference_dispatch", "reference_internode_combine", "reference_low_latency_dispatch",
           "reference_low_latency_combine"]

bf16 = _moe_ref.bf16
reference_dispatch = _moe_ref.reference_dispatch


def _bias_sum(bias, shape) -> np.ndarray:
    total = np.zeros(shape, np.float32)
    for b in (bias if isinstance(bias, (tuple, list)) else (bias,)) if bias is not None else ():
        if b is not None:
            total += np.asarray(b).astype(np.float32)
    return total


def reference_internode_combine(recv_xs: list, topk_idxs: list, num_experts: int, me: int, server_size: int, *,
                                recv_topk_weights: list | None = None,
                                bias: np.ndarray | tuple | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """What source rank ``me`` gets back from an internode combine.

    Args:
        recv_xs: per rank r, the ``[n_r, H]`` bfloat16 rows r combines (aligned with what r received).
        topk_idxs: per source rank, ``[T_s, K]`` (the routing of the dispatch being undone).
        num_experts: E.
        me: the source rank.
        server_size: S.
        recv_topk_weights: per rank r, ``[n_r, K]`` float32, or None.
        bias: None, one or a pair of ``[T_me, H]`` bfloat16.

    Returns:
        ``combined_x [T, H] bfloat16`` and ``combined_topk_weights [T, K] float32`` (or None).
    """
    n = len(recv_xs)
    prefix = _moe_ref.rank_prefix_matrix(topk_idxs, num_experts)
    mask = get_dispatch_layout(topk_idxs[me], num_experts, n).is_token_in_rank
    n_tok, hidden = mask.shape[0], np.asarray(recv_xs[0]).shape[1]
    total = _bias_sum(bias, (n_tok, hidden))
    k = np.asarray(topk_idxs[me]).shape[1]
    wtotal = np.zeros((n_tok, k), np.float32) if recv_topk_weights is not None else None
    for server in range(n // server_size):
        part = np.zeros((n_tok, hidden), np.float32)
        wpart = np.zeros((n_tok, k), np.float32)
        for r in range(server * server_size, (server + 1) * server_size):  # ascending rank within the server
            toks = np.flatnonzero(mask[:, r])
            start = int(prefix[me - 1, r]) if me > 0 else 0
            part[toks] += np.asarray(recv_xs[r][start:start + len(toks)]).astype(np.float32)
            if wtotal is not None:
                wpart[toks] += np.asarray(recv_topk_weights[r][start:start + len(toks)], np.float32)
        went = mask[:, server * server_size:(server + 1) * server_size].any(1)
        total[went] += part[went].astype(bf16).astype(np.float32)  # the forwarder's rounding
        if wtotal is not None:
            wtotal[went] += wpart[went]
    return total.astype(bf16), wtotal


def reference_low_latency_dispatch(xs: list, topk_idxs: list, num_experts: int, me: int, *, use_fp8: bool,
                                   round_scale: bool = False) -> list:
    """Per local expert of ``me``: ``(rows [m, H] (bfloat16, or float8 data and scale_inv [m, H/128]),
    src_info [m] int32, counts per source [P] int64)``, sources in ascending order, token order within."""
    n = len(xs)
    local = num_experts // n
    out = []
    for e in range(local):
        expert = me * local + e
        rows, scales, src, counts = [], [], [], np.zeros(n, np.int64)
        for s in range(n):
            toks = np.flatnonzero((np.asarray(topk_idxs[s]) == expert).any(1))
            counts[s] = len(toks)
            x = np.asarray(xs[s])[toks]
            if use_fp8:
                data, scale_inv = cast_fp8_per_128(x, round_scale)
                rows.append(data)
                scales.append(scale_inv)
            else:
                rows.append(x)
            src.append(toks.astype(np.int32))
        data = np.concatenate(rows)
        out.append(((data, np.concatenate(scales)) if use_fp8 else data, np.concatenate(src), counts))
    return out


def reference_low_latency_combine(expert_rows: list, topk_idx: np.ndarray, topk_weights: np.ndarray,
                                  num_experts: int, me: int) -> np.ndarray:
    """``[T, H] bfloat16``: per token of ``me``, ``sum_k w[t, k] * y`` in top-k order (float32), rounded once;
    ``expert_rows[g]`` maps a source token of ``me`` to expert g's output row for it (a dict, or None)."""
    idx = np.asarray(topk_idx, np.int64)
    w = np.asarray(topk_weights, np.float32)
    hidden = next(np.asarray(r).shape[-1] for rows in expert_rows if rows for r in rows.values())
    out = np.zeros((idx.shape[0], hidden), np.float32)
    for t in range(idx.shape[0]):
        for k in range(idx.shape[1]):
            g = int(idx[t, k])
            if g >= 0:
                out[t] += w[t, k] * np.asarray(expert_rows[g][t]).astype(np.float32)
    return out.astype(bf16)
