"""The one place where a thread of a PE waits for another PE.

Every blocking call (wait_until and friends, quiets, barriers, init/finalize, collective allocation) waits
through ``block_until`` (a Python condition) or ``block_on_word`` (one word of shared memory and a comparison:
wait_until / signal_wait_until, wait_until_all, and quiets, on a CQE's owner bit). Both
sleep without the interpreter lock (``futex_wait`` and ``_native.sleep`` are native); ``block_on_word`` also
spins without it (``_native.spin``), so the PE's kernel blocks run meanwhile. They do three things the callers
must not do themselves:

1. **It records the wait** in the thread's wait slot of the control segment (which call, which PE and heap
   offset, which comparison, since when), so that ``shmemx dump`` and the launcher's timeout report can say who
   waits on what while the job hangs. What the slot holds is a ``Wait`` record; the time of a wait that blocked
   goes to the runtime's counters (``rt.stats``), which this module only calls, never imports. (The event log
   of observed runs hears of a wait from the API call that made it, after it returned.)
2. **It never burns a core.** With 8-16 ranks on 2 cores a busy poll costs milliseconds per hop and starves the
   DMA engines (machine_limits.md section 3). A wait spins only while there are no more ranks than cores, and
   only while spinning pays: after a few spins in a row that ended asleep anyway (the partner was not running,
   e.g. other work shares the cores) it stops spinning, and tries again once every few dozen waits. Then it
   sleeps on a futex word: the PE's wake word, which every writer into this PE's memory bumps after its stores
   (``Control.wake``), or a word of its own (the barrier generation).
3. **It has a deadline.** Past it, ``WaitTimeoutError`` carries the caller's description of the wait and the
   value seen last.

No lost wake-ups: the waiter announces itself (``n_sleepers += 1``), then reads the wake word, then checks the
condition, then sleeps on the word's value; a writer stores its data, bumps the wake word with a locked add (a
full fence), then reads the sleeper counts and wakes if one is set (``Control.wake``). If the waiter read the word
before the bump, its futex call sees the word changed and returns at once; if after, the data was already visible
to its check. If it sleeps, the kernel took a lock (a locked instruction, which makes the announcement visible)
before comparing the word, so a writer whose bump came later reads the count after it and wakes it. So the
announcement needs no fence of its own: a PE's own threads count themselves in ``n_sleepers`` with plain stores
made while holding the interpreter lock (a memoryview ``+=``, or ``_native.sleep`` before it lets the lock go and
after it takes it back); other PEs' threads waiting on this PE's memory count themselves in ``n_remote_sleepers``
with atomic adds. (The DMA engine, which runs without the lock, only reads the counts.) The backstop timeout only
bounds how long a dead peer or an abort goes unnoticed.
"""

from __future__ import annotations

import os
import random
import struct
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

from . import atomics
from .control import HEADER_DTYPE, MAX_WAIT_SLOTS, WAIT_CALLS, WAIT_DTYPE, Control, JobState, WaitCall
from ..errors import PeerFailedError, WaitTimeoutError
from . import _native
from .futex import futex_wait

__all__ = ["Wait", "Patience", "PATIENCE", "Sleep", "WaitState", "block_until", "block_on_word", "block_on_words",
           "thread_slot", "set_thread_slot", "ENGINE_SLOT", "WORD_KINDS", "CMP_MASKED"]

ENGINE_SLOT = MAX_WAIT_SLOTS - 1
# Plain-store sleeper counting relies on the interpreter lock; a free-threaded build counts every waiter atomically
_PLAIN_SLEEPERS = getattr(sys, "_is_gil_enabled", lambda: True)()
_BACKSTOP = 0.25  # seconds between checks of the deadline and the job state while asleep
# a word's dtype string -> the native waits' kind (_native.c: signed kinds even, float32 last)
WORD_KINDS = {"<i4": 0, "<u4": 1, "<i8": 2, "<u8": 3, "|i1": 4, "|u1": 5, "<i2": 6, "<u2": 7, "<f4": 8}
CMP_MASKED = 6  # the native waits' "word & mask == target" (ACLSHMEM_CMP_EQ..LE are 0..5)

# A wait slot is written with one pack (0.2 us) instead of nine structured-field stores (~8 us): every field but
# ``call``, which is stored last, so that a reader that sees the call sees the whole record.
_SLOT_FIELDS = ("cmp", "pe", "qp", "offset", "value", "dtype", "count", "target", "since")
_SLOT_REST = struct.Struct("<iiiQQ8sIId")
assert [WAIT_DTYPE.fields[f][1] for f in _SLOT_FIELDS] == [4, 8, 12, 16, 24, 32, 40, 44, 48]
assert WAIT_DTYPE.fields["call"][1] == 0
_SLOT_SIZE = WAIT_DTYPE.itemsize
_STATE_IDX = HEADER_DTYPE.fields["state"][1] // 4
_ABORTING = int(JobState.ABORTING)
GRACE = 50e-6  # a wait's spin before it sleeps with one PE per core (seconds); see grace_period
_SPIN_GIVE_UP = 4  # spins in a row that ended asleep anyway: stop spinning (each one burnt a whole spin)...
_SPIN_PROBE = 8  # ...except one wait in this many, at random, to notice when spinning pays again
_PROBE_P = 1.0 / _SPIN_PROBE
# ...and a probe spins this many times the grace: a probe as long as the grace never ended the state where both
# sides of a ping-pong sleep, since a hop from a sleeping peer (its futex wake-up, then its post) took about as long
# as the grace itself (2 PEs on 2 idle cores: 45-53 us per hop asleep against 7.3 us spinning, 50 us grace).
_PROBE_SPIN = 4.0
_probe = random.Random(os.getpid()).random


def grace_period(pes: int, cores: int, spin_us: str | None = None) -> float:
    """How long a wait polls its word before it parks on the futex, and the engine its doorbells before it sleeps
    (seconds): ``GRACE`` scaled by the cores each of the ``pes`` PEs of this host has, up to twice that when every
    PE has two cores (its kernel thread and its engine each one), and 0 as soon as the PEs outnumber the cores (a
    spinning PE would burn a core another PE needs: 8 PEs on 2 cores never spin). ``SHMEMX_SPIN_US``
    (``spin_us``) overrides it. Measured (docs/performance-history.md, issue 29): on 2 cores, 2 PEs spin 50 us
    and a put_signal ping-pong hop meets its waiter spinning; 8 or 128 PEs sleep at once."""
    if spin_us:
        return float(spin_us) * 1e-6
    if pes <= 0 or pes > cores:
        return 0.0
    return GRACE * min(2.0, cores / pes)


DOZE = 10e-6  # doze_per_word where PEs outnumber cores (seconds per word still to come)


def doze_per_word(pes: int, cores: int, doze_us: str | None = None) -> float:
    """How long a wait for many words (wait_until_all) dozes per word still to come, instead of sleeping on the
    wake word that every write into this PE bumps (seconds): ``DOZE`` where PEs outnumber cores, 0 otherwise.
    There a wake-up costs a context switch on a core that other PEs need, and the signals of P peers would wake
    the waiter up to P times; dozing makes it a few (the doze is at most 1 ms, and the last word is waited for on
    the futex). ``SHMEMX_DOZE_US`` (``doze_us``) overrides it."""
    if doze_us:
        return float(doze_us) * 1e-6
    return DOZE if pes > cores else 0.0


class Wait(NamedTuple):
    """A wait's description: what the thread's wait slot records while it waits (``WAIT_DTYPE`` but ``since``,
    which the wait stamps) and what a timeout or abort says. (A named tuple, not a frozen dataclass: one is made
    for every wait that blocks, and it builds in a third of the time.)

    Attributes:
        call: the blocking call.
        pe: whose memory (a heap word's PE, a quiet's peer); -1 when none.
        offset, cmp, value, dtype, count: the heap word(s) and the comparison (``cmp`` -1 when none; ``value`` the
            raw 64 bits; ``dtype`` numpy's string of the word, e.g. ``b"<i4"``).
        target: a quiet's CQE count, a barrier's number.
        qp: a quiet's QP.
        describe: builds the wait's description for a timeout or abort ("pe 3: signal_wait_until on ...").
    """

    call: WaitCall
    pe: int = -1
    offset: int = 0
    cmp: int = -1
    value: int = 0
    dtype: bytes = b""
    count: int = 1
    target: int = 0
    qp: int = -1
    describe: Callable[[], str] = lambda: "a wait"


@dataclass(frozen=True)
class Patience:
    """How a word wait (``block_on_word`` / ``block_on_words``) waits, apart from what it waits for; made once
    per kind of wait (``PATIENCE``, a queue's quiet), never per wait.

    Attributes:
        spin: seconds to spin before sleeping; None: the runtime's grace (``rt.spin``, 0 when ranks outnumber
            cores).
        adaptive: whether the spin obeys ``WaitState.spin_factor`` (a quiet's does not: how long its engine
            takes depends on the bytes it posted, not on how the last waits went).
        sleep_pe: whose wake word the wait sleeps on; None: the waited PE's (``Wait.pe``).
        timeout: seconds before ``WaitTimeoutError``; None: the runtime's wait timeout.
    """

    spin: float | None = None
    adaptive: bool = True
    sleep_pe: int | None = None
    timeout: float | None = None


PATIENCE = Patience()  # a wait_until's: the runtime's grace, adaptive, on the waited PE's wake word


@dataclass(frozen=True)
class Sleep:
    """The futex word a blocked wait sleeps on: a PE's wake word, which every writer into that PE's memory bumps
    and which counts its sleepers (``Sleep.wake(pe)``), or a word whose writers always wake, like the barrier
    generation (``Sleep.word(addr)``)."""

    pe: int = -1  # -1: a plain word at ``addr``
    addr: int = 0

    @classmethod
    def wake(cls, pe: int) -> "Sleep":
        return cls(pe=pe)

    @classmethod
    def word(cls, addr: int) -> "Sleep":
        return cls(addr=addr)


class WaitState:
    """One process's state of its waits: where its wait slots are and the spin heuristic (``rt.wait_state``)."""

    def __init__(self, ctl: Control, my_pe: int):
        self.slots_offset = ctl.pe_addr(my_pe, "waits") - ctl.segment.addr  # byte offset in the control segment
        self.spin_misses = 0  # spins in a row that ended asleep (a lost update between threads does no harm)

    def spin_factor(self) -> float:
        """How many graces this wait spins: 1 while spins pay; past ``_SPIN_GIVE_UP`` misses in a row 0, but for
        one wait in ``_SPIN_PROBE`` at random, which spins ``_PROBE_SPIN`` graces. (A count of the misses alone
        never moved again once the waits stopped spinning, so a process that gave up never spun again; a probe
        every n-th wait on both sides of a ping-pong keeps its phase and may never meet the other side's; and a
        probe of one grace does not outlast a hop from a peer that sleeps too.)"""
        if self.spin_misses < _SPIN_GIVE_UP:
            return 1.0
        return _PROBE_SPIN if _probe() < _PROBE_P else 0.0


class _ThreadSlot(threading.local):
    slot = 0  # a class default: reading it costs 40 ns, a getattr(..., default) that misses 340 ns


_tls = _ThreadSlot()


def thread_slot() -> int:
    """The wait slot of the calling thread: its AIV block index in a launch, 0 for the main thread."""
    return _tls.slot


def set_thread_slot(slot: int) -> None:
    _tls.slot = slot


def block_until(rt: Any, pred: Callable[[], bool], wait: Wait, *, sleep: Sleep | None = None,
                timeout: float | None = None, spin: float | None = None) -> None:
    """Return once ``pred()`` is true; record ``wait`` in the thread's slot while blocked.

    Args:
        rt: the runtime (its control segment, PE, wait state, spin/timeout settings and recorders).
        pred: the condition; cheap and side-effect free, called many times.
        wait: what the slot records, and the description a timeout or abort gives (``wait.describe()``).
        sleep: the futex word to sleep on; default this PE's wake word.
        timeout: seconds; default the runtime's wait timeout.
        spin: seconds to poll before sleeping; default the runtime's (0 when ranks outnumber cores). Waits for
            this PE's own engine pass 0: a spinning thread holds the GIL the engine needs.

    Raises:
        WaitTimeoutError: the deadline passed; the message is ``wait.describe()`` plus the elapsed time.
        PeerFailedError: the launcher aborted the job while this thread waited.
    """
    if pred():
        return
    started = time.perf_counter_ns()
    if _spin_until(rt, pred, rt.spin if spin is None else spin, True):
        _account(rt, wait, started, thread_slot())
        return
    ctl = rt.ctl
    words = ctl.words
    slot_idx = _tls.slot
    call_idx = _record(rt, slot_idx, wait)
    sleep = Sleep.wake(rt.my_pe) if sleep is None else sleep
    if sleep.pe < 0:
        word_addr, count = sleep.addr, None
    else:
        word_addr, count = ctl.wake_addrs[sleep.pe], _Sleepers(rt, sleep.pe)
    word_idx = (word_addr - ctl.segment.addr) // 4  # every futex word lives in the control segment
    start = time.monotonic()
    deadline = start + (rt.timeout if timeout is None else timeout)
    if count is not None:
        count.add(1)
    try:
        while True:
            seen = words[word_idx]
            if pred():
                return
            _sleep(rt, word_addr, seen, start, deadline, wait.describe)
    finally:
        if count is not None:
            count.add(-1)
        words[call_idx] = 0  # WaitCall.NONE
        _account(rt, wait, started, slot_idx)


def block_on_word(rt: Any, addr: int, kind: int, cmp: int, target: int, wait: Wait, *, mask: int = 0,
                  patience: Patience = PATIENCE) -> int:
    """``block_until`` for one word of shared memory, without the interpreter lock while it spins or sleeps;
    returns the value that met the comparison.

    The same wait slot, spin, sleep, deadline, abort check and accounting as ``block_until``; the spinning and
    the sleeping are native (``_native.spin`` / ``_native.sleep``), so the PE's other threads (kernel blocks)
    run meanwhile, and from a futex wake-up to the return only native code runs before the epilogue. Used by
    wait_until / signal_wait_until and by quiets (a CQE's owner bit).

    Args:
        addr: the word's address in this process; ``kind``: ``WORD_KINDS`` of its dtype.
        cmp, target: ACLSHMEM_CMP_EQ..LE (0..5) and the value compared against, or ``CMP_MASKED`` (6):
            ``word & mask == target``.
        wait: what the slot records and a timeout or abort says.
        patience: how long it spins, whose wake word it sleeps on, its deadline (``Patience``).
    """
    started = time.perf_counter_ns()
    state = rt.wait_state
    spin = rt.spin if patience.spin is None else patience.spin
    adaptive = patience.adaptive
    if spin > 0 and adaptive:
        spin *= state.spin_factor()
    if spin > 0:
        v = _native.spin(addr, kind, cmp, target, mask, int(spin * 1e9))
        if v is not None:
            if adaptive:
                state.spin_misses = 0
            _add_wait_time(rt, _tls.slot, started)
            return v
        if adaptive:
            state.spin_misses += 1
    return _sleep_native(rt, wait, started, patience,
                         lambda wake, count, remote, left, state: _native.sleep(
                             addr, kind, cmp, target, mask, wake, count, remote, left, state, _ABORTING, _BACKSTOP))


def block_on_words(rt: Any, addr: int, stride: int, active: bytes, kind: int, cmp: int, target: int, wait: Wait,
                   pred: Callable[[], bool], *, patience: Patience = PATIENCE) -> None:
    """``block_on_word`` for a set of words that must all meet one comparison (wait_until_all): the words at
    ``addr + i * stride`` whose byte ``active[i]`` is non-zero.

    The same wait slot, deadline, abort check and accounting as ``block_until``; the spin (while ranks do not
    outnumber cores) polls ``pred``, then the sleep is native (``_native.sleep_all``): a wake-up re-checks the
    words without the interpreter lock and goes back to sleep until the last of them is met, so a wait for P
    peers' signals costs one call and one return into Python, not one predicate evaluation per signal. Where PEs
    outnumber cores (``rt.doze``, ``doze_per_word``) it dozes while more than 16 words are still to come, instead
    of being woken by each of the P writes (a wait for 7 peers' signals does not doze: at 8 PEs on 2 cores a
    doze's wake-up waits for a core as long as a futex wake-up does, and dozing measured slower there)."""
    started = time.perf_counter_ns()
    if _spin_until(rt, pred, rt.spin if patience.spin is None else patience.spin, patience.adaptive):
        _add_wait_time(rt, _tls.slot, started)
        return
    doze_ns = int(rt.doze * 1e9)
    # a dozing wait counts itself in the atomic sleeper count, which the doze leaves while it sleeps on the clock:
    # the writers landing meanwhile skip the futex wake-up (a system call each) that nobody waits for
    _sleep_native(rt, wait, started, patience,
                  lambda wake, count, remote, left, state: _native.sleep_all(
                      addr, stride, active, kind, cmp, target, wake, count, remote, left, state, _ABORTING,
                      _BACKSTOP, doze_ns), plain=not doze_ns)


def _sleep_native(rt, wait: Wait, started: int, patience: Patience, sleep, plain: bool = True):
    """The sleeping part of ``block_on_word`` / ``block_on_words``: record the wait in this thread's slot, then
    call ``sleep(wake word, sleeper count, remote, seconds left, state word)`` (one of the native sleeps, which
    returns (0, value) when met, (1, _) at its deadline or backstop, (2, _) on an abort) until it is met, the
    job's timeout (or ``patience.timeout`` seconds) passes or the job aborts; returns the value. ``plain``: a
    wait on this PE's own words counts itself in the plain sleeper count (else, and on another PE's, the atomic
    one)."""
    ctl = rt.ctl
    slot_idx = _tls.slot
    call_idx = _record(rt, slot_idx, wait)
    pe = wait.pe if patience.sleep_pe is None else patience.sleep_pe
    own = plain and pe == rt.my_pe and _PLAIN_SLEEPERS
    count_addr = ctl.sleepers_addrs[pe] if own else ctl.remote_sleepers_addrs[pe]
    start = time.monotonic()
    deadline = start + (rt.timeout if patience.timeout is None else patience.timeout)
    try:
        while True:
            code, v = sleep(ctl.wake_addrs[pe], count_addr, not own, deadline - time.monotonic(), _state_addr(ctl))
            if code == 0:
                return v
            now = time.monotonic()
            if code == 1 and now >= deadline:
                raise WaitTimeoutError(f"{wait.describe()} (waited {now - start:.1f} s)")
            if code == 2:
                failed = int(ctl.header["failed_pe"])
                raise PeerFailedError(f"pe {rt.my_pe}: {wait.describe()}: aborted because pe {failed} failed")
    finally:
        ctl.words[call_idx] = 0  # WaitCall.NONE
        _add_wait_time(rt, slot_idx, started)


def _state_addr(ctl) -> int:
    return ctl.segment.addr + 4 * _STATE_IDX


def _spin_until(rt, pred: Callable[[], bool], spin: float, adaptive: bool) -> bool:
    """Poll ``pred`` for up to ``spin`` seconds (times ``WaitState.spin_factor`` when ``adaptive``); True when
    met."""
    state = rt.wait_state
    if spin > 0 and adaptive:
        spin *= state.spin_factor()
    if spin <= 0:
        return False
    spin_end = time.perf_counter() + spin
    while time.perf_counter() < spin_end:
        if pred():
            if adaptive:
                state.spin_misses = 0
            return True
    if adaptive:
        state.spin_misses += 1
    return False


class _Sleepers:
    """The sleeper count of a PE's wake word that a wait announces itself in: its own threads count in
    ``n_sleepers`` with plain stores, other PEs' in ``n_remote_sleepers`` with atomic adds (see the docstring)."""

    __slots__ = ("words", "idx", "addr")

    def __init__(self, rt, pe: int):
        ctl = rt.ctl
        self.words = ctl.words
        self.idx = ctl._sleepers_idx[pe] if pe == rt.my_pe and _PLAIN_SLEEPERS else None
        self.addr = ctl.remote_sleepers_addrs[pe]

    def add(self, n: int) -> None:
        if self.idx is not None:
            self.words[self.idx] += n
        else:
            atomics.fetch_add_u32(self.addr, n)


def _record(rt, slot: int, wait: Wait) -> int:
    """Write ``wait`` into the thread's slot of the control segment (``call`` last, so that a reader that sees the
    call sees the whole record); returns the index of the slot's ``call`` word in ``ctl.words``."""
    ctl = rt.ctl
    slot_off = rt.wait_state.slots_offset + slot * _SLOT_SIZE
    _SLOT_REST.pack_into(ctl.segment.mm, slot_off + 4, wait.cmp, wait.pe, wait.qp, wait.offset, wait.value,
                         wait.dtype, wait.count, wait.target, time.time())
    ctl.words[slot_off // 4] = wait.call
    return slot_off // 4


def _sleep(rt, word_addr: int, seen: int, start: float, deadline: float, describe: Callable[[], str]) -> None:
    """One sleep of a blocked wait on the futex word at ``word_addr`` (last seen ``seen``): raise past the deadline
    or when the launcher aborts the job, else sleep until the word changes or the backstop passes."""
    now = time.monotonic()
    if now >= deadline:
        raise WaitTimeoutError(f"{describe()} (waited {now - start:.1f} s)")
    ctl = rt.ctl
    if ctl.words[_STATE_IDX] == _ABORTING:
        failed = int(ctl.header["failed_pe"])
        raise PeerFailedError(f"pe {rt.my_pe}: {describe()}: aborted because pe {failed} failed")
    futex_wait(word_addr, seen, min(_BACKSTOP, deadline - now))


def _add_wait_time(rt, slot: int, started: int) -> None:
    stats = rt.stats
    if stats is not None:
        stats.add_wait(slot, time.perf_counter_ns() - started)


def _account(rt, wait: Wait, started: int, slot: int) -> None:
    """A wait_until-family call that blocked: its time in the thread's stats slot (the event log hears of every
    wait from its caller, blocked or not; quiets and barriers account for themselves, around the whole call)."""
    if wait.call in WAIT_CALLS:
        _add_wait_time(rt, slot, started)
