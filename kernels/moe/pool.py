"""A caching pool for the arrays ``Buffer`` returns, so that a dispatch/combine loop does not fault in fresh
memory on every call (PyTorch's caching allocator does this for DeepEP).

A fresh 40 MB numpy array costs page faults on every call (with transparent huge pages in ``madvise`` mode,
numpy's huge-page advice makes them 2 MB zeroing faults): more CPU than the copy that fills it. The pool keeps the
base arrays it handed out and reuses one whose only references are the pool's own (the caller dropped every view
of it, and no WQE registration holds it any more). Free bases beyond ``max_bytes`` in all are forgotten, oldest
first, so that DeepEP-size shapes (outputs of hundreds of MB, several sizes per test) do not pile up.
"""

from __future__ import annotations

import sys

import numpy as np
import numpy.typing as npt

__all__ = ["OutputPool"]


class OutputPool:
    """Base arrays handed out; ``take`` reuses the smallest free one that fits (see the module docstring).

    Args:
        limit: how many bases to keep (the oldest is forgotten beyond it).
        max_bytes: the most bytes of bases to keep; beyond it, free ones are forgotten, oldest first.
    """

    def __init__(self, limit: int = 64, max_bytes: int = 1 << 30):
        self.bases: list[np.ndarray] = []
        self.limit = limit
        self.max_bytes = max_bytes

    def take(self, shape: int | tuple[int, ...], dtype: npt.DTypeLike) -> np.ndarray:
        dtype = np.dtype(dtype)
        shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(s) for s in shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes == 0:
            return np.empty(shape, dtype)
        best = None
        for base in self.bases:  # the smallest free base that fits without wasting more than half of it
            # references: the list, the loop variable and getrefcount's argument; more = a caller holds a view
            if nbytes <= base.nbytes <= 2 * nbytes and sys.getrefcount(base) == 3:
                if best is None or base.nbytes < best.nbytes:
                    best = base
        if best is not None:
            return best[:nbytes].view(dtype).reshape(shape)
        self._trim(nbytes)
        base = np.empty(-(-nbytes // 4096) * 4096, np.uint8)
        self.bases.append(base)
        if len(self.bases) > self.limit:
            self.bases.pop(0)
        return base[:nbytes].view(dtype).reshape(shape)

    def _trim(self, incoming: int) -> None:
        """Forget free bases, oldest first, until the kept bytes and ``incoming`` fit in ``max_bytes``."""
        total = sum(b.nbytes for b in self.bases) + incoming
        i = 0
        while total > self.max_bytes and i < len(self.bases):
            # references: the list and getrefcount's argument; more = a caller holds a view
            if sys.getrefcount(self.bases[i]) == 2:
                total -= self.bases.pop(i).nbytes
            else:
                i += 1
