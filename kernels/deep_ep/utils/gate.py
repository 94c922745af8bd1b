"""``deep_ep.utils.gate``: the routing scores DeepEP V2's tests draw (needs torch).

``get_unbalanced_scores(T, E, P, K, ratio, precise)``: ``[T, E] float32`` scores whose top-K per token is the
routing. Rank 0 is the loaded one: it receives about ``ratio`` times the tokens of every other rank.

* ``precise=False``: uniform scores in [0, 1), except that rank 0's experts draw from [0, factor), with ``factor``
  found by bisection so that rank 0 receives about ``ratio`` times the tokens of the average other rank (ratio 1:
  factor 1, balanced). Random: the other ranks are balanced only on average.
* ``precise=True``: the routing is built first, then scores that select exactly it (DeepEP: "differs from real
  distribution"). Every token touches ``a`` ranks, drawn as the number of distinct ranks of K uniformly random
  experts and kept in ``[ceil(K / E_loc), min(K, P, floor((P - 1) / ratio) + 1)]`` (the upper bound keeps rank
  0's share reachable: it can take each token at most once). Of the ``S`` rank visits, rank 0 takes ``ratio * S /
  (P - 1 + ratio)`` (every token that touches all P ranks, then random others); the rest are dealt to ranks
  1..P-1 round-robin in a random order, so each of them gets the same count within one and a token never gets a
  rank twice. A token's K experts are split evenly over its ranks (a random choice of its ranks takes the
  remainder), distinct random experts within each rank. Its chosen experts score in (0.5, 1], the others in
  [0, 0.5).
"""

from __future__ import annotations

import torch

__all__ = ["get_scores_by_factor", "map_unbalanced_ratio_to_factor", "get_random_unbalanced_scores",
           "get_precise_unbalanced_scores", "get_unbalanced_scores"]

_F32 = torch.float32  # explicit: DeepEP's init_dist makes bfloat16 the default dtype


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


def _ranks_per_token(num_tokens: int, num_experts: int, num_ranks: int, num_topk: int, ratio: float) -> torch.Tensor:
    """``[T] int64``: how many ranks each token touches (see the module docstring)."""
    local = num_experts // num_ranks
    lo, hi = max(1, -(-num_topk // local)), min(num_topk, num_ranks, int((num_ranks - 1) / ratio) + 1)
    if lo > hi:
        raise ValueError(f"get_unbalanced_scores(precise=True): {num_topk} experts of {local} per rank need at least "
                         f"{lo} ranks per token, but a ratio of {ratio} over {num_ranks} ranks allows at most {hi}")
    drawn = torch.rand((num_tokens, num_experts), dtype=_F32).topk(num_topk, dim=1).indices // local
    distinct = (torch.zeros((num_tokens, num_ranks), dtype=torch.bool).scatter_(1, drawn, True)).sum(1)
    return distinct.clamp(lo, hi)


def _deal_ranks(touches: torch.Tensor, num_ranks: int, ratio: float) -> torch.Tensor:
    """``[T, P] bool``: the ranks of each token, rank 0 taking its share and the others dealt round-robin."""
    num_tokens = len(touches)
    total = int(touches.sum())
    must = touches == num_ranks  # a token of every rank has rank 0 too
    share = min(max(round(ratio * total / (num_ranks - 1 + ratio)), int(must.sum())), num_tokens)
    optional = torch.nonzero(~must).flatten()
    optional = optional[torch.randperm(len(optional))[:share - int(must.sum())]]
    special = torch.zeros(num_tokens, dtype=torch.bool)
    special[must] = True
    special[optional] = True
    rest = touches - special.long()  # ranks 1..P-1 each token still needs (at most P - 1)
    ranks = torch.zeros((num_tokens, num_ranks), dtype=torch.bool)
    ranks[:, 0] = special
    if num_ranks > 1 and int(rest.sum()):
        deck = (torch.randperm(num_ranks - 1) + 1).repeat(int(rest.sum()) // (num_ranks - 1) + 1)[:int(rest.sum())]
        owner = torch.repeat_interleave(torch.arange(num_tokens), rest)
        ranks[owner, deck] = True  # consecutive cards of a cycle of P - 1 ranks are distinct
    return ranks


def _pick_experts(ranks: torch.Tensor, num_experts: int, num_topk: int) -> torch.Tensor:
    """``[T, K]``: each token's experts, spread evenly over its ranks, distinct random ones within a rank."""
    num_tokens, num_ranks = ranks.shape
    local = num_experts // num_ranks
    touches = ranks.sum(1, keepdim=True)
    most = int(touches.max())
    mine = torch.where(ranks, torch.rand(ranks.shape, dtype=_F32), 2.0).argsort(1)[:, :most]  # its ranks, shuffled
    place = torch.arange(most).view(1, most)
    count = torch.where(place < touches, num_topk // touches + (place < num_topk % touches).long(), 0)  # [T, A]
    within = torch.rand((num_tokens, most, local), dtype=_F32).argsort(2)  # a random order of each rank's experts
    taken = torch.arange(local).view(1, 1, local) < count.unsqueeze(2)
    return (mine.unsqueeze(2) * local + within)[taken].view(num_tokens, num_topk)


def get_precise_unbalanced_scores(num_tokens: int, num_experts: int, num_ranks: int, num_topk: int,
                                  ratio: float) -> torch.Tensor:
    """``[T, E] float32`` scores whose top-K gives rank 0 ``ratio`` times the tokens of each other rank, the others
    within one token of each other (the construction: the module docstring)."""
    if ratio < 1.0:
        raise ValueError(f"get_unbalanced_scores: ratio must be at least 1.0, got {ratio}")
    touches = _ranks_per_token(num_tokens, num_experts, num_ranks, num_topk, ratio)
    chosen = _pick_experts(_deal_ranks(touches, num_ranks, ratio), num_experts, num_topk)
    scores = torch.rand((num_tokens, num_experts), dtype=_F32) * 0.5
    scores.scatter_(1, chosen, 1.0 - 0.5 * torch.rand(chosen.shape, dtype=_F32))
    return scores


def get_unbalanced_scores(num_tokens: int, num_experts: int, num_ranks: int, num_topk: int, ratio: float,
                          precise: bool) -> torch.Tensor:
    if precise:
        return get_precise_unbalanced_scores(num_tokens, num_experts, num_ranks, num_topk, ratio)
    return get_random_unbalanced_scores(num_tokens, num_experts, num_ranks, num_topk, ratio)
