"""DeepEP-style MoE dispatch and combine on the UDMA engine (``shmemx.kernels.moe``).

A token's journey, as in ascend_deepep (seed 001) and DeepEP's normal kernels:

1. ``get_dispatch_layout(topk_idx)``: which ranks and experts each token goes to (local numpy).
2. ``notify_dispatch`` (inside a fresh ``dispatch``): every PE tells every other PE, by UDMA puts and a signal,
   how many rows it will send and from which channels; every PE computes the same ``rank_prefix_matrix``.
3. the dispatch kernel: one AIV block per channel packs and posts its rows (raw WQEs, one doorbell per unit)
   into each destination's workspace at the prefix offsets; per (rank, QP) a fenced completion signal follows
   the payload; receivers wait on the signals and copy the rows out. A handle records the routing, so a cached
   dispatch skips notify and combine can send every row back.
4. ``combine``: the reverse, then a float32 sum per token in rank order, rounded once to bfloat16.

Only the public ``shmemx`` API is used. Modules: ``routing`` (layout, channels), ``schedule`` (QP policies,
rotation, rounds), ``workspace`` (the cursor layout), ``lanes`` (posting, completion), ``notify``, ``dispatch``,
``combine``, ``buffer`` (``Buffer``), ``measure`` (per-call measurements), ``reference`` (plain numpy).
"""

from __future__ import annotations

import numpy as np

from .buffer import Buffer, CombineResult, Config, DispatchHandle, DispatchResult
from .routing import DispatchLayout
from .routing import get_dispatch_layout as _get_dispatch_layout
from .schedule import POLICY_QPS, QP_POLICIES, Schedule
from .measure import PHASES, CallStats
from .workspace import plan_workspace

__all__ = ["Buffer", "Config", "DispatchHandle", "DispatchResult", "CombineResult", "DispatchLayout", "Schedule",
           "QP_POLICIES", "POLICY_QPS", "CallStats", "PHASES", "get_dispatch_layout", "plan_workspace"]


def get_dispatch_layout(topk_idx: np.ndarray, num_experts: int, num_ranks: int | None = None, *,
                        server_size: int | None = None) -> DispatchLayout:
    """DeepEP's ``get_dispatch_layout``: ``(num_tokens_per_rank [P] int32, num_tokens_per_rdma_rank (None
    unless server_size), num_tokens_per_expert [E] int32, is_token_in_rank [T, P] bool)``.

    Args:
        topk_idx: ``[T, K]`` integer global experts, -1 = none.
        num_experts: E.
        num_ranks: P (default: the job's number of PEs).
        server_size: ranks per server, for ``num_tokens_per_rdma_rank``.
    """
    if num_ranks is None:
        import shmemx

        num_ranks = shmemx.n_pes()
    return _get_dispatch_layout(np.asarray(topk_idx), num_experts, num_ranks, server_size=server_size)
