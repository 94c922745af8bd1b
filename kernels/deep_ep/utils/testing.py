"""``deep_ep.utils.testing``: DeepEP's ``bench`` and ``bench_kineto`` on the emulator (needs torch for the
barrier of ``bench_kineto``; ``bench`` does not).

* ``bench`` times calls with the wall clock (DeepEP: CUDA events), dropping the first timed call, as DeepEP.
* ``bench_kineto`` answers with the kernels' own times (``shmemx.deep_ep.kernel_times``): every Buffer call
  records its kernels under DeepEP's names (``notify_dispatch``, ``cached_notify``, ``dispatch``, ``combine``;
  a hooked low-latency call records its send and its receive as two kernels), and a name is looked up as
  DeepEP's table lookup does (the kernels whose name contains it; an exact name wins).

``SHMEMX_DEEPEP_BENCH=N`` caps the warm-up and timed calls of every bench at N (DeepEP's tests tune over
hundreds of configs, which on a 2-core machine takes long at their counts; the configs have no effect here).
"""

from __future__ import annotations

from typing import Any

import json
import os
import sys
import time
from typing import Callable, Optional, Union

import numpy as np

from .. import kernel_times

__all__ = ["bench", "bench_kineto", "flush_l2_cache", "empty_suppress", "suppress_stdout_stderr", "BENCH_ENV"]

BENCH_ENV = "SHMEMX_DEEPEP_BENCH"


def _cap(count: int) -> int:
    cap = os.environ.get(BENCH_ENV)
    return min(count, max(1, int(cap))) if cap else count


def flush_l2_cache(enabled: bool = True) -> None:
    """No L2 cache to flush: nothing to do."""


def bench(fn: Callable, num_warmups: int = 50, num_tests: int = 50, post_fn: Optional[Callable] = None,
          flush_l2: bool = True) -> tuple:
    """``(average, min, max)`` seconds of ``num_tests`` calls of ``fn`` (the first one dropped), after
    ``num_warmups`` calls; ``post_fn`` runs after each timed call, outside the time."""
    for _ in range(_cap(num_warmups)):
        fn()
    times = []
    for _ in range(max(_cap(num_tests), 2)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if post_fn is not None:
            post_fn()
    kept = np.array(times[1:])
    return np.average(kept), np.min(kept), np.max(kept)


class empty_suppress:
    def __enter__(self):
        return self

    def __exit__(self, *_):
        pass


class suppress_stdout_stderr:
    """Silence ``sys.stdout`` / ``sys.stderr`` in the ``with`` body."""

    def __enter__(self):
        self._saved = sys.stdout, sys.stderr
        self._null = open(os.devnull, "w")
        sys.stdout = sys.stderr = self._null
        return self

    def __exit__(self, *_):
        sys.stdout, sys.stderr = self._saved
        self._null.close()


def _match(name: str, names: list[str]) -> list[str]:
    found = [n for n in names if name in n]
    if len(found) > 1 and name in found:
        found = [name]
    if len(found) > 1:
        raise AssertionError(f"bench_kineto: kernel name {name!r} matches several kernels: {found}")
    return found


def bench_kineto(fn: Callable, kernel_names: Union[str, tuple], num_tests: int = 30, suppress_kineto_output: bool = False,
                 trace_path: Optional[str] = None, flush_l2: bool = True, barrier_comm_profiling: bool = False,
                 num_kernels_per_period: int = 1, barrier: Optional[Callable] = None) -> Any:
    """The average time in seconds of each kernel named in ``kernel_names`` over ``num_tests`` calls of ``fn``
    (one value, or a tuple for a tuple of names; with ``num_kernels_per_period = k``, a list of k values per
    name: the j-th kernel of each period). ``barrier_comm_profiling``: a barrier (``barrier`` or an all-reduce
    of the default group) before each call. ``trace_path``: the kernels as Chrome trace events."""
    assert isinstance(kernel_names, (str, tuple))
    is_tuple = isinstance(kernel_names, tuple)
    if int(os.environ.get("EP_USE_NVIDIA_TOOLS", 0)):
        return (1, ) * len(kernel_names) if is_tuple else 1
    fn()
    names = (kernel_names, ) if isinstance(kernel_names, str) else kernel_names
    sync = (barrier or _all_reduce_barrier()) if barrier_comm_profiling else None
    with (suppress_stdout_stderr() if suppress_kineto_output else empty_suppress()):
        with kernel_times.collect() as collector:
            for _ in range(_cap(num_tests)):
                if sync is not None:
                    sync()
                fn()
    durations = []
    for name in names:
        found = _match(name, collector.names())
        times = collector.durations(found[0]) if found else []
        if num_kernels_per_period > 1:
            if len(times) % num_kernels_per_period:
                raise AssertionError(f"bench_kineto: {len(times)} {name!r} kernels are not whole periods of "
                                     f"{num_kernels_per_period}")
            periods = max(len(times) // num_kernels_per_period, 1)
            durations.append([sum(times[j::num_kernels_per_period]) / periods for j in range(num_kernels_per_period)])
        else:
            durations.append(sum(times) / len(times) if times else 0)
    if trace_path is not None:
        _write_trace(trace_path, collector)
    return durations if is_tuple else durations[0]


def _all_reduce_barrier() -> Callable[[], None]:
    """A barrier as DeepEP's profiling makes one: an all-reduce of one element over the default group."""
    import torch
    import torch.distributed as dist

    dummy = torch.ones(1, dtype=torch.float)
    return lambda: dist.all_reduce(dummy)


def _write_trace(path: str, collector) -> None:
    """The kernels, back to back in call order, as Chrome trace-event JSON (microseconds)."""
    events, ts = [], 0.0
    for name, seconds in collector.kernels:
        events.append({"name": f"deep_ep::{name}", "ph": "X", "ts": ts, "dur": seconds * 1e6, "pid": 0, "tid": 0})
        ts += seconds * 1e6
    with open(path, "w") as f:
        json.dump({"traceEvents": events}, f)
