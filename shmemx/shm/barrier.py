"""Barriers among PEs.

A central counter barrier in the job header: each PE adds one to ``barrier_count`` (a locked add); the last to
arrive resets the count, bumps ``barrier_gen`` and wakes every sleeper on it with one FUTEX_WAKE; the others
sleep on ``barrier_gen``. A PE reads the generation before it arrives, and no PE can enter barrier k+1 before the
generation of barrier k moved, so a generation number is never confused. machine_limits.md 3d measured this
shape (one wake-all by the last arrival) at 0.76-0.90 efficiency with 8-16 ranks on 2 cores, against 0.05 for
busy polling and 0.62 for ``multiprocessing.Barrier``.

``aclshmem_barrier_all`` and ``aclshmem_sync_all`` are the same here: neither completes UDMA work (only the UDMA
quiets do, as in CANN SHMEM), and direct stores (signal_op, MTE copies) are complete when they return. Both
raise a pending data-plane error first (an error CQE nobody has quieted yet).

Inside a kernel launch, use ``aclshmemx_barrier_all_vec`` / ``aclshmemx_sync_vec_all`` from every block: the
blocks of a PE meet first, then one of them joins the PE barrier.
"""

from __future__ import annotations

import time

from . import atomics
from .control import BARRIER_CALLS, WaitCall
from .futex import futex_wake
from .waits import Sleep, Wait, block_until, thread_slot

__all__ = ["barrier"]


def barrier(rt, call: WaitCall = WaitCall.BARRIER_ALL, timeout: float | None = None) -> None:
    """Block until every PE of the job has called ``barrier`` as many times as this PE has.

    Counted in the calling block's barrier time (user barriers only, not init/finalize/malloc/free); its arrival
    (before) and departure (after) go to the event log when one is on (``rt.events``).
    """
    start = time.perf_counter_ns()
    ev = rt.events
    if rt.chaos is not None:
        rt.chaos.jitter()
    if ev is not None:
        ev.barrier(int(rt.ctl.pes[rt.my_pe]["barriers"]) + 1, call, True)
    try:
        _barrier(rt, call, timeout)
        if ev is not None:
            ev.barrier(int(rt.ctl.pes[rt.my_pe]["barriers"]), call, False)
    finally:
        if call in BARRIER_CALLS and rt.stats is not None:
            rt.stats.add_barrier(thread_slot(), time.perf_counter_ns() - start)
        if rt.chaos is not None:
            rt.chaos.barrier_exit(int(rt.ctl.pes[rt.my_pe]["barriers"]), rt.n_pes)


def _barrier(rt, call: WaitCall, timeout: float | None) -> None:
    ctl = rt.ctl
    gen_addr = ctl.header_addr("barrier_gen")
    gen_word = rt.word_view(gen_addr)
    gen = int(gen_word[0])
    me = ctl.pes[rt.my_pe]
    number = int(me["barriers"]) + 1
    me["barriers"] = number
    arrived = atomics.fetch_add_u32(ctl.header_addr("barrier_count"), 1)
    if arrived == rt.n_pes - 1:
        rt.word_view(ctl.header_addr("barrier_count"))[0] = 0
        atomics.fetch_add_u32(gen_addr, 1)  # locked: the reset above is visible before the new generation
        futex_wake(gen_addr)
        return

    def describe() -> str:
        missing = [p for p in range(rt.n_pes) if int(ctl.pes[p]["barriers"]) < number]
        name = call.name.lower()
        return (f"pe {rt.my_pe}: {name} (barrier #{number}): {_pe_list(missing)} "
                f"{'has' if len(missing) == 1 else 'have'} not arrived")

    block_until(rt, lambda: gen_word[0] != gen, Wait(call, target=number), describe, sleep=Sleep.word(gen_addr),
                timeout=timeout)


def _pe_list(pes: list[int]) -> str:
    if not pes:
        return "no PE"
    if len(pes) > 12:
        return f"{len(pes)} PEs ({', '.join(map(str, pes[:10]))}, ...)"
    return ("pe " if len(pes) == 1 else "pes ") + ", ".join(map(str, pes))
