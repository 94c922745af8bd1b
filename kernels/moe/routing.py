"""Routing: from each token's top-k experts to the counts and positions that dispatch and combine need.

Everything here is plain numpy on one PE's own data; nothing communicates. Words as in DeepEP:

* ``topk_idx [T, K] int64``: the global experts a token chose, -1 for "no expert in this slot".
  Expert ``e`` lives on rank ``e // E_loc`` (``E_loc = E / P`` local experts per rank) as local expert
  ``e % E_loc``.
* ``is_token_in_rank [T, P] bool``: the token goes to rank r (at least one of its experts lives there). A token
  is sent once per rank, however many of that rank's experts it chose.
* A channel (one AIV block) owns the contiguous token slice ``[c * ceil(T/C), min((c+1) * ceil(T/C), T))``.
  ``channel_prefix_matrix [P, C] int32`` is the sender's inclusive prefix over channels of the tokens it sends
  to each rank; the rows a channel sends to rank r land there in token order, after the rows of the channels
  before it.
* ``send_head [T, P] int32``: the row of token t among the rows this PE sends to rank r (channel after channel,
  token order; it is also where combine puts the row back), -1 where the token is not sent to r.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = [
    "DispatchLayout",
    "check_topk_idx",
    "get_dispatch_layout",
    "channel_bounds",
    "channel_counts",
    "make_send_head",
    "RankRows",
    "rows_before_rank",
]


class RankRows(NamedTuple):
    """One PE's share of ``rank_prefix_matrix [P, P]`` (what its dispatch and combine read of it), without the
    ``[P, P]`` counts: a PE needs its own column and row only.

    Attributes:
        recv: ``[P] int64`` rows each source sends this PE (column ``me`` of the counts).
        sent: ``[P] int64`` rows this PE sends each destination (row ``me`` of the counts).
        recv_hi: ``[P] int64`` where each source's rows end here (``rank_prefix_matrix[:, me]``).
        rank_base: ``[P] int64`` where this PE's rows start at each destination (``rank_prefix_matrix[me - 1]``).
    """

    recv: np.ndarray
    sent: np.ndarray
    recv_hi: np.ndarray
    rank_base: np.ndarray

    @classmethod
    def of(cls, rank_prefix_matrix: np.ndarray, me: int) -> "RankRows":
        prefix = rank_prefix_matrix
        recv_hi = prefix[:, me].astype(np.int64)
        recv = recv_hi.copy()
        recv[1:] -= recv_hi[:-1]
        base = prefix[me - 1].astype(np.int64) if me > 0 else np.zeros(prefix.shape[1], np.int64)
        return cls(recv, prefix[me].astype(np.int64) - base, recv_hi, base)

    @property
    def recv_lo(self) -> np.ndarray:
        """``[P] int64`` where each source's rows start here."""
        return self.recv_hi - self.recv

    @property
    def num_recv(self) -> int:
        return int(self.recv_hi[-1])


def rows_before_rank(rank_prefix_matrix: np.ndarray, me: int) -> np.ndarray:
    """``[P] int64``: the rows each source sends to the ranks below ``me`` (where its rows for ``me`` start in
    its send order), from ``rank_prefix_matrix [P, P]`` by sums along its rows (no ``[P, P]`` counts)."""
    below = rank_prefix_matrix[:, :me].sum(1, dtype=np.int64)
    below[1:] -= below[:-1].copy()
    return below


class DispatchLayout(NamedTuple):
    """What ``get_dispatch_layout`` returns, in DeepEP's order.

    Attributes:
        num_tokens_per_rank: ``[P] int32``, tokens sent to each rank (a token counts once per rank).
        num_tokens_per_rdma_rank: ``[P / server_size] int32`` tokens sent to each server, or None when no
            server size is configured (one server, as intranode DeepEP).
        num_tokens_per_expert: ``[E] int32``, (token, slot) selections of each global expert.
        is_token_in_rank: ``[T, P] bool``.
    """

    num_tokens_per_rank: np.ndarray
    num_tokens_per_rdma_rank: np.ndarray | None
    num_tokens_per_expert: np.ndarray
    is_token_in_rank: np.ndarray


def check_topk_idx(topk_idx: np.ndarray, num_experts: int, what: str = "topk_idx") -> np.ndarray:
    """``topk_idx`` as a ``[T, K] int64`` array; ValueError/TypeError naming the bad shape, dtype or value."""
    arr = np.asarray(topk_idx)
    if arr.ndim != 2:
        raise ValueError(f"{what} must be [num_tokens, num_topk], got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{what} must be an integer array (int64, -1 = no expert), got {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < -1 or hi >= num_experts:
            bad = lo if lo < -1 else hi
            t, k = np.argwhere(arr == bad)[0]
            raise ValueError(f"{what}[{t}, {k}] = {bad} is not an expert in -1..{num_experts - 1} "
                             f"(-1 = no expert)")
    return arr


def get_dispatch_layout(topk_idx: np.ndarray, num_experts: int, num_ranks: int, *,
                        server_size: int | None = None) -> DispatchLayout:
    """Per-rank, per-expert (and per-server) counts and the token-to-rank mask of one PE's routing.

    Args:
        topk_idx: ``[T, K]`` integer, -1 = no expert.
        num_experts: E, a multiple of ``num_ranks``.
        num_ranks: P.
        server_size: ranks per server; when given, ``num_tokens_per_rdma_rank`` counts tokens per server.

    Returns:
        ``DispatchLayout``; all counts int32, the mask bool.
    """
    if num_ranks < 1 or num_experts % num_ranks:
        raise ValueError(f"num_experts {num_experts} must be a positive multiple of the number of ranks "
                         f"{num_ranks}")
    idx = check_topk_idx(topk_idx, num_experts)
    local = num_experts // num_ranks
    valid = idx >= 0
    is_token_in_rank = np.zeros((idx.shape[0], num_ranks), bool)
    rows = np.broadcast_to(np.arange(idx.shape[0])[:, None], idx.shape)
    is_token_in_rank[rows[valid], idx[valid] // local] = True
    per_rank = is_token_in_rank.sum(0, dtype=np.int64).astype(np.int32)
    per_expert = np.bincount(idx[valid], minlength=num_experts).astype(np.int32)
    per_server = None
    if server_size is not None:
        if server_size < 1 or num_ranks % server_size:
            raise ValueError(f"server_size {server_size} must divide the number of ranks {num_ranks}")
        in_server = is_token_in_rank.reshape(idx.shape[0], num_ranks // server_size, server_size).any(2)
        per_server = in_server.sum(0, dtype=np.int64).astype(np.int32)
    return DispatchLayout(per_rank, per_server, per_expert, is_token_in_rank)


def channel_bounds(num_tokens: int, num_channels: int) -> np.ndarray:
    """``[C + 1] int64`` token bounds: channel c owns ``[b[c], b[c+1])`` (``ceil(T/C)`` tokens each, the tail
    channels possibly fewer or none)."""
    per = -(-num_tokens // num_channels) if num_tokens else 0
    return np.minimum(np.arange(num_channels + 1, dtype=np.int64) * per, num_tokens)


def channel_counts(is_token_in_rank: np.ndarray, num_channels: int) -> np.ndarray:
    """``[P, C] int64``: tokens channel c sends to rank r."""
    bounds = channel_bounds(is_token_in_rank.shape[0], num_channels)
    # int32 sums (at most T): an int64 [T + 1, P] is a fresh mapping of the allocator at 256 PEs, faulted per call
    cum = np.zeros((is_token_in_rank.shape[0] + 1, is_token_in_rank.shape[1]), np.int32)
    np.cumsum(is_token_in_rank, axis=0, out=cum[1:])
    return (cum[bounds[1:]] - cum[bounds[:-1]]).T.astype(np.int64)


def make_send_head(is_token_in_rank: np.ndarray) -> np.ndarray:
    """``[T, P] int32``: row of token t among the rows sent to rank r (token order), -1 if not sent."""
    pos = np.cumsum(is_token_in_rank, axis=0, dtype=np.int32) - 1
    return np.where(is_token_in_rank, pos, np.int32(-1))
