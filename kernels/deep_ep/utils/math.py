"""``deep_ep.utils.math``: the numeric helpers DeepEP's tests import, for numpy arrays or torch CPU tensors
(answered in kind): ``calc_diff``, the per-token FP8 casts, ``inplace_unique``, ``create_grouped_scores``,
``hash_tensor`` / ``hash_tensors``, ``count_bytes``, and the integer helpers ``ceil_div``, ``align``, ``safe_div``.
"""

from __future__ import annotations

from ..tensors import TensorLike

from ..tensors import to_numpy
from . import calc_diff, create_grouped_scores, hash_tensor, inplace_unique, per_token_cast_back, \
    per_token_cast_to_fp8

__all__ = ["calc_diff", "safe_div", "ceil_div", "align", "per_token_cast_to_fp8", "per_token_cast_back",
           "inplace_unique", "create_grouped_scores", "hash_tensor", "hash_tensors", "count_bytes"]


def safe_div(a: float, b: float) -> float:
    """``a / b``, with ``0 / 0 = 0`` (any other division by zero raises)."""
    if b == 0 and a == 0:
        return 0
    return a / b


def ceil_div(x: int, y: int) -> int:
    return (x + y - 1) // y


def align(x: int, y: int) -> int:
    """``x`` rounded up to a multiple of ``y``."""
    return ceil_div(x, y) * y


def hash_tensors(*tensors: TensorLike) -> int:
    """The XOR of ``hash_tensor`` over the tensors given (nested tuples / lists walked; None skipped)."""
    value = 0
    for t in tensors:
        if isinstance(t, (tuple, list)):
            value ^= hash_tensors(*t)
        elif t is not None:
            value ^= hash_tensor(t)
    return value


def count_bytes(*tensors: TensorLike) -> int:
    """The bytes of the tensors given (nested tuples / lists walked; None skipped)."""
    total = 0
    for t in tensors:
        if isinstance(t, (tuple, list)):
            total += count_bytes(*t)
        elif t is not None:
            total += to_numpy(t).nbytes
    return total
