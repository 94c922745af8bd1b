"""What DeepEP's tests use, for tensors of either kind (numpy arrays or torch CPU tensors, answered in kind):
the metric ``calc_diff``, per-token FP8 casts and back, ``inplace_unique``, grouped scores, ``hash_tensor``, a
``bench`` helper, and the two collectives the tests need (``all_gather``, ``all_reduce``) over the symmetric heap,
so that a test needs no torch.distributed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time
from collections.abc import Callable

import numpy as np

import shmemx
from shmemx.kernels.moe import reference as _ref

from ..tensors import Converter, TensorLike, to_numpy

__all__ = ["calc_diff", "per_token_cast_to_fp8", "per_token_cast_back", "inplace_unique", "create_grouped_scores",
           "hash_tensor", "bench", "all_gather", "all_reduce", "init_dist", "return_freed_memory"]


_ROWS = 1024  # rows per step of the helpers below: DeepEP-size tensors without gigabyte temporaries


def calc_diff(x: TensorLike, y: TensorLike) -> float:
    """DeepEP's metric: ``1 - 2 sum(xy) / sum(x^2 + y^2)`` with both shifted by +1, in float64 (0 = equal)."""
    a, b = to_numpy(x), to_numpy(y)
    a, b = np.broadcast_arrays(a, b) if a.shape != b.shape else (a, b)
    a2, b2 = a.reshape(len(a), -1) if a.ndim else a.reshape(1, 1), b.reshape(len(b), -1) if b.ndim else b.reshape(1, 1)
    dot = norm = 0.0
    for r in range(0, len(a2), _ROWS):
        u = a2[r:r + _ROWS].astype(np.float64) + 1
        v = b2[r:r + _ROWS].astype(np.float64) + 1
        dot += float((u * v).sum())
        norm += float((u * u + v * v).sum())
    return 1 - 2 * dot / norm if norm else 0.0


def per_token_cast_to_fp8(x: TensorLike) -> tuple:
    """``[T, H]`` -> ``(float8_e4m3fn [T, H], float32 scales [T, ceil(H/128)])``, per 128-column block amax
    (at least 1e-4) scaled to 448."""
    return Converter(x).out(_ref.per_token_cast_to_fp8(to_numpy(x)))


def per_token_cast_back(x_fp8: TensorLike, x_scales: TensorLike) -> TensorLike:
    """``data * scales`` per 128-column block as ``[T, H] bfloat16``; int32 scales are 4 packed UE8M0 bytes
    (exponents: byte << 23 as float32 bits). The scales are read by element count, as DeepEP reads them: any
    shape holding ``T * ceil(H/128)`` of them (e.g. ``[E, N, H/512] int32`` viewed as ``[-1, H/128]``) will do."""
    data, scales = to_numpy(x_fp8), np.ascontiguousarray(to_numpy(x_scales))
    if scales.dtype == np.int32:
        scales = (scales.view(np.uint8).astype(np.uint32) << 23).view(np.float32)
    shape = data.shape
    flat = data.reshape(-1, shape[-1])
    blocks = -(-shape[-1] // 128)
    if scales.size != len(flat) * blocks:
        raise ValueError(f"per_token_cast_back: {len(flat)} rows of {shape[-1]} columns need {len(flat) * blocks} "
                         f"scales, got {scales.size} (shape {scales.shape})")
    flat_scales = scales.reshape(len(flat), blocks)
    out = np.empty(flat.shape, _ref.bf16)
    for r in range(0, len(flat), _ROWS):
        out[r:r + _ROWS] = _ref.per_token_cast_back(flat[r:r + _ROWS], flat_scales[r:r + _ROWS])
    return Converter(x_fp8).out(out.reshape(shape))


def inplace_unique(x: TensorLike, num_slots: int) -> None:
    """Per row of ``x [n, k]`` (integers, -1 = none): its distinct values in ``0..num_slots-1``, largest first,
    then -1s; in place."""
    a = to_numpy(x)
    if a.ndim != 2:
        raise ValueError(f"inplace_unique: x must be 2-D, got shape {a.shape}")
    present = np.zeros((a.shape[0], num_slots + 1), bool)
    rows = np.broadcast_to(np.arange(a.shape[0])[:, None], a.shape)
    present[rows, np.where(a < 0, num_slots, a)] = True
    present = present[:, :num_slots]
    ranked = np.where(present, np.arange(num_slots), -1)
    ranked = -np.sort(-ranked, axis=1)  # descending, the -1s last
    width = min(num_slots, a.shape[1])
    a[...] = -1
    a[:, :width] = ranked[:, :width]


def create_grouped_scores(scores: TensorLike, group_idx: TensorLike, num_groups: int) -> TensorLike:
    """``scores [T, E]`` with every expert outside the chosen ``group_idx [T, g]`` groups (E / num_groups
    experts each) set to 0."""
    s, g = to_numpy(scores), to_numpy(group_idx)
    mask = np.zeros((s.shape[0], num_groups), bool)
    mask[np.arange(s.shape[0])[:, None], g] = True
    out = (s.reshape(s.shape[0], num_groups, -1) * mask[:, :, None]).reshape(s.shape)
    return Converter(scores).out(out.astype(s.dtype))


def hash_tensor(t: TensorLike) -> int:
    """DeepEP's ``hash_tensor``: the sum of the data viewed as int32 (bitwise reproducibility checks)."""
    a = np.ascontiguousarray(to_numpy(t))
    return int(a.view(np.uint8).reshape(-1)[:a.nbytes // 4 * 4].view(np.int32).sum(dtype=np.int64))


def bench(fn: Callable[[], object], num_warmups: int = 3, num_tests: int = 10) -> tuple[float, float, float]:
    """Time ``fn()`` (collective when ``fn`` is): warm-ups, then ``num_tests`` timed calls each after a barrier;
    returns (mean, min, max) seconds of the timed calls but the first, as DeepEP's ``bench``."""
    for _ in range(num_warmups):
        fn()
    times = []
    for _ in range(num_tests):
        shmemx.aclshmem_barrier_all()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    kept = np.array(times[1:] if len(times) > 1 else times)
    return float(kept.mean()), float(kept.min()), float(kept.max())


def all_gather(x: TensorLike) -> list:
    """``[P, *x.shape]``: every PE's ``x`` (collective; same shape and dtype on every PE)."""
    a = np.ascontiguousarray(to_numpy(x))
    n, me = shmemx.n_pes(), shmemx.my_pe()
    raw = a.view(np.uint8).reshape(-1)
    block = shmemx.aclshmem_malloc(max(raw.size, 1) * n, name="deep_ep.all_gather")
    slots = block.reshape(n, -1)
    for pe in range(n):  # this PE's row of every PE's table (by the engine that reaches the PE: MTE within the
        shmemx.aclshmem_putmem(slots[me, :raw.size], raw, raw.size, pe)  # server, UDMA across), complete on return
    shmemx.aclshmem_barrier_all()
    out = slots[:, :raw.size].copy().view(a.dtype).reshape(n, *a.shape)
    shmemx.aclshmem_free(block)
    return Converter(x).out(out)


def all_reduce(x: TensorLike) -> TensorLike:
    """The sum over PEs of ``x`` (collective), in ``x``'s dtype."""
    gathered = to_numpy(all_gather(to_numpy(x)))
    return Converter(x).out(gathered.sum(0, dtype=gathered.dtype))


def init_dist(local_rank: int | None = None, num_local_ranks: int | None = None, seed: int = 0) -> tuple:
    """DeepEP's tests' ``init_dist``.

    Without arguments: ``(rank, num_ranks, None)`` before any Buffer exists (so that a test can size its Buffer
    by the rank count): shmemx's when initialised, else those the launcher started this process with
    (``shmemx run``); the group is None (a Buffer of the whole job).

    With DeepEP's ``(local_rank, num_local_ranks)``: DeepEP's ``deep_ep.utils.envs.init_dist`` (torch.distributed
    on gloo over the job's ranks; needs torch), returning ``(rank, num_ranks, group)``.
    """
    if local_rank is not None or num_local_ranks is not None:
        from . import envs  # torch.distributed: only for callers that asked for DeepEP's form

        return envs.init_dist(local_rank or 0, num_local_ranks or 1, seed)
    if shmemx.is_initialized():
        return shmemx.my_pe(), shmemx.n_pes(), None
    return int(os.environ.get("SHMEMX_RANK", "0")), int(os.environ.get("SHMEMX_SIZE", "1")), None


def return_freed_memory(threshold: int = 4 << 20) -> bool:
    """Ask glibc to serve allocations of ``threshold`` bytes and more by mmap, so that freed arrays and tensors go
    back to the system at once. DeepEP-size tests on 8 ranks of a small machine need it: glibc's adaptive
    threshold otherwise keeps freed temporaries of tens of MB in each rank's heap (hundreds of MB per rank over a
    test). Returns False where there is no glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return bool(libc is not None and libc.mallopt(-3, int(threshold)))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False
