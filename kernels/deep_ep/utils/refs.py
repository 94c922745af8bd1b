"""``deep_ep.utils.refs``: plain references of DeepEP V2's dispatch and combine, for its tests (needs torch).

``dispatch`` gathers every rank's tokens (torch.distributed, object all-gather: small test sizes) and keeps those
with an expert here, sorted by ``src_token_global_idx = src_rank * num_max_tokens_per_rank + token``;
``combine`` reduces ``[T, K, H]`` rows with DeepEP's recipe: optionally within each rank (and within each scale-up
domain), a group's float32 sum in top-k order rounded once and placed at the group's last slot, then everything
summed in top-k order in float32 from the bias.
"""

from __future__ import annotations

from ..tensors import TensorLike

import math

import torch
import torch.distributed as dist

from ..tensors import _to_torch, to_numpy
from .envs import get_global_seed

__all__ = ["dispatch", "generate_pre_combine_data", "ordered_accumulate", "combine"]


def dispatch(x: TensorLike, topk_idx: torch.Tensor, topk_weights: TensorLike, num_max_tokens_per_rank: int, num_experts: int) -> tuple:
    """Returns ``(recv_x (or (recv_x, recv_sf)), recv_topk_idx [n, K] (local experts, -1 elsewhere),
    recv_topk_weights [n, K], recv_src_token_idx [n] int32, num_recv_tokens_per_rank [P] int32)``."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    if num_experts % num_ranks:
        raise ValueError(f"refs.dispatch: {num_experts} experts on {num_ranks} ranks")
    local = num_experts // num_ranks
    data, sf = x if isinstance(x, tuple) else (x, None)
    weights = topk_weights if topk_weights is not None else torch.zeros(topk_idx.shape, dtype=torch.float32)
    mine = tuple(None if t is None else to_numpy(t).copy() for t in (data, sf, topk_idx, weights))
    gathered = [None] * num_ranks
    dist.all_gather_object(gathered, mine)  # (numpy arrays pickle with their bfloat16 / float8 dtypes)
    everyone = [tuple(None if a is None else _to_torch(a) for a in part) for part in gathered]
    parts = {"x": [], "sf": [], "idx": [], "w": [], "src": []}
    counts = []
    lo, hi = rank * local, (rank + 1) * local
    for src, (d, s, idx, w) in enumerate(everyone):
        chosen = ((idx >= lo) & (idx < hi)).any(dim=1).nonzero(as_tuple=True)[0]
        counts.append(len(chosen))
        parts["x"].append(d[chosen])
        parts["sf"].append(None if s is None else s[chosen])
        sel = idx[chosen]
        parts["idx"].append(torch.where((sel >= lo) & (sel < hi), sel - lo, torch.full_like(sel, -1)))
        parts["w"].append(w[chosen])
        parts["src"].append((chosen + src * num_max_tokens_per_rank).to(torch.int))
    recv_x = torch.cat(parts["x"])
    if sf is not None:
        recv_x = (recv_x, torch.cat(parts["sf"]))
    return (recv_x, torch.cat(parts["idx"]), torch.cat(parts["w"]), torch.cat(parts["src"]),
            torch.tensor(counts, dtype=torch.int))


def generate_pre_combine_data(src_token_global_idx: torch.Tensor, num_max_tokens_per_rank: int, num_topk: int,
                              hidden: int) -> torch.Tensor:
    """``[n, K, H] bfloat16``, a function of each row's source token and top-k slot only (so that the expert side
    and the reference make the same rows): ``sin(((seed * 131071) % max_seed + 1) / max_seed * (h + 1) +
    sin(global seed))`` with ``seed = src_token_global_idx * K + k``, ``max_seed = P * N_max * K``."""
    num_ranks = dist.get_world_size()
    seeds = src_token_global_idx.to(torch.int64)[:, None] * num_topk + torch.arange(num_topk)[None, :]
    max_seed = num_ranks * num_max_tokens_per_rank * num_topk
    phase = ((seeds * 131071 % max_seed).float() + 1) / max_seed
    cols = torch.arange(1, hidden + 1, dtype=torch.float32)
    return torch.sin(phase[:, :, None] * cols[None, None, :] + math.sin(float(get_global_seed()))).to(torch.bfloat16)


def ordered_accumulate(data: torch.Tensor, initial_value: torch.Tensor | None = None) -> torch.Tensor:
    """``[n, K, H]`` summed over K in order, in float32 from ``initial_value`` (or 0), in ``data``'s dtype."""
    acc = torch.zeros((data.shape[0], data.shape[2]), dtype=torch.float32) if initial_value is None \
        else initial_value.float().clone()
    for k in range(data.shape[1]):
        acc += data[:, k, :].float()
    return acc.to(data.dtype)


def _group_reduce(y: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Each group's (per token) float32 sum in top-k order, rounded once, at the group's last slot; 0 elsewhere."""
    n, k, h = y.shape
    sums = torch.zeros((n, k, h), dtype=torch.float32)
    for j in range(k):
        base = torch.zeros((n, h), dtype=torch.float32)
        found = torch.zeros(n, dtype=torch.bool)
        for i in range(j - 1, -1, -1):  # the latest earlier slot of the same group holds the running sum
            take = (group[:, i] == group[:, j]) & ~found
            base[take] = sums[take, i]
            found |= take
        sums[:, j] = base + y[:, j].float()
    out = torch.zeros_like(y)
    for j in range(k):
        last = ~(group[:, j + 1:] == group[:, j:j + 1]).any(dim=1)
        out[last, j] = sums[last, j].to(y.dtype)
    return out


def combine(y: torch.Tensor, topk_idx: torch.Tensor, num_scaleout_ranks: int, num_scaleup_ranks: int,
            num_experts: int, bias: TensorLike, reduce_in_local: bool, reduce_in_scaleup: bool) -> torch.Tensor:
    """``[T, K, H]`` rows of each token's top-k slots combined into ``[T, H]`` with DeepEP's recipe (see the
    module docstring); ``bias``: None, one ``[T, H]`` or a pair (summed in float32 first)."""
    if reduce_in_scaleup and not reduce_in_local:
        raise ValueError("refs.combine: reduce_in_scaleup needs reduce_in_local")
    per_rank = num_experts // (num_scaleout_ranks * num_scaleup_ranks)
    idx = topk_idx.to(torch.int64)
    if reduce_in_local:
        y = _group_reduce(y, torch.div(idx, per_rank, rounding_mode="floor"))
    if reduce_in_scaleup:
        y = _group_reduce(y, torch.div(idx, per_rank * num_scaleup_ranks, rounding_mode="floor"))
    bias_sum = None
    if bias is not None:
        bias_sum = bias[0].float() + bias[1].float() if isinstance(bias, tuple) else bias.float()
    return ordered_accumulate(y, bias_sum)
