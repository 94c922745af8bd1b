"""The team a ``moe.Buffer`` runs on: its view of "me", "P" and "peer p" (``Peers``).

Every index in the kernels (``me``, ``n_pes``, a peer ``s``, the rows of the workspace's per-peer regions) is a
rank in the buffer's team; only the calls that reach another PE (a signal, a UDMA queue, an MTE put, a get) take
the peer's global PE, ``Peers.pe(s)``, and a barrier is the team's (``aclshmem_barrier(team)``). The default
team is ACLSHMEM_TEAM_WORLD, where the team rank is the global PE and nothing changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import shmemx

__all__ = ["Peers"]


@dataclass(frozen=True)
class Peers:
    """A team seen from one of its PEs: ``me`` (this PE's team rank), ``n_pes`` (the team's size), ``pes``
    (team rank -> global PE) and ``team`` (the shmemx team handle, for barriers and splits)."""

    team: int
    me: int
    n_pes: int
    pes: np.ndarray

    @classmethod
    def of(cls, team: int | None = None) -> "Peers":
        """The view of ``team`` (None: the world). ValueError when this PE is not a member of ``team``."""
        world = shmemx.ACLSHMEM_TEAM_WORLD
        team = world if team is None else int(team)
        me, n = shmemx.aclshmem_team_my_pe(team), shmemx.aclshmem_team_n_pes(team)
        if me < 0 or n < 1:
            raise ValueError(f"pe {shmemx.my_pe()}: moe.Buffer: team {team} is not a team of this PE")
        pes = np.array([shmemx.aclshmem_team_translate_pe(team, r, world) for r in range(n)], np.int64)
        return cls(team, me, n, pes)

    @property
    def world(self) -> bool:
        return self.team == shmemx.ACLSHMEM_TEAM_WORLD

    def pe(self, rank: int) -> int:
        """The global PE of team rank ``rank``."""
        return int(self.pes[rank])

    def barrier(self) -> None:
        """The team's barrier (the job's own on the world)."""
        if self.world:
            shmemx.aclshmem_barrier_all()
        else:
            shmemx.aclshmem_barrier(self.team)
