"""Teams: the shapes of split_strided and split_2d against a pure reference, translate_pe, barriers that complete
only their team (and complete it), nested teams, slot reuse, agreement checks and refusals; at 4, 8 and 16 PEs.

The reference (``_strided``, ``_grid``) is written from the header's description of the calls, not from the
implementation: a strided team of a parent is the parent's PEs ``start + k * stride``; a 2-D split of P PEs with
x_range X has rows ``[i * X, (i + 1) * X)`` (the last one shorter) and columns ``j, j + X, ...``.
"""

from __future__ import annotations

import numpy as np
import pytest

import shmemx

WORLD, INVALID = shmemx.ACLSHMEM_TEAM_WORLD, shmemx.ACLSHMEM_TEAM_INVALID
SIZES = [4, 8, 16]


def _strided(parent: list[int], start: int, stride: int, size: int) -> list[int]:
    return [parent[start + k * stride] for k in range(size)]


def _grid(parent: list[int], x: int) -> tuple[list[list[int]], list[list[int]]]:
    x = min(x, len(parent))
    rows = [parent[i:i + x] for i in range(0, len(parent), x)]
    cols = [parent[j::x] for j in range(x)]
    return rows, cols


def _check_team(team: int, members: list[int], me: int) -> None:
    """``team`` as this PE sees it equals the reference ``members`` (global PEs in team order)."""
    if me not in members:
        assert team == INVALID
        assert shmemx.aclshmem_team_my_pe(team) == -1 and shmemx.aclshmem_team_n_pes(team) == -1
        return
    assert team != INVALID
    info = shmemx.team_info(team)
    assert list(info.members) == members and info.my_pe == members.index(me)
    assert shmemx.aclshmem_team_my_pe(team) == members.index(me)
    assert shmemx.aclshmem_team_n_pes(team) == len(members)
    for i, pe in enumerate(members):  # translate_pe both ways, and the device's pe_mapping
        assert shmemx.aclshmem_team_translate_pe(team, i, WORLD) == pe
        assert shmemx.aclshmem_team_translate_pe(WORLD, pe, team) == i
        assert shmemx.aclshmem_team_pe_mapping(team, i) == pe
    outside = [pe for pe in range(shmemx.n_pes()) if pe not in members]
    for pe in outside:
        assert shmemx.aclshmem_team_translate_pe(WORLD, pe, team) == -1
    assert shmemx.aclshmem_team_translate_pe(team, len(members), WORLD) == -1
    assert shmemx.aclshmem_team_get_config(team).uniqueid == info.uid


def _shapes(me: int, n: int) -> list[int]:
    """Strided teams, a 2-D split (divisor and not), a nested split; returns every team made."""
    world = list(range(n))
    made = []
    for start, stride, size in ((1, 2, n // 2), (0, 3, (n + 2) // 3), (n // 2, 1, n - n // 2), (0, 1, n)):
        team = shmemx.aclshmem_team_split_strided(WORLD, start, stride, size)
        _check_team(team, _strided(world, start, stride, size), me)
        made.append(team)
    for x in (2, 3, n, n + 5):
        xt, yt = shmemx.aclshmem_team_split_2d(WORLD, x)
        rows, cols = _grid(world, x)
        _check_team(xt, next(r for r in rows if me in r), me)
        _check_team(yt, next(c for c in cols if me in c), me)
        made += [xt, yt]
    odd = made[0]  # nested: the second half of the odd PEs, a split of a split
    odd_members = _strided(world, 1, 2, n // 2)
    k = len(odd_members)
    if odd != INVALID:
        nested = shmemx.aclshmem_team_split_strided(odd, k // 2, 1, k - k // 2)
        want = odd_members[k // 2:]
        _check_team(nested, want, me)
        if nested != INVALID:  # translate between the nested team and its parent
            for i, pe in enumerate(want):
                assert shmemx.aclshmem_team_translate_pe(nested, i, odd) == odd_members.index(pe)
        made.append(nested)
    return made


def _only_the_team(me: int, n: int, counter: np.ndarray, flag: np.ndarray) -> None:
    """A team barrier completes when (and only when) every member arrived, whatever the other PEs do: the first
    half meets 5 times and the second half 3 times at once, each member adding to its team leader's counter
    before each barrier and checking after it that all its team did; then the non-members of the first half wait
    for a flag its leader sets only after its barriers (a barrier that needed them would deadlock)."""
    half = n // 2
    first = shmemx.aclshmem_team_split_strided(WORLD, 0, 1, half)
    second = shmemx.aclshmem_team_split_strided(WORLD, half, 1, n - half)
    team, size, leader, rounds = (first, half, 0, 5) if me < half else (second, n - half, half, 3)
    for r in range(1, rounds + 1):
        shmemx.aclshmem_int64_atomic_add(counter, 1, leader)
        shmemx.aclshmem_barrier(team)
        assert int(shmemx.aclshmem_int64_atomic_fetch(counter, leader)) >= r * size  # every member arrived
        shmemx.aclshmem_barrier(team)
    if me == 0:
        for pe in range(half, n):
            shmemx.aclshmemx_signal_op(flag, 1, shmemx.ACLSHMEM_SIGNAL_SET, pe)
    if me >= half:
        shmemx.aclshmem_signal_wait_until(flag, shmemx.ACLSHMEM_CMP_EQ, 1)

    def kernel():  # the kernel form: every block of every member
        shmemx.aclshmemx_sync_vec(team)
        shmemx.aclshmemx_barrier_vec(team)

    shmemx.launch(kernel, 3)
    shmemx.aclshmem_team_destroy(first)
    shmemx.aclshmem_team_destroy(second)


def _refusals(me: int, n: int) -> None:
    with pytest.raises(ValueError, match=rf"pe {me}: aclshmem_barrier: team -1 is not a team of this PE"):
        shmemx.aclshmem_barrier(INVALID)
    with pytest.raises(ValueError, match=rf"pe {me}: aclshmem_team_split_strided of team 0 \({n} PEs\): "
                                         rf"pe_start 1, pe_stride 2, pe_size {n} .* outside the parent"):
        shmemx.aclshmem_team_split_strided(WORLD, 1, 2, n)
    with pytest.raises(ValueError, match="pe_stride must be an integer >= 1, got 0"):
        shmemx.aclshmem_team_split_strided(WORLD, 0, 0, 1)
    with pytest.raises(ValueError, match="ACLSHMEM_TEAM_WORLD cannot be destroyed"):
        shmemx.aclshmem_team_destroy(WORLD)
    # the members disagree: every PE raises, naming pe 1 (it asked for one PE fewer)
    with pytest.raises(ValueError, match=r"the members disagree: team pe 1 \(pe 1\) did not make the call"):
        shmemx.aclshmem_team_split_strided(WORLD, 0, 1, 1 if me == 1 else 2)
    shmemx.aclshmem_team_destroy(INVALID)  # a no-op, as in CANN
    assert shmemx.aclshmem_team_n_pes(12345) == -1


def _reuse(me: int) -> None:
    """More teams made and destroyed than the table has slots: slots are reused, ids never."""
    uids = set()
    for _ in range(shmemx.ACLSHMEM_MAX_TEAMS + 8):
        team = shmemx.aclshmem_team_split_strided(WORLD, 0, 1, 2)
        if team != INVALID:
            uids.add(shmemx.team_info(team).uid)
        shmemx.aclshmem_team_destroy(team)
    assert len(uids) == (shmemx.ACLSHMEM_MAX_TEAMS + 8 if me < 2 else 0)


def _teams_job():
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    counter = shmemx.zeros(1, np.int64, name="counter")
    flag = shmemx.zeros(1, np.int32, name="flag")
    made = _shapes(me, n)
    _only_the_team(me, n, counter, flag)
    _refusals(me, n)
    for team in reversed(made):  # every member destroys, a non-member's INVALID is a no-op
        shmemx.aclshmem_team_destroy(team)
    _reuse(me)
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


@pytest.mark.parametrize("n", SIZES)
def test_team_semantics(run_ok, n, no_leak):
    run_ok(n, _teams_job, timeout=240 if n > 8 else 120)
