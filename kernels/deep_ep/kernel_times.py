"""The kernels' own times, under DeepEP's kernel names, for ``deep_ep.utils.testing.bench_kineto``.

DeepEP's ``bench_kineto`` reads per-kernel GPU times from the torch profiler. Here a "kernel" is one of the
Buffer's calls (or one half of it: a notify, a send, a hooked receive), and its time is the wall time this rank
spent in it, taken with two clock reads whether or not anyone listens. A ``Collector`` (``collect()``) keeps the
times of the calls made while it is open; nothing is kept otherwise.

Names, as DeepEP's kernels are named: ``notify_dispatch`` / ``cached_notify`` (the layout exchange of a fresh /
cached normal dispatch or of a combine), ``dispatch``, ``combine`` (normal and low-latency), ``clean``.
"""

from __future__ import annotations

from collections.abc import Iterator

import time
from contextlib import contextmanager

__all__ = ["Collector", "collect", "record", "timed"]

_collectors: list["Collector"] = []


class Collector:
    """The ``(name, seconds)`` of every kernel recorded while it is open, in call order."""

    def __init__(self) -> None:
        self.kernels: list[tuple[str, float]] = []

    def names(self) -> list[str]:
        """The distinct kernel names, in first-seen order."""
        return list(dict.fromkeys(name for name, _ in self.kernels))

    def durations(self, name: str) -> list[float]:
        return [t for n, t in self.kernels if n == name]


@contextmanager
def collect() -> Iterator:
    """Keep the kernel times of the calls made in the ``with`` body (nested collectors each get them all)."""
    c = Collector()
    _collectors.append(c)
    try:
        yield c
    finally:
        _collectors.remove(c)


def record(name: str, seconds: float) -> None:
    for c in _collectors:
        c.kernels.append((name, float(seconds)))


@contextmanager
def timed(name: str) -> Iterator:
    """Record the wall time of the ``with`` body as one kernel ``name``."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        record(name, time.perf_counter() - t0)
