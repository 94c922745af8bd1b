"""Across hosts: team slots come back to the host that claimed them.

The world's leader (pe 0, host 0) claims the slot of every team split from the world, from host 0's share of the
table; a team whose PEs are all on host 1 has its leader there, and that leader releases the slot at the
destroy. The release must reach host 0's table: more split/destroy rounds than host 0's share holds (127 of the
256 slots with 2 hosts) run out of slots otherwise. Every 8th round also makes and destroys a team of one PE of
each host: a destroy must not lose an arrival that the NIC has still to take to the other host. Run by tests/test_hosts.py as ``shmemx run -n 4 --hosts 2``."""

import numpy as np

import shmemx
from shmemx import *

shmemx.init(heap_size="16M")
me, n = aclshmem_my_pe(), aclshmem_n_pes()
half = n // 2
ROUNDS = ACLSHMEM_MAX_TEAMS // 2 + 20
for r in range(ROUNDS):
    far = aclshmem_team_split_strided(ACLSHMEM_TEAM_WORLD, half, 1, n - half)  # host 1's PEs: led on host 1
    near = aclshmem_team_split_strided(ACLSHMEM_TEAM_WORLD, 0, 1, half)  # host 0's PEs: led on host 0
    mine = far if me >= half else near
    assert aclshmem_team_n_pes(mine) == half and aclshmem_team_my_pe(mine) == me % half, (r, mine)
    aclshmem_barrier(mine)
    aclshmem_team_destroy(far)
    aclshmem_team_destroy(near)
    if r % 8 == 0:  # a team across both hosts (its barriers relayed by the NICs), destroyed right after use
        both = aclshmem_team_split_strided(ACLSHMEM_TEAM_WORLD, half - 1, 1, 2)
        if half - 1 <= me <= half:
            aclshmem_barrier(both)
        aclshmem_team_destroy(both)
    aclshmem_barrier_all()
print(f"pe {me}: team slots ok after {ROUNDS} rounds", flush=True)
