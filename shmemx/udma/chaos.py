"""Chaos for kernel threads: seeded jitter at the API calls where a thread's timing decides an ordering bug.

``shmemx run --chaos SEED`` gives every rank the seed (``SHMEMX_CHAOS``); each kernel thread (PE, AIV block)
then draws, from a generator seeded by (SEED, PE, block), whether to sleep briefly (10 us - 2 ms, log-uniform),
yield the interpreter, or do nothing, before and after each wait, quiet and signal_op. The sequence of choices
of a thread is a function of the seed alone; what still differs between two runs with one seed is how the
operating system interleaves the threads and how fast the engine runs.

The engine's side of chaos (which eligible WQE runs next, delayed queues, split transfers, late source reads) is
a scheduler policy of the engine (issue 11's hook), not here; it takes its seed from the same ``Jitter``.
"""

from __future__ import annotations

import os
import random
import threading
import time

from ..shm.waits import thread_slot

__all__ = ["Jitter", "CHAOS_ENV"]

CHAOS_ENV = "SHMEMX_CHAOS"
_P_NOTHING, _P_YIELD = 0.5, 0.75  # draws below these: nothing, a yield; above: a short sleep


class _Rng(threading.local):
    rng = None


class Jitter:
    """The seeded jitter of this PE's kernel threads (``rt.chaos``)."""

    def __init__(self, seed: int, pe: int):
        self.seed = seed
        self.pe = pe
        self._tls = _Rng()

    @classmethod
    def from_env(cls, pe: int) -> "Jitter | None":
        text = os.environ.get(CHAOS_ENV)
        return None if not text else cls(int(text), pe)

    def rng(self) -> random.Random:
        """The calling thread's generator (seeded by the seed, this PE and the thread's AIV block)."""
        tls = self._tls
        if tls.rng is None:
            tls.rng = random.Random(f"shmemx-chaos/{self.seed}/{self.pe}/{thread_slot()}")
        return tls.rng

    def jitter(self) -> None:
        """Maybe sleep or yield (called before and after waits, quiets and signal_op)."""
        r = self.rng()
        x = r.random()
        if x < _P_NOTHING:
            return
        if x < _P_YIELD:
            time.sleep(0)
            return
        time.sleep(10 ** r.uniform(-5.0, -2.7))
