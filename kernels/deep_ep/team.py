"""The team of a ``deep_ep.Buffer``: ``group`` (None, a shmemx team, a torch.distributed group) as a shmemx team.

A sub-group Buffer runs its kernels among its members only (``moe.peers.Peers``: team ranks in the kernels, the
team's global PEs for every call that reaches a peer). What stays job-wide is the symmetric heap: an allocation
is collective over the whole job (every PE allocates the same bytes at the same offset, checked), so every PE of
the job constructs its Buffer (each on its own group) and the Buffers allocate in the same order with the same
sizes (the same arguments and, at the first dispatch, the same shapes). See docs/deepep.md.

A torch.distributed group is made a team here: every PE of the job posts its group's (start, stride, size) on
the heap, and the job splits the world once per distinct group, in one order (``aclshmem_team_split_strided`` is
collective over its parent). A group must be strided in the job's ranks (``start + k * stride``, in rank order).
"""

from __future__ import annotations

from typing import Any

import numpy as np

import shmemx

__all__ = ["resolve"]


def _torch_ranks(group) -> list[int] | None:
    """The job ranks of a torch.distributed group, in group-rank order; None when ``group`` is not one."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not isinstance(group, dist.ProcessGroup):
        return None
    if dist.get_rank() != shmemx.my_pe():
        raise ValueError(f"pe {shmemx.my_pe()}: deep_ep.Buffer: torch.distributed rank {dist.get_rank()} is not "
                         f"this PE: start torch.distributed with rank = shmemx.my_pe()")
    return [int(r) for r in dist.get_process_group_ranks(group)]


def _shape(ranks: list[int]) -> tuple[int, int, int]:
    me = shmemx.my_pe()
    stride = ranks[1] - ranks[0] if len(ranks) > 1 else 1
    if stride < 1 or ranks != list(range(ranks[0], ranks[0] + stride * len(ranks), stride)) or me not in ranks:
        raise ValueError(f"pe {me}: deep_ep.Buffer: the group's ranks {ranks} are not a strided set of the job's "
                         f"ranks (start + k * stride, ascending) that holds this PE: shmemx teams are strided")
    return ranks[0], stride, len(ranks)


def _split(mine: tuple[int, int, int]) -> int:
    """Every PE's group shape, then one world split per distinct shape (collective over the job)."""
    n, me = shmemx.n_pes(), shmemx.my_pe()
    box = shmemx.aclshmem_malloc(n * 3 * 8, name="deep_ep_groups").view(np.int64).reshape(n, 3)
    box[me] = mine
    shmemx.aclshmem_barrier_all()
    shapes = np.zeros((n, 3), np.int64)
    for pe in range(n):
        shmemx.aclshmem_getmem(shapes[pe], box[pe], 24, pe)
    shmemx.aclshmem_barrier_all()
    shmemx.aclshmem_free(box.view(np.uint8).reshape(-1))
    team = shmemx.ACLSHMEM_TEAM_INVALID
    for start, stride, size in sorted({tuple(int(v) for v in s) for s in shapes} - {(0, 1, n)}):
        got = shmemx.aclshmem_team_split_strided(shmemx.ACLSHMEM_TEAM_WORLD, start, stride, size)
        team = got if got != shmemx.ACLSHMEM_TEAM_INVALID else team
    return shmemx.ACLSHMEM_TEAM_WORLD if mine == (0, 1, n) else team


def resolve(group: Any) -> tuple[int, bool]:
    """(the shmemx team of ``group``, whether this call made it: the Buffer destroys it). ``group``: None (the
    job), a shmemx team handle (an int: used as is, this PE must be a member), or a torch.distributed group.
    Collective over the job for a torch group (every PE of the job passes its own group)."""
    if group is None:
        return shmemx.ACLSHMEM_TEAM_WORLD, False
    if isinstance(group, (int, np.integer)) and not isinstance(group, bool):
        if shmemx.aclshmem_team_my_pe(int(group)) < 0:
            raise ValueError(f"pe {shmemx.my_pe()}: deep_ep.Buffer: team {int(group)} is not a team of this PE")
        return int(group), False
    ranks = _torch_ranks(group)
    if ranks is None:
        raise TypeError(f"pe {shmemx.my_pe()}: deep_ep.Buffer: group must be None, a shmemx team or a "
                        f"torch.distributed ProcessGroup, got {type(group).__name__}")
    team = _split(_shape(ranks))
    return team, team != shmemx.ACLSHMEM_TEAM_WORLD
