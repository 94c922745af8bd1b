"""``shmemx.deep_ep``: DeepEP's API on shmemx, for code written against DeepEP: the legacy ``deep_ep.Buffer`` and
V2's ``ElasticBuffer`` / ``EPHandle``. ``shmemx run --deepep`` makes it ``import deep_ep`` (docs/deepep.md).

    from shmemx import deep_ep          # instead of: import deep_ep
    buffer = deep_ep.Buffer(None, num_nvl_bytes=int(1e9))   # group=None: the whole job (shmemx initialised here)
    num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = buffer.get_dispatch_layout(topk_idx, 256)
    recv_x, recv_topk_idx, recv_topk_weights, counts, handle, event = buffer.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_rank=num_tokens_per_rank,
        is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert)
    combined_x, combined_topk_weights, event = buffer.combine(recv_x, handle, topk_weights=recv_topk_weights)

Tensors are numpy arrays or torch CPU tensors (torch is optional: ``pip install -e '.[torch]'``); results come
back in the kind they came in. Modules: ``buffer`` (``Buffer``), ``config`` (``Config``, size hints),
``event`` (``EventOverlap``), ``handles``, ``elastic`` (V2; ``elastic_ep``, ``elastic_comm``), ``kernel_times``,
``intranode`` (on ``shmemx.kernels.moe``), ``internode`` (seed 003's
notify_dispatch and the two-tier kernels), ``low_latency``, ``reference`` (plain numpy), ``utils`` (what DeepEP's
tests use: ``calc_diff``, FP8 casts, ``inplace_unique``, ``bench``, collectives; with torch, DeepEP's ``math``,
``envs``, ``testing``, ``refs``, ``gate``), ``tensors`` (numpy / torch).
Only the public ``shmemx`` API and ``shmemx.kernels.moe`` are used.
"""

import sys as _sys

import numpy as _np

from .buffer import Buffer
from .config import Config
from .elastic import ElasticBuffer, EPHandle
from .event import EventHandle, EventOverlap
from .handles import InternodeHandle, IntranodeHandle, LowLatencyHandle


def __getattr__(name: str):
    """The domain-size helpers (``utils.envs``, torch) and ``topk_idx_t``: DeepEP's index dtype, ``torch.int64`` once torch is imported (tests call
    ``.to(deep_ep.topk_idx_t)``), else ``numpy.int64`` (this package never imports torch)."""
    if name == "topk_idx_t":
        torch = _sys.modules.get("torch")
        return torch.int64 if torch is not None else _np.int64
    if name in ("get_physical_domain_size", "get_logical_domain_size"):
        from .utils import envs  # (torch.distributed: only when asked for)

        return getattr(envs, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__version__ = "2.1.0"  # the DeepEP version whose API this follows (legacy Buffer and V2 ElasticBuffer)

__all__ = ["Buffer", "ElasticBuffer", "EPHandle", "Config", "EventOverlap", "EventHandle", "IntranodeHandle",
           "InternodeHandle",
           "LowLatencyHandle", "topk_idx_t"]
