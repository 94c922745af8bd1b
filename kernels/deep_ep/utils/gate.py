"""``deep_ep.utils.gate``: the routing scores DeepEP V2's tests draw (needs torch).

``get_unbalanced_scores(T, E, P, K, ratio, precise=False)``: uniform scores in [0, 1), except that rank 0's
experts draw from [0, factor), with ``factor`` found by bisection so that rank 0 receives about ``ratio`` times the
tokens of the average other rank (ratio 1: factor 1, balanced). ``precise=True`` (an exact construction of the
counts) is refused with ``NotImplementedError``.
"""

from __future__ import annotations

import torch

__all__ = ["get_scores_by_factor", "map_unbalanced_ratio_to_factor", "get_random_unbalanced_scores",
           "get_unbalanced_scores"]


def get_scores_by_factor(num_tokens: int, num_experts: int, num_ranks: int, factor: float) -> torch.Tensor:
    """``[T, E] float32``: rank 0's experts uniform in [0, factor), the others in [0, 1)."""
    local = num_experts // num_ranks
    scores = torch.empty((num_tokens, num_experts), dtype=torch.float32)
    scores[:, :local].uniform_(0, factor)
    scores[:, local:].uniform_(0, 1)
    return scores


def _rank0_excess(num_tokens, num_experts, num_ranks, num_topk, factor) -> float:
    scores = get_scores_by_factor(num_tokens, num_experts, num_ranks, factor)
    rank = torch.topk(scores, num_topk, dim=-1).indices // (num_experts // num_ranks)
    hit = torch.zeros((num_tokens, num_ranks), dtype=torch.bool)
    hit.scatter_(1, rank, True)
    counts = hit.float().sum(0)
    return counts[0].item() / max(counts[1:].mean().item(), 1e-9)


def map_unbalanced_ratio_to_factor(num_tokens: int, num_experts: int, num_ranks: int, num_topk: int,
                                   ratio: float) -> float:
    """The score factor of rank 0 that gives it about ``ratio`` times the tokens of the others (bisection)."""
    lo, hi = 1.0, 100.0
    for _ in range(20):
        mid = (lo + hi) / 2
        if _rank0_excess(num_tokens, num_experts, num_ranks, num_topk, mid) > ratio:
            hi = mid
        else:
            lo = mid
    return lo


def get_random_unbalanced_scores(num_tokens: int, num_experts: int, num_ranks: int, num_topk: int,
                                 ratio: float) -> torch.Tensor:
    factor = 1.0 if ratio == 1.0 else map_unbalanced_ratio_to_factor(num_tokens, num_experts, num_ranks, num_topk,
                                                                     ratio)
    return get_scores_by_factor(num_tokens, num_experts, num_ranks, factor)


def get_unbalanced_scores(num_tokens: int, num_experts: int, num_ranks: int, num_topk: int, ratio: float,
                          precise: bool) -> torch.Tensor:
    if precise:
        raise NotImplementedError("deep_ep.utils.gate.get_unbalanced_scores(precise=True) is not implemented on "
                                  "shmemx (use the random construction: precise=False)")
    return get_random_unbalanced_scores(num_tokens, num_experts, num_ranks, num_topk, ratio)
