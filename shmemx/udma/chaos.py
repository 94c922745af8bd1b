"""Chaos for kernel threads: seeded jitter at the API calls where a thread's timing decides an ordering bug.

``shmemx run --chaos SEED`` gives every rank the seed (``SHMEMX_CHAOS``); each kernel thread (PE, AIV block)
then draws, from a generator seeded by (SEED, PE, block), whether to sleep briefly (10 us - 2 ms, log-uniform),
yield the interpreter, or do nothing, before and after each wait, quiet, barrier and signal_op; and, with a
probability the thread draws once (its temperament: never for half the threads, now and then, often), whether
to stall (3 - 20 ms), so that some seeds make one side of a protocol run far ahead of the other. At a barrier's
exit, for most barriers, one PE drawn from (SEED, barrier number) lags 0.5 - 3 ms while the others go on at once
(``barrier_exit``): what that PE does right after the barrier then lands inside whatever window another PE opened
right after it (a get .. quiet .. put of a word the laggard stores to). After a signal_op the signalling thread
lags 0.5 - 4 ms now and then (``after_release``), so that the peer's reaction comes before what it does next. The
sleeps of a PE's threads are budgeted: at most ``BUDGET_BASE`` s at once, refilled at ``BUDGET_SHARE`` divided by
the job's PEs of the time that passes (PEs wait on each other, so the job as a whole sleeps about
``BUDGET_SHARE``); past the budget a thread only yields, so that every stretch of a long run pays a bounded share.
The sequence of choices of a thread is a function of the
seed alone (up to the budget); what still differs between two runs with one seed is how the operating system
interleaves the threads.

The engine's side of chaos (which eligible WQE runs next, held queues and peers, split transfers, late source
reads) is the engine's ``chaos`` scheduler policy (``_chaos.c``), installed by ``engine.Engine`` with the seed of
this ``Jitter``: one ``--chaos SEED`` drives both.
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
_SLEEP_LOG10 = (-5.0, -2.7)  # 10 us .. 2 ms
_STALL_LOG10 = (-2.5, -1.7)  # 3 .. 20 ms
_STALLS = (0.0, 0.0, 0.05, 0.15)  # a thread's stall probability per call, drawn once
BUDGET_BASE, BUDGET_SHARE = 0.06, 0.3
_P_LAG = 0.9  # a barrier's exit has a laggard (one PE, drawn from the seed and the barrier's number) ...
_LAG_LOG10 = (-3.3, -2.5)  # ... that sleeps 0.5 .. 3 ms before going on, while the others go on at once
_P_RELEASE_LAG = 0.6  # after a signal_op the signalling thread lags (its peer reacts first) ...
_RELEASE_LOG10 = (-3.3, -2.4)  # ... 0.5 .. 4 ms


class _Rng(threading.local):
    rng = None
    stall = 0.0


class Jitter:
    """The seeded jitter of this PE's kernel threads (``rt.chaos``)."""

    def __init__(self, seed: int, pe: int, n_pes: int = 1):
        self.seed = seed
        self.pe = pe
        self._tls = _Rng()
        self._share = BUDGET_SHARE / max(n_pes, 1)
        self._credit = BUDGET_BASE  # the sleep this PE's threads may still take, as of _credit_at
        self._credit_at = time.perf_counter()

    @classmethod
    def from_env(cls, pe: int, n_pes: int = 1) -> "Jitter | None":
        text = os.environ.get(CHAOS_ENV)
        return None if not text else cls(int(text), pe, n_pes)

    def rng(self) -> random.Random:
        """The calling thread's generator (seeded by the seed, this PE and the thread's AIV block)."""
        tls = self._tls
        if tls.rng is None:
            tls.rng = random.Random(f"shmemx-chaos/{self.seed}/{self.pe}/{thread_slot()}")
            tls.stall = tls.rng.choice(_STALLS)
        return tls.rng

    def barrier_exit(self, number: int, n_pes: int) -> None:
        """Leaving barrier ``number``: one PE (drawn from the seed and the number, the same on every PE) lags,
        the others go on at once, so that what one PE does right after a barrier lands inside a window that
        another PE opened right after it (a get .. put of a word the laggard stores to); or, for some barriers,
        the ordinary jitter."""
        draw = random.Random(f"shmemx-chaos-barrier/{self.seed}/{number}")
        if draw.random() >= _P_LAG or n_pes < 2:
            self.jitter()
            return
        if draw.randrange(n_pes) != self.pe:
            return
        self.rng()
        self._sleep(10 ** draw.uniform(*_LAG_LOG10))

    def after_release(self, releases: int = 1) -> None:
        """After a signal_op: the thread that signalled lags now and then, so that what it does next (reset a
        flag, reuse a buffer) comes after the peer has reacted to the signal; else the ordinary jitter. After
        ``releases`` at once (signal_op_many: one per target PE) the lag is drawn once per release, as a loop of
        signal_ops would draw it, and the longest drawn is taken."""
        r = self.rng()
        lags = [10 ** r.uniform(*_RELEASE_LOG10) for _ in range(releases) if r.random() < _P_RELEASE_LAG]
        if lags:
            self._sleep(max(lags))
        else:
            self.jitter()

    def _sleep(self, pause: float) -> None:
        """Sleep ``pause`` s if the PE's budget has it, else yield. The budget refills at the share of the time
        passed, never above ``BUDGET_BASE``: the PE's threads sleep at most that plus the share of any stretch of
        the run (what a quiet start saved is not spent at once later)."""
        now = time.perf_counter()
        self._credit = min(BUDGET_BASE, self._credit + self._share * (now - self._credit_at))
        self._credit_at = now
        if pause > self._credit:
            time.sleep(0)
            return
        self._credit -= pause
        time.sleep(pause)

    def jitter(self) -> None:
        """Maybe sleep or yield (called before and after waits, quiets, barriers and signal_op)."""
        r = self.rng()
        tls = self._tls
        x = r.random()
        if r.random() < tls.stall:
            pause = 10 ** r.uniform(*_STALL_LOG10)
        elif x < _P_NOTHING:
            return
        elif x < _P_YIELD:
            time.sleep(0)
            return
        else:
            pause = 10 ** r.uniform(*_SLEEP_LOG10)
        self._sleep(pause)
