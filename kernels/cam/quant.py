"""DynamicQuant (quant_mode 2): per-token int8 quantisation on dispatch, and the matching dequantisation.

Dispatch's ``QuantProcess`` (seed 3.6: "BF16 -> FP32 -> Abs -> ReduceMax -> Scale -> INT8"; the arithmetic is the
CAM sources', README A14), all in float32::

    xf           = float32(x[t])                    exact widening of bf16 / fp16
    dynamicScale = 127 / (max|xf| + 1e-12)
    q            = int8(rint(xf * dynamicScale))    round half to even, |q| <= 127
    scale        = 1 / dynamicScale                 the float32 stored in the row's scale slot (~ amax / 127)

The stored scale equals the issue's ``amax / 127`` up to float32 rounding and the 1e-12 guard (which makes it
about 7.9e-15, not 0, for an all-zero row). Dequantisation, ``float32(q) * scale``, is off from x by at most
half a quantisation step per element, ``scale / 2 * (1 + 1e-5)`` (the 1e-5 covers float32 rounding; about
``amax / 254``): the int8 path's documented tolerance. Combine takes bf16/fp16 only, so the dequantisation
"before combine" is the expert side's job (README A15): ``dequantize`` gives float32, ``dequantize_for_combine``
the bf16 rows combine expects.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import numpy.typing as npt

__all__ = ["dynamic_quant", "dequantize", "dequantize_for_combine", "to_bf16", "QUANT_EPS"]

QUANT_EPS = np.float32(1e-12)
_127 = np.float32(127.0)


def dynamic_quant(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantise rows: ``x [n, H]`` bf16/fp16 -> ``(q [n, H] int8, scale [n] float32)``."""
    xf = x.astype(np.float32)
    amax = np.abs(xf).max(axis=1) if xf.shape[1] else np.zeros(len(xf), np.float32)
    dynamic_scale = _127 / (amax.astype(np.float32) + QUANT_EPS)
    q = np.rint(xf * dynamic_scale[:, None]).astype(np.int8)
    return q, (np.float32(1.0) / dynamic_scale).astype(np.float32)


def dequantize(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``q [n, H] int8``, ``scale [n] float32`` -> ``[n, H] float32`` = ``float32(q) * scale``."""
    return q.astype(np.float32) * scale.astype(np.float32)[:, None]


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 with round-to-nearest-even (ml_dtypes' cast, which AscendC's CAST_RINT matches)."""
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16)


def dequantize_for_combine(q: np.ndarray, scale: np.ndarray, dtype: npt.DTypeLike = ml_dtypes.bfloat16) -> np.ndarray:
    """``dequantize`` rounded (RNE) to ``dtype`` (bf16 or fp16): the rows an identity expert hands to combine."""
    return dequantize(q, scale).astype(dtype)
