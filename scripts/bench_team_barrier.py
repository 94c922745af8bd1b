"""The cost of a team barrier against the job barrier and the hand-written flag barrier it replaced (the MoE
hierarchy's server barrier: SET a flag on every other member, wait for all of theirs).

    flock /tmp/shmemx-heavy.lock shmemx run -n 8 scripts/bench_team_barrier.py --team 4 --iters 2000

The first ``--team`` PEs form a team (``aclshmem_team_split_strided``); the others do the job barriers only. Each
kind runs ``--iters`` times, in rounds that alternate the kinds (so that the host's load falls on all of them
alike); PE 0 prints the median microseconds per barrier of each kind and the ratios to the flag barrier.
"""

import argparse
import time

import numpy as np

import shmemx

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--team", type=int, default=4, help="PEs of the team (the first ones)")
ap.add_argument("--iters", type=int, default=1000)
ap.add_argument("--rounds", type=int, default=5)
args = ap.parse_args()

shmemx.init()
me, n = shmemx.my_pe(), shmemx.n_pes()
size = min(args.team, n)
team = shmemx.aclshmem_team_split_strided(shmemx.ACLSHMEM_TEAM_WORLD, 0, 1, size)
flags = shmemx.zeros(size, np.uint64, name="flags")
status = np.zeros(size, np.int32)
seq = 0


def flag_barrier() -> None:
    global seq
    seq += 1
    for p in range(size):
        if p != me:
            shmemx.aclshmemx_signal_op(flags[me:me + 1], seq, shmemx.ACLSHMEM_SIGNAL_SET, p)
    status[:] = 0
    status[me] = 1
    shmemx.aclshmem_wait_until_all(flags, shmemx.ACLSHMEM_CMP_GE, seq, status=status)


kinds = {"team barrier": lambda: shmemx.aclshmem_barrier(team), "flag barrier": flag_barrier,
         "job barrier (all PEs)": shmemx.aclshmem_barrier_all}
times = {k: [] for k in kinds}
per_round = max(1, args.iters // args.rounds)
for _ in range(args.rounds):
    for name, fn in kinds.items():
        if me >= size and name != "job barrier (all PEs)":
            continue
        start = time.perf_counter()
        for _ in range(per_round):
            fn()
        times[name].append((time.perf_counter() - start) / per_round * 1e6)
shmemx.aclshmem_barrier_all()
if me == 0:
    med = {k: float(np.median(v)) for k, v in times.items()}
    print(f"{n} PEs, team of {size}, {args.rounds} rounds of {per_round}: median us per barrier")
    for k, v in med.items():
        print(f"  {k:<24} {v:8.1f} us   ({v / med['flag barrier']:.2f}x the flag barrier)")
shmemx.aclshmem_team_destroy(team)
shmemx.finalize()
