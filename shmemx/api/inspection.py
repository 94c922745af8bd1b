"""The inspection API of a rank: ``region`` (a named span of a kernel), ``count`` (a user counter), ``stats``
(every PE's counters as arrays), ``compute`` (modelled time of work the kernel does not post) and
``native_access`` (heap memory a kernel's own native code read or wrote, for ``--check``).

Regions go to the event log (``rt.events``) when one is on, counters to the PE's stats (``rt.stats``, see
``observe``); ``shmemx run --trace``, ``--stats`` and ``--record`` show them for the whole job.
"""

from __future__ import annotations

import math
import time

import numpy as np

from ..observe.counters import JobStats
from ..runtime import runtime
from ..shm.waits import thread_slot
from ..udma.check.array import note_access

__all__ = ["region", "count", "stats", "compute", "native_access"]

_now = time.perf_counter_ns


class _Region:
    __slots__ = ("rt", "name", "start", "slot")

    def __init__(self, rt, name: str):
        self.rt = rt
        self.name = name

    def __enter__(self):
        self.slot = thread_slot()
        if self.rt.events is not None:
            self.rt.events.region(self.name, True)
        self.start = _now()
        return self

    def __exit__(self, *exc) -> None:
        if self.rt.events is not None:
            self.rt.events.region(self.name, False)
        if self.rt.stats is not None:  # (None once finalize ran inside the region)
            self.rt.stats.add_region(self.slot, _now() - self.start)


def region(name: str) -> _Region:
    """``with shmemx.region("notify"):`` marks a span of a kernel: a slice on its block's track in the trace, and
    time and count in the block's ``region_ns`` / ``regions`` counters.

    Cheap when tracing is off (two clock reads and two stores).
    """
    rt = runtime()
    if not isinstance(name, str):
        raise TypeError(f"pe {rt.my_pe}: shmemx.region(name): name must be a string, got {name!r}")
    return _Region(rt, name)


def count(name: str, n: int = 1) -> None:
    """Add ``n`` to the user counter ``name`` of the calling PE and block (shown by ``--stats``, ``stats()``).

    Cheap (a few hundred ns: a store into this thread's own slot); at most 64 names per PE, 32 bytes each.
    """
    rt = runtime()
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"pe {rt.my_pe}: shmemx.count({name!r}, n): n must be an integer, got {n!r}")
    rt.stats.add_user(thread_slot(), name, int(n))


def stats() -> JobStats:
    """Every PE's counters now, as arrays (see ``JobStats``); call after a barrier for exact totals.

    Publishes the calling thread's posted counts first. Other PEs' posted counts are as of their last quiet.
    """
    rt = runtime()
    if rt.udma is not None:
        rt.udma.publish_counts(mine_only=True)
    return JobStats.read(rt.job_id, rt.n_pes, segments={rt.my_pe: rt.stats})


def compute(us: float, *, name: str = "compute") -> None:
    """Model ``us`` microseconds of work at this point of the calling block (an expert FFN, a quantisation: work
    the kernel does not post), for ``shmemx replay``: the replay advances the block's virtual clock by ``us``.

    Does nothing in the run itself (do the work, if any, as usual); with ``--record`` it records the annotation.
    """
    rt = runtime()
    if isinstance(us, bool) or not isinstance(us, (int, float, np.integer, np.floating)) or not math.isfinite(us) \
            or us < 0:
        raise ValueError(f"pe {rt.my_pe}: shmemx.compute(us={us!r}): us must be a finite number >= 0")
    if not isinstance(name, str):
        raise TypeError(f"pe {rt.my_pe}: shmemx.compute(name=...): name must be a string, got {name!r}")
    if rt.events is not None:
        rt.events.compute(float(us), name)


def native_access(view: np.ndarray, key: object = None, *, write: bool = False) -> None:
    """Native code of the kernel (a C reduction, a copy that numpy does not see) read ``view[key]`` (the whole
    view when ``key`` is None; ``write``: wrote it), where ``view`` is heap memory: under ``--check`` this is the
    kernel line's access, as the numpy operation the native code replaces would be; otherwise nothing (one
    check). ``key`` may be a function that makes the key, called only under ``--check``. Call it after a read
    and before a write. Pass the native code ``view.view(np.ndarray)``."""
    note_access(view, key, write)
