"""The hold-out's own model of DeepEP dispatch + combine, written from DeepEP's documented semantics.

Every rank can rebuild every other rank's inputs from (seed, rank), so each rank computes what it must receive
and what its combine must return without any communication. The semantics (DeepEP's normal-mode API):

* rank ``me`` receives, for source ranks in ascending order and tokens of a source in ascending order, each
  token that has at least one of its top-k experts on ``me`` (experts ``[me * L, (me + 1) * L)``), exactly once
  however many of its experts live there; with it its top-k row made local (expert - me * L where local, -1
  elsewhere) and its weights (0 where not local);
* ``num_recv_tokens_per_expert_list[j]``: how many received (token, slot) pairs name local expert j;
* ``rank_prefix_matrix[i][j]``: tokens ranks 0..i send to rank j;
* combine: token t of a source gets back the float32 sum, over the ranks it went to in ascending order, of the
  rows those ranks hand to combine for it, rounded once to bfloat16; its top-k weights summed the same way.

Nothing is imported from the project but dtypes: this file is the oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)


@dataclass
class Inputs:
    """One source rank's dispatch inputs."""

    x: np.ndarray            # [T, H] bf16
    x2: np.ndarray           # [T, H] bf16, for the cached dispatch
    q: np.ndarray            # [T, H] int8 (a quantised payload)
    q_scales: np.ndarray     # [T, ceil(H/128)] f32
    topk_idx: np.ndarray     # [T, K] int64, -1 = no expert
    topk_weights: np.ndarray  # [T, K] f32 (non-zero also where the index is -1)


def tokens_of(src: int, base_tokens: int) -> int:
    """Ranks pass different token counts (T, T-3, T-6, ...; at least 1)."""
    return max(1, base_tokens - 3 * (src % 4))


def make_inputs(src: int, n_ranks: int, base_tokens: int, hidden: int, topk: int, experts: int, seed: int,
                skew: float = 0.0) -> Inputs:
    """Deterministic inputs of rank ``src``: a bf16 payload, an int8 payload with scales, a routing where
    about one token in nine goes nowhere, one in five uses fewer than K experts, experts are distinct per
    token and (``skew`` > 0) Zipf-distributed over the experts."""
    rng = np.random.default_rng([seed, src, n_ranks])
    t = tokens_of(src, base_tokens)
    x = rng.standard_normal((t, hidden), dtype=np.float32).astype(BF16)
    x2 = (rng.standard_normal((t, hidden), dtype=np.float32) * 3).astype(BF16)
    q = rng.integers(-128, 128, (t, hidden), dtype=np.int16).astype(np.int8)
    q_scales = rng.random((t, -(-hidden // 128)), dtype=np.float32) + np.float32(0.5)
    if skew > 0:
        p = 1.0 / np.arange(1, experts + 1) ** skew
        p = p[rng.permutation(experts)]
        p /= p.sum()
    else:
        p = None
    idx = np.full((t, topk), -1, np.int64)
    for i in range(t):
        roll = rng.random()
        if roll < 1 / 9:
            continue  # a token that goes nowhere
        k = int(rng.integers(1, topk + 1)) if roll < 1 / 9 + 0.2 else topk
        chosen = rng.choice(experts, size=k, replace=False, p=p)
        slots = rng.permutation(topk)[:k]  # the -1 slots land anywhere in the row
        idx[i, slots] = chosen
    weights = (rng.random((t, topk), dtype=np.float32) + np.float32(0.25)).astype(np.float32)
    return Inputs(x, x2, q, q_scales, idx, weights)


@dataclass
class Expected:
    src_rank: np.ndarray       # [R] which rank each received row comes from
    src_token: np.ndarray      # [R] which token of that rank
    topk_idx: np.ndarray       # [R, K] local or -1
    topk_weights: np.ndarray   # [R, K]
    per_expert: list           # [L] (token, slot) selections of each local expert
    rank_prefix: np.ndarray    # [P, P]


def local_experts(me: int, n_ranks: int, experts: int) -> tuple[int, int]:
    per = experts // n_ranks
    return me * per, (me + 1) * per


def goes_to(idx: np.ndarray, rank: int, n_ranks: int, experts: int) -> np.ndarray:
    """[T] bool: the tokens with at least one expert on ``rank``."""
    lo, hi = local_experts(rank, n_ranks, experts)
    return ((idx >= lo) & (idx < hi)).any(axis=1)


def expected_dispatch(me: int, inputs: list, n_ranks: int, experts: int) -> Expected:
    lo, hi = local_experts(me, n_ranks, experts)
    ranks, toks, idxs, ws = [], [], [], []
    for src, inp in enumerate(inputs):
        for t in range(inp.topk_idx.shape[0]):
            row = inp.topk_idx[t]
            here = (row >= lo) & (row < hi)
            if not here.any():
                continue
            ranks.append(src)
            toks.append(t)
            idxs.append(np.where(here, row - lo, -1))
            ws.append(np.where(here, inp.topk_weights[t], np.float32(0)).astype(np.float32))
    k = inputs[0].topk_idx.shape[1]
    per_expert = [0] * (hi - lo)
    for row in idxs:
        for v in row:
            if v >= 0:
                per_expert[int(v)] += 1
    prefix = np.zeros((n_ranks, n_ranks), np.int64)
    for i, inp in enumerate(inputs):
        counts = np.array([goes_to(inp.topk_idx, j, n_ranks, experts).sum() for j in range(n_ranks)])
        prefix[i] = counts + (prefix[i - 1] if i else 0)
    return Expected(np.array(ranks, np.int64), np.array(toks, np.int64),
                    np.array(idxs, np.int64).reshape(-1, k), np.array(ws, np.float32).reshape(-1, k),
                    per_expert, prefix)


def gather_rows(exp: Expected, inputs: list, field: str) -> np.ndarray:
    """The received rows of ``field`` ("x", "x2", "q", "q_scales") in the expected order."""
    first = getattr(inputs[0], field)
    if len(exp.src_rank) == 0:
        return np.zeros((0,) + first.shape[1:], first.dtype)
    return np.stack([getattr(inputs[s], field)[t] for s, t in zip(exp.src_rank, exp.src_token)])


def expert_scale(rank: int, local_weights: np.ndarray) -> np.ndarray:
    """[R] f32: what rank ``rank``'s stand-in expert multiplies each received row by. Ranks r with r % 3 != 2
    scale by (-1)^r 2^20 (exact, so rows of two such ranks cancel exactly), the others by (1 + r/4) 2^-10 times
    the sum of the row's local weights (summed slot by slot in float32, the same arithmetic on both sides):
    the float32 sum over ranks then depends on its order, which the oracle pins (ascending ranks)."""
    if rank % 3 != 2:
        return np.full(local_weights.shape[0], np.float32((-1) ** rank * 2.0 ** 20))
    acc = np.zeros(local_weights.shape[0], np.float32)
    for k in range(local_weights.shape[1]):
        acc = (acc + local_weights[:, k]).astype(np.float32)
    return (acc * np.float32((1 + rank / 4) * 2.0 ** -10)).astype(np.float32)


def expert_rows(rank: int, rows: np.ndarray, local_weights: np.ndarray) -> np.ndarray:
    """The stand-in expert's output: bf16(f32(row) * scale)."""
    return (rows.astype(np.float32) * expert_scale(rank, local_weights)[:, None]).astype(BF16)


def expected_combine(me: int, inputs: list, n_ranks: int, experts: int, field: str = "x") -> tuple:
    """(combined [T, H] bf16, combined weights [T, K] f32, |rows| sum [T, H] f64) for rank ``me``'s tokens:
    per token the float32 sum over the ranks it went to, ascending, of what each rank's expert returns."""
    mine = inputs[me]
    payload = getattr(mine, field)
    t, h = payload.shape
    k = mine.topk_idx.shape[1]
    acc = np.zeros((t, h), np.float32)
    wacc = np.zeros((t, k), np.float32)
    abs_sum = np.zeros((t, h), np.float64)
    for r in range(n_ranks):
        lo, hi = local_experts(r, n_ranks, experts)
        here = (mine.topk_idx >= lo) & (mine.topk_idx < hi)
        sel = here.any(axis=1)
        if not sel.any():
            continue
        w = np.where(here[sel], mine.topk_weights[sel], np.float32(0)).astype(np.float32)
        y = expert_rows(r, payload[sel], w).astype(np.float32)
        acc[sel] = (acc[sel] + y).astype(np.float32)
        wacc[sel] = (wacc[sel] + w).astype(np.float32)
        abs_sum[sel] += np.abs(y.astype(np.float64))
    return acc.astype(BF16), wacc, abs_sum
