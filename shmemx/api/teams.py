"""Teams: strided subsets of the PEs, their collective creation, barriers that complete only their members.

A team handle is an int, as CANN's ``aclshmem_team_t``: ``ACLSHMEM_TEAM_WORLD`` (0) is every PE,
``ACLSHMEM_TEAM_INVALID`` (-1) is what a PE outside a new team gets back. Here a handle is the team's slot in the
job's team table (``shm.teams``), so it is the same number on every member (in CANN it is a per-PE index). A
handle is valid on the PEs that are members; elsewhere the queries return -1 (as CANN's do for an invalid handle)
and the barriers raise.

Creation is collective over the parent team: every member of the parent calls ``aclshmem_team_split_strided``
(or ``_split_2d``) in the same order with the same arguments. The parent's leader (its team PE 0) claims a slot
and posts the call in the parent's mailbox; the parent meets; every member checks the leader's call against its
own; the parent meets again; a disagreement raises on every member, naming the first member that disagreed. New
members start the team's barrier numbering at 0. ``aclshmem_team_destroy`` is collective over the team itself.
A new team's PEs are a subset of the parent's (OpenSHMEM's rule; CANN only checks the global range).

Barriers: ``aclshmem_barrier(team)`` / ``aclshmem_sync(team)`` (host style: the calling thread meets the team)
and ``aclshmemx_barrier_vec(team)`` / ``aclshmemx_sync_vec(team)`` (from every block of a launch: the blocks meet,
block 0 meets the team, the blocks meet again). On WORLD they are the job's barrier. As the job's barrier, they
complete direct stores (MTE, signal_op) but no UDMA or SDMA work: quiet first.

A small Python surface for libraries that run on a sub-group (``team_info``): the members, this PE's index,
translation between teams.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import ShmemError, WaitTimeoutError
from ..runtime import runtime
from ..shm import teams as table
from ..shm.barrier import TeamShape, barrier, team_barrier
from ..shm.control import MAX_TEAMS, WaitCall
from .blocks import get_block_idx, sync_all
from .log import LogLevel, log

__all__ = [
    "ACLSHMEM_TEAM_INVALID", "ACLSHMEM_TEAM_WORLD", "ACLSHMEM_MAX_TEAMS", "aclshmem_team_config_t", "TeamInfo",
    "aclshmem_team_split_strided", "aclshmem_team_split_2d", "aclshmem_team_destroy", "aclshmem_team_my_pe",
    "aclshmem_team_n_pes", "aclshmem_team_translate_pe", "aclshmem_team_pe_mapping", "aclshmem_team_get_config",
    "aclshmem_barrier", "aclshmem_sync", "aclshmemx_barrier_vec", "aclshmemx_sync_vec", "team_info",
]

ACLSHMEM_TEAM_INVALID, ACLSHMEM_TEAM_WORLD = -1, 0
ACLSHMEM_MAX_TEAMS = MAX_TEAMS  # (CANN: 2048)
_SPLIT = int(WaitCall.TEAM_SPLIT)
_OP_SPLIT, _OP_DESTROY = _SPLIT | 1 << 8, _SPLIT | 2 << 8


@dataclass
class aclshmem_team_config_t:
    """CANN's team configuration: ``version``, ``num_contexts`` (reserved), ``uniqueid`` (the team's job-wide
    id here)."""

    version: int = (1 << 16) + 64
    num_contexts: int = 0
    uniqueid: int = 0


@dataclass(frozen=True)
class TeamInfo:
    """A team as this PE sees it (``team_info``).

    Attributes:
        team: the handle. start, stride, size: members are global PEs ``start + i * stride``, ``i < size``.
        my_pe: this PE's index in the team. uid: the team's job-wide id (never reused; handles are).
    """

    team: int
    start: int
    stride: int
    size: int
    my_pe: int
    uid: int

    @property
    def members(self) -> tuple[int, ...]:
        """Global PE of every team PE, in team order."""
        return tuple(self.start + i * self.stride for i in range(self.size))

    def global_pe(self, team_pe: int) -> int:
        """The global PE of team PE ``team_pe`` (ValueError when out of range)."""
        if not 0 <= team_pe < self.size:
            raise ValueError(f"team {self.team}: team pe {team_pe} out of range 0..{self.size - 1}")
        return self.start + team_pe * self.stride

    def index_of(self, pe: int) -> int:
        """The team index of global PE ``pe``, -1 when it is not a member."""
        return _shape(self).index_of(pe)


@dataclass
class _Team:
    shape: TeamShape
    my_index: int
    coll_seq: int = 0
    config: aclshmem_team_config_t = field(default_factory=aclshmem_team_config_t)


_state: dict = {"rt": None, "teams": {}}


def _teams(rt) -> dict[int, _Team]:
    """This process's teams (a new init starts a new set), WORLD always among them."""
    if _state["rt"] is not rt:
        world = TeamShape(ACLSHMEM_TEAM_WORLD, table.WORLD_UID, 0, 1, rt.n_pes)
        _state["rt"], _state["teams"] = rt, {ACLSHMEM_TEAM_WORLD: _Team(world, rt.my_pe,
                                                                       config=aclshmem_team_config_t(uniqueid=1))}
    return _state["teams"]


def _shape(info: TeamInfo) -> TeamShape:
    return TeamShape(info.team, info.uid, info.start, info.stride, info.size)


def _lookup(rt, team) -> _Team | None:
    if isinstance(team, bool) or not isinstance(team, (int, np.integer)):
        return None
    return _teams(rt).get(int(team))


def _count(rt, what: str, name: str, value, lo: int) -> int:
    """``value`` as an int >= ``lo``; ValueError quoting it otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
        raise ValueError(f"pe {rt.my_pe}: {what}: {name} must be an integer >= {lo}, got {value!r}")
    return int(value)


def _team(rt, team, what: str) -> _Team:
    t = _lookup(rt, team)
    if t is None:
        raise ValueError(f"pe {rt.my_pe}: {what}: team {team!r} is not a team of this PE (ACLSHMEM_TEAM_INVALID, "
                         f"destroyed, or a team this PE is not a member of)")
    return t


def _meet(rt, t: _Team, call: WaitCall, what: str) -> None:
    if t.shape.slot == ACLSHMEM_TEAM_WORLD:
        barrier(rt, call)
    else:
        team_barrier(rt, t.shape, call, what)


def _collective(rt, parent: _Team, what: str, op: int, args: tuple, new: tuple | None) -> int:
    """One collective call on ``parent`` (see the module docstring); returns the slot the leader claimed for
    the team ``new`` = (start, stride, size), or -1."""
    slot = parent.shape.slot
    parent.coll_seq += 1
    seq = parent.coll_seq
    claimed = None
    if parent.my_index == 0:
        claimed = table.claim(rt.ctl, *new, hosts=rt.hosts) if new is not None else None
        table.post(rt.ctl, slot, table.Mailbox(seq, op, args, claimed.slot if claimed else -1))
    _meet(rt, parent, WaitCall.TEAM_SPLIT, what)
    box = table.read(rt.ctl, slot)
    if (box.seq, box.op, box.args) != (seq, op, args):
        table.mark_bad(rt.ctl, slot, seq, parent.my_index)
    elif box.result >= 0 and new is not None:
        rt.ctl.pes[rt.my_pe]["team_barriers"][box.result] = 0
    _meet(rt, parent, WaitCall.TEAM_SPLIT, what)
    bad = table.bad_of(rt.ctl, slot, seq)
    if bad >= 0:
        if claimed is not None:
            table.release(rt.ctl, claimed.slot)
        raise ValueError(f"pe {rt.my_pe}: {what} on team {slot}: the members disagree: team pe {bad} (pe "
                         f"{parent.shape.start + bad * parent.shape.stride}) did not make the call team pe 0 made "
                         f"(call #{seq} on the team, arguments {box.args}); every member must make the same "
                         f"collective calls in the same order")
    if new is not None and box.result < 0:
        raise ShmemError(f"pe {rt.my_pe}: {what} on team {slot}: no free team slot (all {MAX_TEAMS - 1} are in "
                         f"use): destroy teams that are no longer needed")
    return box.result


def aclshmem_team_split_strided(parent_team: int, pe_start: int, pe_stride: int, pe_size: int) -> int:
    """A new team of the parent's PEs ``pe_start + k * pe_stride`` (parent indices, ``k < pe_size``).

    Collective over ``parent_team``: every member calls it with the same arguments. Returns the new team's
    handle on its members and ``ACLSHMEM_TEAM_INVALID`` on the other members of the parent (CANN returns 0
    and writes the handle through ``new_team``). Raises ValueError for an invalid parent or arguments.
    """
    rt = runtime()
    what = "aclshmem_team_split_strided"
    parent = _team(rt, parent_team, what)
    p = parent.shape
    start = _count(rt, what, "pe_start", pe_start, 0)
    stride = _count(rt, what, "pe_stride", pe_stride, 1)
    size = _count(rt, what, "pe_size", pe_size, 1)
    if start >= p.size or start + (size - 1) * stride >= p.size:
        raise ValueError(f"pe {rt.my_pe}: {what} of team {parent_team} ({p.size} PEs): pe_start {start}, "
                         f"pe_stride {stride}, pe_size {size} reach team pe {start + (size - 1) * stride}, outside "
                         f"the parent (a new team's PEs are a subset of the parent's)")
    new = (p.start + start * p.stride, p.stride * stride, size)
    slot = _collective(rt, parent, what, _OP_SPLIT, (start, stride, size), new)
    shape = TeamShape(slot, int(rt.ctl.teams[slot]["uid"]), *new)
    index = shape.index_of(rt.my_pe)
    if index < 0:
        return ACLSHMEM_TEAM_INVALID
    _teams(rt)[slot] = _Team(shape, index, config=aclshmem_team_config_t(uniqueid=shape.uid))
    log(LogLevel.INFO, rt.my_pe, f"{what}: created team {slot} ({shape}), team pe {index} here")
    return slot


def aclshmem_team_split_2d(parent_team: int, x_range: int) -> tuple[int, int]:
    """Split the parent into a 2-D grid of ``x_range`` columns: returns ``(x_team, y_team)`` of this PE.

    The x teams are the rows (parent PEs ``[i * x_range, (i + 1) * x_range)``, the last one shorter when
    ``x_range`` does not divide the parent's size); the y teams the columns (parent PEs ``j, j + x_range, ...``).
    With ``x_range`` = ranks per server the x teams are the servers and the y teams the cross-server lanes.
    Collective over ``parent_team``, as CANN's: one ``split_strided`` per row, then one per column.
    """
    rt = runtime()
    what = "aclshmem_team_split_2d"
    parent = _team(rt, parent_team, what)
    size = parent.shape.size
    x_range = min(_count(rt, what, "x_range", x_range, 1), size)
    x_team = y_team = ACLSHMEM_TEAM_INVALID
    for start in range(0, size, x_range):
        got = aclshmem_team_split_strided(parent_team, start, 1, min(x_range, size - start))
        x_team = got if got != ACLSHMEM_TEAM_INVALID else x_team
    for j in range(x_range):
        got = aclshmem_team_split_strided(parent_team, j, x_range, len(range(j, size, x_range)))
        y_team = got if got != ACLSHMEM_TEAM_INVALID else y_team
    return x_team, y_team


def aclshmem_team_destroy(team: int) -> None:
    """Destroy ``team`` (collective over its members). ``ACLSHMEM_TEAM_INVALID`` is a no-op, as in CANN, so that
    every PE of the parent may call it on what the split returned; ACLSHMEM_TEAM_WORLD cannot be destroyed."""
    rt = runtime()
    if team == ACLSHMEM_TEAM_INVALID:
        return
    what = "aclshmem_team_destroy"
    if team == ACLSHMEM_TEAM_WORLD:
        raise ValueError(f"pe {rt.my_pe}: {what}: ACLSHMEM_TEAM_WORLD cannot be destroyed")
    t = _team(rt, team, what)
    _collective(rt, t, what, _OP_DESTROY, (team, 0, 0), None)
    _relayed(rt, t.shape, [rt.my_pe], what)
    rt.ctl.pes[rt.my_pe]["team_barriers"][t.shape.slot] = 0
    del _teams(rt)[team]
    if t.my_index == 0:
        _relayed(rt, t.shape, [p for p in t.shape.members() if rt.hosts.local(p)], what)
        table.release(rt.ctl, t.shape.slot)
    log(LogLevel.INFO, rt.my_pe, f"{what}: destroyed team {team}")


def _relayed(rt, shape: TeamShape, pes: list[int], what: str) -> None:
    """In a job of several hosts, for a team with members on other hosts: wait until this host's NIC has taken
    the barrier arrivals of ``pes`` (PEs of this host) on the team's slot to the other hosts
    (``team_relayed``), before this PE resets the slot's counter or releases the slot. The NIC reads the
    counters when it gets to them: one reset or reused before would lose an arrival the other hosts wait for."""
    if not rt.hosts.multi or all(rt.hosts.local(p) for p in shape.members()):
        return
    rows, slot = rt.ctl.pes, shape.slot
    deadline = time.monotonic() + rt.timeout
    for p in pes:
        while True:
            n = int(rows[p]["team_barriers"][slot])
            if n == 0 or int(rows[p]["team_relayed"][slot]) == shape.uid << 32 | n:
                break
            if time.monotonic() > deadline:
                raise WaitTimeoutError(f"pe {rt.my_pe}: {what} of team {slot} ({shape}): this host's NIC did not "
                                       f"take pe {p}'s {n} arrivals on the team's barrier to the other hosts "
                                       f"within {rt.timeout:g} s")
            time.sleep(0.0002)


def aclshmem_team_my_pe(team: int) -> int:
    """This PE's index in ``team``; -1 when ``team`` is not a team of this PE."""
    t = _lookup(runtime(), team)
    return -1 if t is None else t.my_index


def aclshmem_team_n_pes(team: int) -> int:
    """The number of PEs of ``team``; -1 when ``team`` is not a team of this PE."""
    t = _lookup(runtime(), team)
    return -1 if t is None else t.shape.size


def aclshmem_team_translate_pe(src_team: int, src_pe: int, dest_team: int) -> int:
    """The index in ``dest_team`` of ``src_team``'s PE ``src_pe``; -1 when either team is not a team of this
    PE, ``src_pe`` is out of range, or that PE is not in ``dest_team``."""
    rt = runtime()
    src, dest = _lookup(rt, src_team), _lookup(rt, dest_team)
    if src is None or dest is None or isinstance(src_pe, bool) or not isinstance(src_pe, (int, np.integer)):
        return -1
    if not 0 <= src_pe < src.shape.size:
        return -1
    return dest.shape.index_of(src.shape.start + src_pe * src.shape.stride)


def aclshmem_team_pe_mapping(team: int, pe: int) -> int:
    """The global PE of ``team``'s PE ``pe`` (CANN's device call); -1 when invalid."""
    return aclshmem_team_translate_pe(team, pe, ACLSHMEM_TEAM_WORLD)


def aclshmem_team_get_config(team: int, config: aclshmem_team_config_t | None = None) -> aclshmem_team_config_t:
    """The configuration ``team`` was created with (``uniqueid``: its job-wide id); filled into ``config`` when
    given. ValueError when ``team`` is not a team of this PE (CANN returns ACLSHMEM_INVALID_PARAM)."""
    t = _team(runtime(), team, "aclshmem_team_get_config")
    if config is None:
        return aclshmem_team_config_t(t.config.version, t.config.num_contexts, t.config.uniqueid)
    config.version, config.num_contexts, config.uniqueid = t.config.version, t.config.num_contexts, \
        t.config.uniqueid
    return config


def team_info(team: int) -> TeamInfo:
    """``team`` as this PE sees it (members, this PE's index, its id); ValueError when not a team of this PE."""
    t = _team(runtime(), team, "team_info")
    s = t.shape
    return TeamInfo(s.slot, s.start, s.stride, s.size, t.my_index, s.uid)


def _team_meet(what: str, team) -> None:
    rt = runtime()
    t = _team(rt, team, what)
    rt.check_errors()
    _meet(rt, t, WaitCall.BARRIER_ALL if t.shape.slot == ACLSHMEM_TEAM_WORLD else WaitCall.TEAM_BARRIER, what)


def aclshmem_barrier(team: int) -> None:
    """Block until every member of ``team`` called it (the calling thread; PEs outside the team are not waited
    for). Raises a pending data-plane error first. Completes direct stores, not UDMA or SDMA work."""
    _team_meet("aclshmem_barrier", team)


def aclshmem_sync(team: int) -> None:
    """The same as ``aclshmem_barrier(team)`` here (as ``aclshmem_sync_all`` is ``aclshmem_barrier_all``)."""
    _team_meet("aclshmem_sync", team)


def aclshmemx_sync_vec(team: int) -> None:
    """Meet every block of every member of ``team``: call it from every block of a launch (the blocks meet, block
    0 meets the team, the blocks meet again). Outside a launch, the same as ``aclshmem_sync(team)``."""
    sync_all()
    if get_block_idx() == 0:
        _team_meet("aclshmemx_sync_vec", team)
    sync_all()


def aclshmemx_barrier_vec(team: int) -> None:
    """CANN's deprecated name of ``aclshmemx_sync_vec(team)``."""
    sync_all()
    if get_block_idx() == 0:
        _team_meet("aclshmemx_barrier_vec", team)
    sync_all()
