"""numpy in, numpy out; torch CPU tensors in, torch CPU tensors out.

The kernels work on numpy arrays. A call that receives at least one torch tensor answers with torch tensors:
``torch.from_numpy`` of the result (zero copy), so a result that is a view of the symmetric heap stays a view.
bfloat16 and float8_e4m3fn have no numpy dtype of their own: they cross as same-width integers
(``int16`` / ``uint8``) and are re-typed on the other side (``ml_dtypes`` here, ``Tensor.view(dtype)`` there),
again without a copy.

torch is an optional extra (``pip install -e '.[torch]'``). This module never imports it: a torch tensor can only
reach us when the caller imported torch, so ``sys.modules`` tells whether torch is there.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["is_torch", "torch_module", "to_numpy", "Converter", "bf16", "FP8"]

bf16 = ml_dtypes.bfloat16
FP8 = ml_dtypes.float8_e4m3fn
_SPECIAL = {np.dtype(bf16): ("bfloat16", np.int16), np.dtype(FP8): ("float8_e4m3fn", np.uint8)}


TensorLike = Any  # a numpy array or a torch CPU tensor: what DeepEP's helpers take and answer in kind


def torch_module() -> ModuleType | None:
    """The imported torch module, or None (never imports it)."""
    return sys.modules.get("torch")


def is_torch(x: object) -> bool:
    torch = torch_module()
    return torch is not None and isinstance(x, torch.Tensor)


def to_numpy(x: object, what: str = "tensor") -> np.ndarray | None:
    """``x`` (numpy array, torch CPU tensor, or anything ``np.asarray`` takes; None stays None) as a numpy array
    sharing its memory when it is a tensor."""
    if x is None or isinstance(x, np.ndarray):
        return x
    if not is_torch(x):
        return np.asarray(x)
    torch = torch_module()
    if x.device.type != "cpu":
        raise ValueError(f"{what}: shmemx works on CPU tensors, got one on {x.device}")
    x = x.detach()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(bf16)
    if x.dtype == getattr(torch, "float8_e4m3fn", None):
        return x.view(torch.uint8).numpy().view(FP8)
    return x.numpy()


def _to_torch(arr: np.ndarray):
    torch = torch_module()
    special = _SPECIAL.get(arr.dtype)
    if special is not None:
        name, carrier = special
        return torch.from_numpy(arr.view(carrier)).view(getattr(torch, name))
    if not arr.flags.writeable:  # from_numpy warns on read-only arrays; results are the caller's to write
        arr = arr.copy()
    return torch.from_numpy(arr)


class Converter:
    """The output kind of one call: torch when any input was a torch tensor, else numpy.

    Args:
        *inputs: the call's tensor arguments (None, arrays, tensors, or tuples of them).
    """

    def __init__(self, *inputs: object):
        self.torch = any(is_torch(t) for x in inputs for t in (x if isinstance(x, (tuple, list)) else (x,)))

    def out(self, x: object) -> object:
        """Convert a result (an array, None, a tuple / list of them, or anything else: returned as is)."""
        if isinstance(x, tuple):
            return tuple(self.out(v) for v in x)
        if isinstance(x, np.ndarray) and self.torch:
            return _to_torch(x)
        return x
