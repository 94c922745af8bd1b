"""``deep_ep.Buffer(group)`` on a sub-group of the job: a shmemx team or a torch.distributed group of 4 of 8 PEs,
contiguous (halves) and strided (even / odd PEs), the two disjoint groups running their own Buffers at once.
Each group's results are checked against the plain-numpy reference over the group's members only (payloads
encode their global origin, ``moe.reference.origin_x``, so a row from the other group would show)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import shmemx
from shmemx import deep_ep
from shmemx.deep_ep.tensors import to_numpy
from shmemx.kernels.moe import reference as ref

T, H, K, E = 40, 256, 4, 32
_LAYOUTS = {"halves": lambda n, g: (g * (n // 2), 1, n // 2), "evens": lambda n, g: (g, 2, n // 2)}


def _inputs(pe: int):
    rng = np.random.default_rng(900 + pe)
    idx = np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int64)
    idx[rng.random((T, K)) < 0.1] = -1
    return ref.origin_x(pe, T, H), idx, (rng.random((T, K)) + 0.5).astype(np.float32)


def _group_of(layout: str) -> tuple[int, int, int]:
    n, me = shmemx.n_pes(), shmemx.my_pe()
    for g in (0, 1):
        start, stride, size = _LAYOUTS[layout](n, g)
        if me in range(start, start + stride * size, stride):
            return start, stride, size
    raise AssertionError(me)


def _check_round_trip(buf, members: list[int], torch_io: bool = False) -> None:
    """One dispatch and combine on ``buf`` (a Buffer on ``members``), checked against the reference."""
    me = members.index(shmemx.my_pe())
    assert (buf.rank, buf.group_size) == (me, len(members))
    allin = [_inputs(pe) for pe in members]
    x, idx, w = allin[me]
    if torch_io:
        import torch
        x, idx, w = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16), torch.from_numpy(idx), \
            torch.from_numpy(w)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                          num_tokens_per_expert=per_expert, topk_idx=idx,
                                                          topk_weights=w)
    xs, idxs = [a[0] for a in allin], [a[1] for a in allin]
    want = ref.reference_dispatch(xs, idxs, [a[2] for a in allin], E, me)
    assert to_numpy(recv_x).view(np.uint16).tobytes() == want.recv_x.view(np.uint16).tobytes()
    assert np.array_equal(to_numpy(recv_idx), want.recv_topk_idx)
    combined, _, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
    recv = [ref.reference_dispatch(xs, idxs, None, E, r).recv_x for r in range(len(members))]
    assert to_numpy(combined).view(np.uint16).tobytes() == \
        ref.reference_combine(recv, idxs, E, me)[0].view(np.uint16).tobytes()


def _team_job(layout: str) -> None:
    shmemx.init(min_heap_size=512 << 20)
    n = shmemx.n_pes()
    mine = shmemx.ACLSHMEM_TEAM_INVALID
    for g in (0, 1):  # split_strided is collective over the world: every PE makes both teams
        got = shmemx.aclshmem_team_split_strided(shmemx.ACLSHMEM_TEAM_WORLD, *_LAYOUTS[layout](n, g))
        mine = got if got != shmemx.ACLSHMEM_TEAM_INVALID else mine
    start, stride, size = _group_of(layout)
    members = list(range(start, start + stride * size, stride))
    buf = deep_ep.Buffer(mine, int(1e8), explicitly_destroy=True)
    for _ in range(2):  # twice: the second call reuses the workspace (credits among the team only)
        _check_round_trip(buf, members)
    buf.destroy()
    shmemx.aclshmem_team_destroy(mine)
    shmemx.finalize()


@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
def test_two_disjoint_teams_run_their_own_buffers(run_ok, layout):
    run_ok(8, _team_job, layout, timeout=300)


def _torch_job(init_file: str, layout: str) -> None:
    import torch.distributed as dist

    me, n = int(os.environ["SHMEMX_RANK"]), int(os.environ["SHMEMX_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=me, world_size=n)
    groups = []
    for g in (0, 1):  # new_group is collective over the world, as torch.distributed wants it
        start, stride, size = _LAYOUTS[layout](n, g)
        groups.append((list(range(start, start + stride * size, stride)),
                       dist.new_group(list(range(start, start + stride * size, stride)))))
    members, group = next((m, grp) for m, grp in groups if me in m)
    buf = deep_ep.Buffer(group, int(1e8), explicitly_destroy=True)
    _check_round_trip(buf, members, torch_io=True)
    buf.destroy()
    dist.destroy_process_group()


@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
def test_torch_new_group_sub_groups(run_ok, tmp_path, layout):
    pytest.importorskip("torch")
    run_ok(8, _torch_job, str(tmp_path / "gloo_init"), layout, timeout=300)


def _refused_job() -> None:
    shmemx.init(min_heap_size=512 << 20)
    team = shmemx.aclshmem_team_split_strided(shmemx.ACLSHMEM_TEAM_WORLD, shmemx.my_pe() // 2 * 2, 1, 2) \
        if False else shmemx.aclshmem_team_split_strided(shmemx.ACLSHMEM_TEAM_WORLD, 0, 2, 2)
    even = shmemx.aclshmem_team_split_strided(shmemx.ACLSHMEM_TEAM_WORLD, 1, 2, 2)
    mine = team if team != shmemx.ACLSHMEM_TEAM_INVALID else even
    buf = deep_ep.Buffer(mine, int(1e7), int(1e7))
    with pytest.raises(NotImplementedError, match="low-latency mode runs on the whole job only"):
        buf.low_latency_dispatch(np.zeros((1, 128), np.float32), np.zeros((1, 1), np.int64), 1, 4)
    with pytest.raises(TypeError, match="group must be None, a shmemx team"):
        deep_ep.Buffer("world", int(1e7))
    shmemx.finalize()


def test_sub_group_low_latency_is_refused(run_ok):
    run_ok(4, _refused_job, timeout=120)
