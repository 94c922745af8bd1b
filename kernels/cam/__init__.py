"""CAM window-mode MoE kernels: ``moe_dispatch_normal`` / ``moe_combine_normal`` over emulated HCCL windows.

The production-default ("HCCL window", non-SHMEM) path of the CAM library, as seed 000 describes it: each rank
stages its (token, topk) rows in its own communication window, raises 1.0f flags in the experts' ranks' windows,
and the two ops ping-pong between the two halves of the window from one call to the next. See the README section
"CAM window-mode MoE kernels" for the memory map and the readings chosen where the seed is ambiguous.

Typical use (every rank, collective)::

    ctx = cam.WindowContext(hccl_buffsize=cam.needed_mb(max_bs, K, H), aiv_num=4)
    route = cam.notify_dispatch(ctx, topk_idx, E)
    d = cam.moe_dispatch_normal(ctx, x, topk_idx, *route, moe_expert_num=E, global_bs=max_bs * R)
    y = expert(d.recv_x)                                  # rows in (local expert, source rank) order
    c = cam.moe_combine_normal(ctx, y, d.assist_info_for_combine, d.ep_recv_counts, weights,
                               moe_expert_num=E, global_bs=max_bs * R)
"""

from . import constants, reference
from .combine import CombineOutput, moe_combine_normal
from .dispatch import DispatchOutput, moe_dispatch_normal
from .notify import NotifyDispatchOutput, notify_dispatch
from .quant import dequantize, dequantize_for_combine, dynamic_quant, to_bf16
from .tiling import (DispatchLayout, MoeCombineNormalInfo, MoeDispatchNormalInfo, TilingError,
                     check_combine_tiling, check_dispatch_tiling, needed_mb, split, window_needed_bytes)
from .window import HcclOpResParam, HcclRankRelationResV2, WindowContext

__all__ = [
    "constants", "reference", "WindowContext", "HcclOpResParam", "HcclRankRelationResV2",
    "notify_dispatch", "NotifyDispatchOutput", "moe_dispatch_normal", "DispatchOutput",
    "moe_combine_normal", "CombineOutput", "dynamic_quant", "dequantize", "dequantize_for_combine", "to_bf16",
    "TilingError", "DispatchLayout", "MoeDispatchNormalInfo", "MoeCombineNormalInfo", "check_dispatch_tiling",
    "check_combine_tiling", "window_needed_bytes", "needed_mb", "split",
]
