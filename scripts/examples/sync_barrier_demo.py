"""CANN SHMEM's ``rdma_sync_barrier_demo`` (and ``rdma_handlewait_test``) re-expressed over UDMA with shmemx.

    shmemx run -n 8 scripts/examples/sync_barrier_demo.py --mode barrier_team

Every PE (every member of the team, for the team modes) writes its segment of 256 KiB, filled with ``pe + 10``,
into the same place of every other PE's symmetric buffer; then the segments must all be in place everywhere. The
four modes are CANN's four demos; RoCE is not emulated, so the puts are UDMA puts (``aclshmemx_udma_put_nbi``)
and the completion is what UDMA offers:

* ``sync_all``: the kernel puts, quiets every peer (``aclshmemx_udma_quiet``), then ``aclshmemx_sync_vec_all``;
* ``barrier_all``: the kernel only puts; the host then queues ``aclshmemx_handle_wait`` of a handle on
  ACLSHMEM_TEAM_WORLD on the kernel's stream (it quiets every peer, then meets the team: CANN's
  ``roce_barrier_all``, a barrier that completes the RDMA writes);
* ``sync_team``, ``barrier_team``: the same within the team of the odd PEs (``aclshmem_team_split_strided(WORLD,
  1, 2, n / 2)``): the members put to each other only, quiet and ``aclshmemx_sync_vec(team)``, or
  ``aclshmemx_handle_wait`` on the team; the even PEs do nothing and are not waited for.

Kernels run on an emulated stream (``stream.launch``; ``aclrtSynchronizeStream``), as in CANN's ``main.cpp``. Each
taking part PE checks every member's segment. Prints ``[PASS] <mode> check success, pe=N`` (a PE outside the team:
``[PASS] <mode> not a member, pe=N``) or ``[FAIL] ...``; exits 1 on a mismatch.
"""

import argparse

import numpy as np

import shmemx

MODES = ("sync_all", "barrier_all", "sync_team", "barrier_team")
ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--mode", choices=MODES, default="sync_all")
ap.add_argument("--kib", type=int, default=256, help="segment size in KiB (default 256, CANN's)")
args = ap.parse_args()

shmemx.init()
me, n = shmemx.my_pe(), shmemx.n_pes()
words = args.kib * 1024 // 4
gva = shmemx.zeros((n, words), np.int32, name="gva")
gva[me] = me + 10
team = shmemx.ACLSHMEM_TEAM_WORLD
if args.mode.endswith("_team"):
    team = shmemx.aclshmem_team_split_strided(shmemx.ACLSHMEM_TEAM_WORLD, 1, 2, n // 2)
shmemx.aclshmem_barrier_all()  # every PE's own segment is set


def kernel(members: tuple, sync: bool) -> None:
    for peer in members:
        if peer != me:
            shmemx.aclshmemx_udma_put_nbi(gva[me], gva[me], words, peer)
    if sync:
        for peer in members:
            if peer != me:
                shmemx.aclshmemx_udma_quiet(peer)
        shmemx.aclshmemx_sync_vec(team)


ok = True
if team == shmemx.ACLSHMEM_TEAM_INVALID:
    print(f"[PASS] {args.mode} not a member, pe={me}")
else:
    members = shmemx.team_info(team).members
    stream = shmemx.aclrtCreateStream()
    stream.launch(kernel, 1, members, args.mode.startswith("sync"))
    if args.mode.startswith("barrier"):
        shmemx.aclshmemx_handle_wait(shmemx.aclshmem_handle_t(team_id=team), stream)
    shmemx.aclrtSynchronizeStream(stream)
    bad = [pe for pe in members if not (gva[pe] == pe + 10).all()]
    others = [pe for pe in range(n) if pe not in members and pe != me and gva[pe].any()]
    ok = not bad and not others
    if ok:
        print(f"[PASS] {args.mode} check success, pe={me}")
    else:
        print(f"[FAIL] pe={me}: segments of pes {bad} wrong, of non-members {others} written")
    shmemx.aclrtDestroyStream(stream)
if team != shmemx.ACLSHMEM_TEAM_WORLD:
    shmemx.aclshmem_team_destroy(team)  # every PE: INVALID (not a member) is a no-op
shmemx.aclshmem_barrier_all()
shmemx.finalize()
raise SystemExit(0 if ok else 1)
