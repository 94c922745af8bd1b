"""Barriers among PEs: of the whole job, and of a team (a strided subset of the PEs).

A central counter barrier: each PE adds one to the barrier's counter (a locked add); the last to arrive resets
the count, bumps the generation word and wakes every sleeper on it with one FUTEX_WAKE; the others sleep on the
generation. A PE reads the generation before it arrives, and no PE can enter barrier k+1 before the generation of
barrier k moved, so a generation number is never confused. machine_limits.md 3d measured this shape (one
wake-all by the last arrival) at 0.76-0.90 efficiency with 8-16 ranks on 2 cores, against 0.05 for busy polling
and 0.62 for ``multiprocessing.Barrier``.

The job's barrier keeps its counter and generation in the job header; a team's (``team_barrier``) in its slot of
the control segment's team table (``shm.teams``), with the same algorithm and the same futex sleep, over the
team's members only: a team barrier completes when every member arrived, whatever the other PEs do. Each PE
numbers its barriers, per team slot for teams (``team_barriers``), so that a timeout names who has not arrived.

``aclshmem_barrier_all`` and ``aclshmem_sync_all`` are the same here: neither completes UDMA work (only the UDMA
quiets do, as in CANN SHMEM), and direct stores (signal_op, MTE copies) are complete when they return. Both
raise a pending data-plane error first (an error CQE nobody has quieted yet).

Inside a kernel launch, use ``aclshmemx_barrier_all_vec`` / ``aclshmemx_sync_vec_all`` from every block: the
blocks of a PE meet first, then one of them joins the PE barrier.
"""

from __future__ import annotations

import time
from typing import Any

from . import atomics
from .control import BARRIER_CALLS, WaitCall
from .futex import futex_wake
from .waits import Sleep, Wait, block_until, thread_slot

__all__ = ["barrier", "team_barrier", "TeamShape", "barrier_key"]


class TeamShape:
    """The members of a team: global PEs ``start + i * stride`` for ``i < size``; ``slot`` its entry in the team
    table, ``uid`` its job-wide id (never reused, unlike the slot)."""

    __slots__ = ("slot", "uid", "start", "stride", "size")

    def __init__(self, slot: int, uid: int, start: int, stride: int, size: int):
        self.slot, self.uid, self.start, self.stride, self.size = slot, uid, start, stride, size

    def members(self) -> list[int]:
        return [self.start + i * self.stride for i in range(self.size)]

    def index_of(self, pe: int) -> int:
        """The team index of global PE ``pe``, or -1 when it is not a member."""
        d = pe - self.start
        if d < 0 or d % self.stride or d // self.stride >= self.size:
            return -1
        return d // self.stride

    def __repr__(self) -> str:
        return f"team slot {self.slot} (pes {self.start}+{self.stride}*i, i < {self.size})"


def barrier_key(uid: int, number: int) -> int:
    """The job-wide name of a team barrier (team id and the members' barrier number), as recorders see it; a
    job barrier's number is below 2**32."""
    return uid << 32 | number


def barrier(rt: Any, call: WaitCall = WaitCall.BARRIER_ALL, timeout: float | None = None) -> None:
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
    me = ctl.pes[rt.my_pe]
    number = int(me["barriers"]) + 1
    me["barriers"] = number

    def describe() -> str:
        missing = [p for p in range(rt.n_pes) if int(ctl.pes[p]["barriers"]) < number]
        name = call.name.lower()
        return (f"pe {rt.my_pe}: {name} (barrier #{number}): {_pe_list(missing)} "
                f"{'has' if len(missing) == 1 else 'have'} not arrived")

    _meet(rt, ctl.header_addr("barrier_count"), ctl.header_addr("barrier_gen"), rt.n_pes,
          Wait(call, target=number, describe=describe), timeout)


def team_barrier(rt: Any, team: TeamShape, call: WaitCall = WaitCall.TEAM_BARRIER, what: str = "aclshmem_barrier",
                 timeout: float | None = None) -> None:
    """Block until every member of ``team`` (this PE among them) has called ``team_barrier`` on it as many times
    as this PE has; PEs outside the team take no part and are not waited for.

    The same algorithm and sleep as ``barrier``, on the counter and generation of the team's slot. Observed as
    a barrier named ``barrier_key(team.uid, number)`` with the team's shape in the event log,
    and counted in the calling block's barrier time.
    """
    start = time.perf_counter_ns()
    ctl = rt.ctl
    arrivals = ctl.pes[rt.my_pe]["team_barriers"]
    number = int(arrivals[team.slot]) + 1
    key = barrier_key(team.uid, number)
    ev, shape = rt.events, (team.start, team.stride, team.size)
    if rt.chaos is not None:
        rt.chaos.jitter()
    if ev is not None:
        ev.barrier(key, call, True, shape)
    try:
        arrivals[team.slot] = number

        def describe() -> str:
            missing = [p for p in team.members() if int(ctl.pes[p]["team_barriers"][team.slot]) < number]
            return (f"pe {rt.my_pe}: {what} on {team} (its barrier #{number}): {_pe_list(missing)} "
                    f"{'has' if len(missing) == 1 else 'have'} not arrived")

        _meet(rt, ctl.team_addr(team.slot, "count"), ctl.team_addr(team.slot, "gen"), team.size,
              Wait(call, pe=-1, offset=team.slot, target=number, describe=describe), timeout)
        if ev is not None:
            ev.barrier(key, call, False, shape)
    finally:
        if call == WaitCall.TEAM_BARRIER and rt.stats is not None:
            rt.stats.add_barrier(thread_slot(), time.perf_counter_ns() - start)
        if rt.chaos is not None:
            rt.chaos.barrier_exit(key, team.size)


def _meet(rt, count_addr: int, gen_addr: int, size: int, wait: Wait, timeout: float | None) -> None:
    """The counter barrier of ``size`` arrivals on the counter at ``count_addr`` and the generation (futex) word
    at ``gen_addr``, both words of the control segment."""
    gen_word = rt.word_view(gen_addr)
    gen = int(gen_word[0])  # before arriving: the generation cannot move before this PE's own arrival
    arrived = atomics.fetch_add_u32(count_addr, 1)
    if arrived == size - 1:
        rt.word_view(count_addr)[0] = 0
        atomics.fetch_add_u32(gen_addr, 1)  # locked: the reset above is visible before the new generation
        futex_wake(gen_addr)
        return
    block_until(rt, lambda: gen_word[0] != gen, wait, sleep=Sleep.word(gen_addr), timeout=timeout)


def _pe_list(pes: list[int]) -> str:
    if not pes:
        return "no PE"
    if len(pes) > 12:
        return f"{len(pes)} PEs ({', '.join(map(str, pes[:10]))}, ...)"
    return ("pe " if len(pes) == 1 else "pes ") + ", ".join(map(str, pes))
