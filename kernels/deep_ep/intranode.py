"""Normal mode within one server: DeepEP's intranode dispatch and combine on ``shmemx.kernels.moe.Buffer``.

DeepEP's ``Buffer`` learns the shapes only at the first dispatch; a ``moe.Buffer`` is made for (hidden, top-k
width, experts) then (collectively: every rank dispatches the same shapes), with the most tokens per rank whose
workspace fits in ``num_nvl_bytes``, and made again when a later call brings other shapes. Handles are plain
arrays (``IntranodeHandle``), so a handle outlives the ``moe.Buffer`` that made it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

import shmemx
from shmemx.kernels import moe
from shmemx.kernels.moe.peers import Peers
from shmemx.kernels.moe.records import DispatchHandle
from shmemx.kernels.moe.workspace import plan_workspace

from .handles import IntranodeHandle

__all__ = ["Intranode", "fit_tokens"]


def fit_tokens(budget: int, total_bytes: Callable[[int], int]) -> int:
    """The most tokens per rank ``S`` with ``total_bytes(S) <= budget`` (``total_bytes`` grows with S, about
    linearly); 0 when not even one fits."""
    base, step = total_bytes(0), (total_bytes(1024) - total_bytes(0)) / 1024
    if base + step > budget:
        return 0
    tokens = int((budget - base) // step)
    while tokens > 0 and total_bytes(tokens) > budget:
        tokens -= max(1, tokens // 1000)
    return tokens


class Intranode:
    """The normal-mode engine of a one-server ``deep_ep.Buffer``.

    Args:
        budget: ``num_nvl_bytes``: the most heap bytes the workspace may take.
        num_channels: channels (AIV blocks) of the kernels; None: ``moe.Buffer``'s default.
        peers: the Buffer's team (``moe.peers.Peers``; None: the world): the moe.Buffer runs among its PEs.
    """

    def __init__(self, budget: int, num_channels: int | None = None, peers: Peers | None = None):
        self.budget = budget
        self.peers = Peers.of() if peers is None else peers
        self.num_channels = num_channels
        self.moe: moe.Buffer | None = None
        self.key: tuple | None = None

    def _buffer(self, hidden: int, num_topk: int | None, num_experts: int | None, num_tokens: int) -> moe.Buffer:
        """The ``moe.Buffer`` for these shapes (None fields: whatever the current one has)."""
        old = self.key
        if old is not None:
            num_topk = old[1] if num_topk is None else num_topk
            num_experts = old[2] if num_experts is None else num_experts
        if num_experts is None:
            raise ValueError(f"pe {shmemx.my_pe()}: deep_ep: a cached dispatch or a combine needs a fresh dispatch "
                             f"on this Buffer first")
        key = (hidden, num_topk or 1, num_experts)
        if key == old and num_tokens <= self.moe.max_tokens:
            return self.moe
        self.close()
        n_pes = self.peers.n_pes
        kwargs = {"team": self.peers.team}
        if self.num_channels is not None:
            kwargs["num_channels"] = self.num_channels
        defaults = moe.Config()
        channels = kwargs.get("num_channels", defaults.num_channels)
        qps = moe.POLICY_QPS[defaults.qp_policy]

        def size(tokens: int) -> int:
            return plan_workspace(n_pes=n_pes, max_tokens=tokens, hidden=hidden, num_topk=key[1],
                                  num_experts=num_experts, num_channels=channels, qp_num=qps).total

        tokens = fit_tokens(self.budget, size)
        if tokens < num_tokens:
            raise ValueError(f"pe {shmemx.my_pe()}: deep_ep.Buffer: a dispatch of {num_tokens} tokens of hidden "
                             f"{hidden} (top-{key[1]}, {num_experts} experts, {n_pes} ranks) needs a workspace of "
                             f"{size(num_tokens)} B per rank, more than num_nvl_bytes={self.budget} (which holds "
                             f"{tokens} tokens): make the Buffer with num_nvl_bytes >= {size(num_tokens)}")
        # zero_copy off whatever moe.Buffer's default: DeepEP's dispatch returns fresh tensors
        self.moe = moe.Buffer(tokens, hidden, key[1], num_experts, zero_copy=False, **kwargs)
        self.key = key
        return self.moe

    def dispatch(self, x: np.ndarray | tuple[np.ndarray, np.ndarray], handle: IntranodeHandle | None,
                 num_tokens_per_rank: np.ndarray | None, is_token_in_rank: np.ndarray | None,
                 num_tokens_per_expert: np.ndarray | None, topk_idx: np.ndarray | None, topk_weights: np.ndarray | None,
                 expert_alignment: int, num_worst_tokens: int) -> tuple:
        """DeepEP's intranode dispatch on numpy inputs; returns (recv_x, recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert_list, IntranodeHandle)."""
        data = x[0] if isinstance(x, tuple) else x
        hidden, num_tokens = data.shape[1], data.shape[0]
        if handle is not None:
            buf = self._buffer(hidden, None, None, num_tokens)
            res = buf.dispatch(x, handle=self._moe_handle(handle, hidden), num_worst_tokens=num_worst_tokens)
            return res.recv_x, None, None, None, None
        num_topk = None if topk_idx is None else topk_idx.shape[1]
        experts = None if num_tokens_per_expert is None else len(num_tokens_per_expert)
        buf = self._buffer(hidden, num_topk, experts, num_tokens)
        res = buf.dispatch(x, num_tokens_per_rank=num_tokens_per_rank, is_token_in_rank=is_token_in_rank,
                           num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
                           expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens)
        return (res.recv_x, res.recv_topk_idx, res.recv_topk_weights, res.num_recv_tokens_per_expert_list,
                IntranodeHandle.of(res.handle))

    def combine(self, x: np.ndarray, handle: IntranodeHandle, topk_weights: np.ndarray | None,
                bias: np.ndarray | tuple | None) -> tuple[np.ndarray, np.ndarray | None]:
        """DeepEP's intranode combine; returns (combined_x, combined_topk_weights)."""
        hidden = x.shape[1]
        buf = self._buffer(hidden, None if topk_weights is None else topk_weights.shape[1], None,
                           handle.is_token_in_rank.shape[0])
        res = buf.combine(x, self._moe_handle(handle, hidden), topk_weights, bias=bias)
        return res.combined_x, res.combined_topk_weights

    @staticmethod
    def _moe_handle(handle: IntranodeHandle, hidden: int) -> DispatchHandle:
        fields = [np.asarray(f) for f in handle]
        return DispatchHandle(*fields, num_recv_tokens=len(fields[3]), hidden=hidden)

    def close(self) -> None:
        """Free the workspace (collective)."""
        if self.moe is not None:
            self.moe.close()
            self.moe, self.key = None, None
