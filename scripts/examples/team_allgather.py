"""An allgather in two steps over the teams of a 2-D split (CANN SHMEM's team demos: ``aclshmem_team_split_2d``,
``aclshmem_team_translate_pe``, team barriers; the intra-server x cross-server decomposition of the seeds).

    shmemx run -n 8 scripts/examples/team_allgather.py --x 4

``aclshmem_team_split_2d(WORLD, x)`` gives every PE its row team (``x`` consecutive PEs: a server when ``x`` is
the ranks per server) and its column team (the PEs ``x`` apart: one per server, the same lane). Then:

1. inside the row, every PE puts its contribution into its slot of every row member's ``gathered`` buffer
   (``aclshmem_int32_put``, engine-agnostic: MTE or UDMA as the job enables) and the row meets
   (``aclshmem_barrier(row)``): every row member holds the row's slots;
2. across the column, every PE sends its row's block of slots (contiguous: the row's PEs are consecutive) to the
   PE of its column in every other row, with one put and an ADD of 1 on that PE's ``arrived`` counter
   (``aclshmem_int32_put_signal``), and waits until its own counter says every other row's block is in
   (``aclshmem_int32_wait_until``);
3. ``aclshmemx_handle_wait`` on the column team, queued on a stream, completes the step for the next call.

The global PEs of team members come from ``aclshmem_team_translate_pe``. Every PE checks the whole ``gathered``
against a numpy reference (a slot holds ``pe * 1000 + i``). Prints PASS or FAIL per PE; exits 1 on a mismatch.
"""

import argparse

import numpy as np

import shmemx

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--x", type=int, default=2, help="x_range of the split: PEs per row (default 2)")
ap.add_argument("--len", type=int, default=1024, help="int32 elements per PE (default 1024)")
args = ap.parse_args()

shmemx.init()
me, n = shmemx.my_pe(), shmemx.n_pes()
if args.x < 1 or n % args.x:
    ap.error(f"--x {args.x} must divide the {n} PEs (a ragged grid has columns that miss a row)")
WORLD = shmemx.ACLSHMEM_TEAM_WORLD
length = args.len
gathered = shmemx.zeros((n, length), np.int32, name="gathered")
arrived = shmemx.zeros(1, np.int32, name="arrived")
row, col = shmemx.aclshmem_team_split_2d(WORLD, args.x)
row_pes = [shmemx.aclshmem_team_translate_pe(row, i, WORLD) for i in range(shmemx.aclshmem_team_n_pes(row))]
col_pes = [shmemx.aclshmem_team_translate_pe(col, i, WORLD) for i in range(shmemx.aclshmem_team_n_pes(col))]
mine = me * 1000 + np.arange(length, dtype=np.int32)

# 1. inside the row
for pe in row_pes:
    shmemx.aclshmem_int32_put(gathered[me], mine, length, pe)
shmemx.aclshmem_barrier(row)
# 2. across the column: this row's block to the same lane of every other row
lo, hi = row_pes[0], row_pes[-1] + 1
for pe in col_pes:
    if pe != me:
        shmemx.aclshmem_int32_put_signal(gathered[lo:hi].reshape(-1), gathered[lo:hi].reshape(-1),
                                         (hi - lo) * length, arrived, 1, shmemx.ACLSHMEM_SIGNAL_ADD, pe)
shmemx.aclshmem_int32_wait_until(arrived, shmemx.ACLSHMEM_CMP_EQ, len(col_pes) - 1)
# 3. the column's completion, on a stream
stream = shmemx.aclrtCreateStream()
shmemx.aclshmemx_handle_wait(shmemx.aclshmem_handle_t(team_id=col), stream)
shmemx.aclrtSynchronizeStream(stream)

golden = np.arange(n)[:, None] * 1000 + np.arange(length)[None, :]
ok = np.array_equal(gathered, golden)
row_i, col_i = shmemx.aclshmem_team_my_pe(row), shmemx.aclshmem_team_my_pe(col)
if ok:
    print(f"PASS: pe {me}: row {row_pes[0] // args.x} (team pe {row_i} of {len(row_pes)}), "
          f"column team pe {col_i} of {len(col_pes)}: all {n} x {length} gathered")
else:
    wrong = [pe for pe in range(n) if not np.array_equal(gathered[pe], golden[pe])]
    print(f"FAIL: pe {me}: the slots of pes {wrong} differ from the reference")
shmemx.aclrtDestroyStream(stream)
shmemx.aclshmem_team_destroy(row)
shmemx.aclshmem_team_destroy(col)
shmemx.finalize()
raise SystemExit(0 if ok else 1)
