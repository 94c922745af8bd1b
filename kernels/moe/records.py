"""What ``Buffer`` hands out and passes around: the dispatch handle, the results, and the records of one call.

DeepEP returns positional tuples; these are named tuples (and a frozen dataclass for the handle) in DeepEP's
order, so that both ``recv_x, *_ = buf.dispatch(...)`` and ``result.recv_x`` read right.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .dispatch import DispatchOutputs

__all__ = ["DispatchHandle", "DispatchResult", "CombineResult"]


@dataclass(frozen=True)
class DispatchHandle:
    """The routing of one dispatch, for cached dispatch and for combine (DeepEP's 6-tuple, typed).

    Attributes:
        rank_prefix_matrix: ``[P, P] int32``, ``[i][j]`` = tokens sent to j by ranks 0..i (the same on every PE);
            rows from source i are ``[M[i-1][me], M[i][me])`` of recv_x.
        channel_prefix_matrix: ``[P, C] int32``, this PE's inclusive prefix over channels of the tokens it sends
            to each rank.
        recv_channel_prefix_matrix: ``[P, C] int32``, start of source s's channel c within s's block here.
        recv_src_idx: ``[num_recv] int32``, source token index of each received row.
        is_token_in_rank: ``[T, P] bool``, this PE's routing mask.
        send_head: ``[T, P] int32``, row of token t among the rows sent to rank r, -1 if not sent.
        num_recv_tokens: rows this PE received.
        hidden: H of the dispatch.
        dest_ranks: ``[T, K] int32`` per token its unique destination ranks, -1 padded (the compact routing
            plan; None until a compact-routing dispatch made it).
        relay: what this PE relayed for other servers (the hierarchy schedule's combine needs it), or None.
    """

    rank_prefix_matrix: np.ndarray
    channel_prefix_matrix: np.ndarray
    recv_channel_prefix_matrix: np.ndarray
    recv_src_idx: np.ndarray
    is_token_in_rank: np.ndarray
    send_head: np.ndarray
    num_recv_tokens: int
    hidden: int
    dest_ranks: np.ndarray | None = None
    relay: object = None

    @property
    def num_tokens(self) -> int:
        return self.is_token_in_rank.shape[0]


class DispatchResult(NamedTuple):
    """What ``dispatch`` returns (DeepEP's order, without the event).

    Attributes:
        recv_x: ``[rows, H] bfloat16``, or a pair (``[rows, H]`` int8 / float8_e4m3fn, ``[rows, H/128] float32``
            scales). rows = received tokens, or ``num_worst_tokens`` when given (tail zero).
        recv_topk_idx: ``[rows, K] int64`` local expert index or -1 (None without top-k or when cached).
        recv_topk_weights: ``[rows, K] float32``, 0 where the index is -1.
        num_recv_tokens_per_expert_list: per local expert, aligned counts (empty with num_worst_tokens, None when
            cached).
        handle: the ``DispatchHandle``.
    """

    recv_x: object
    recv_topk_idx: np.ndarray | None
    recv_topk_weights: np.ndarray | None
    num_recv_tokens_per_expert_list: list | None
    handle: DispatchHandle | None


class Payload(NamedTuple):
    """dispatch's ``x`` as bytes: ``rows [T, row bytes] uint8``, the payload kind (``_KINDS``), the data dtype and
    ``scales [T, ceil(H/128)] float32`` (None for bfloat16)."""

    rows: np.ndarray
    kind: int
    dtype: np.dtype
    scales: np.ndarray | None

    @property
    def num_tokens(self) -> int:
        return self.rows.shape[0]


class Routing(NamedTuple):
    """Where one dispatch's rows go: this PE's ``is_token_in_rank [T, P]``, the rows per channel and rank
    ``per_channel [P, C]``, and the prefix matrices of notify_dispatch (or of a cached dispatch's handle)."""

    is_token_in_rank: np.ndarray
    per_channel: np.ndarray
    rank_prefix_matrix: np.ndarray
    channel_prefix_matrix: np.ndarray
    recv_channel_prefix_matrix: np.ndarray


class DispatchCall(NamedTuple):
    """One dispatch call: its kind for the stats, its sequence number, ``num_worst_tokens`` and the top-k inputs
    (``[T, K]`` int64 / float32, None for a cached dispatch or without top-k)."""

    kind_name: str
    seq: int
    num_worst_tokens: int
    topk_idx: np.ndarray | None = None
    topk_weights: np.ndarray | None = None


class Recv(NamedTuple):
    """The arrays one dispatch returns (``x`` possibly a view of the workspace: ``zero_copy``)."""

    x: np.ndarray
    zero_copy: bool
    src_idx: np.ndarray
    scales: np.ndarray | None
    topk_idx: np.ndarray | None
    topk_weights: np.ndarray | None

    def kernel_outputs(self, payload: Payload, credit: bool) -> DispatchOutputs:
        """Where the dispatch kernel's receivers copy the rows out (``credit``: give the sources their credit
        once copied)."""
        x = None if self.zero_copy else self.x.view(np.uint8).reshape(len(self.x), payload.rows.shape[1])
        return DispatchOutputs(x, self.src_idx, self.topk_idx, self.topk_weights, self.scales, credit=credit)


class CombineResult(NamedTuple):
    """``combined_x [T, H] bfloat16`` and ``combined_topk_weights [T, K] float32`` (None without weights)."""

    combined_x: np.ndarray
    combined_topk_weights: np.ndarray | None
