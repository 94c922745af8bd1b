"""The team table of the control segment: who owns a team slot, and the mailbox of a team's collective calls.

A team is a strided set of PEs (``barrier.TeamShape``). Its slot in the table (``control.TEAM_DTYPE``, one
64-byte entry per slot, ``MAX_TEAMS`` of them) holds the team's barrier counter and generation (``barrier``),
its shape and job-wide id, and a mailbox. Slot 0 is ACLSHMEM_TEAM_WORLD, whose barrier is the job's own; the
other slots are handed out by ``claim`` and returned by ``release``.

Who writes what. ``claim`` takes a free slot (``uid == 0``) with a compare-and-swap of its uid, so two leaders
of different parent teams never get the same slot; only the claimer writes the shape. The mailbox of a slot is
written by the team's leader (its team PE 0) before a meeting of the team and read by every member after it
(``post``, ``read``); a member that finds the leader's call different from its own marks the call as bad
(``mark_bad``), which every member reads after the next meeting. Job-wide ids come from the header's
``team_uids`` counter (a locked add): a slot is reused, an id never.
"""

from __future__ import annotations

from typing import Any

from dataclasses import dataclass

import numpy as np

from . import atomics
from .barrier import TeamShape
from .control import MAX_TEAMS

__all__ = ["WORLD_UID", "claim", "slot_host", "release", "released_elsewhere", "shape_of", "post", "read", "mark_bad",
           "bad_of", "Mailbox"]

WORLD_UID = 1
_BAD = 1 << 31  # set in coll_seq when a member disagreed with the leader's call
_SEQ_MASK = _BAD - 1


@dataclass(frozen=True)
class Mailbox:
    """What a leader posted for a collective call: its sequence number on the team, the call's op code, three
    integer arguments and the result (a slot the leader claimed, -1 for none)."""

    seq: int
    op: int
    args: tuple[int, int, int]
    result: int


def claim(ctl: np.ndarray, start: int, stride: int, size: int, hosts: Any = None) -> TeamShape | None:
    """A free team slot for the team ``start + i * stride`` (i < size), with a new job-wide id; None when every
    slot is taken. Its barrier counter is zero (a released slot's is: its last barrier completed). In a job of
    several hosts (``hosts``, a ``shm.hosts.HostMap``) each host claims from its own share of the slots
    (``slot_host``), so that the hosts' NICs can merge their tables without two hosts taking one slot."""
    uid = atomics.fetch_add_u32(ctl.header_addr("team_uids"), 1) + WORLD_UID + 1
    for slot in range(1, MAX_TEAMS):
        if hosts is not None and hosts.multi and slot_host(slot, hosts.n_hosts) != hosts.index:
            continue
        if int(ctl.teams[slot]["uid"]) != 0:
            continue
        if atomics.compare_exchange(ctl.team_addr(slot, "uid"), 0, uid, 4) == 0:
            entry = ctl.teams[slot]
            entry["size"], entry["start"], entry["stride"] = size, start, stride
            entry["count"] = 0
            return TeamShape(slot, uid, start, stride, size)
    return None


def slot_host(slot: int, n_hosts: int) -> int:
    """The host whose leaders claim team slot ``slot`` (the world's slot 0 is host 0's: PE 0 leads the world)."""
    return 0 if slot == 0 else (slot - 1) % n_hosts


def release(ctl: np.ndarray, slot: int) -> None:
    """Return a slot to the table (its shape stays readable until it is claimed again). The released team's id
    stays in ``released``: in a job of several hosts the team's leader may be on another host than the one that
    claimed the slot, and that host frees it when it learns of the release (``released_elsewhere``)."""
    e = ctl.teams[slot]
    e["released"] = e["uid"]
    atomics.exchange(ctl.team_addr(slot, "uid"), 0, 4)


def released_elsewhere(ctl: np.ndarray, slot: int, uid: int) -> bool:
    """The leader of team ``uid`` released ``slot`` on another host: free the slot here if it still holds that
    team (a slot claimed again since holds a new id: ids are never reused). Whether it was freed."""
    return uid != 0 and atomics.compare_exchange(ctl.team_addr(slot, "uid"), uid, 0, 4) == uid


def shape_of(ctl: np.ndarray, slot: int) -> TeamShape | None:
    """The team that holds ``slot`` now, or None when the slot is free."""
    e = ctl.teams[slot]
    uid = int(e["uid"])
    if uid == 0:
        return None
    return TeamShape(slot, uid, int(e["start"]), int(e["stride"]), int(e["size"]))


def post(ctl: np.ndarray, slot: int, box: Mailbox) -> None:
    """The leader's call into the mailbox of ``slot`` (before the meeting that publishes it)."""
    e = ctl.teams[slot]
    e["coll_op"], e["coll_args"], e["coll_result"] = box.op, box.args, box.result
    e["coll_seq"] = box.seq


def read(ctl: np.ndarray, slot: int) -> Mailbox:
    e = ctl.teams[slot]
    return Mailbox(int(e["coll_seq"]) & _SEQ_MASK, int(e["coll_op"]), tuple(int(a) for a in e["coll_args"]),
                   int(e["coll_result"]))


def mark_bad(ctl: np.ndarray, slot: int, seq: int, index: int) -> None:
    """Member ``index`` disagrees with the leader on call ``seq``: every member raises after the next meeting."""
    e = ctl.teams[slot]
    e["coll_bad"] = index + 1
    atomics.exchange(ctl.team_addr(slot, "coll_seq"), (seq & _SEQ_MASK) | _BAD, 4)  # locked: seen after the meeting


def bad_of(ctl: np.ndarray, slot: int, seq: int) -> int:
    """The team index of a member that disagreed on call ``seq``, or -1."""
    e = ctl.teams[slot]
    if int(e["coll_seq"]) != (seq & _SEQ_MASK) | _BAD:
        return -1
    return int(e["coll_bad"]) - 1
