"""Across hosts: CAM's moe_dispatch_normal / moe_combine_normal against tests/test_cam.py's reference.

Ranks of the other host are reached over UDMA (kernels/cam/far.py), ranks of this host through their window
views, as on one host. Run by tests/test_hosts.py as ``shmemx run -n N --hosts 2``: plain and DynamicQuant pairs,
a skewed routing, free-running iterations (no barrier between pairs), then no flag left behind."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import shmemx  # noqa: E402
from test_cam import HEAP, _check_pair, _ctx, _flag_areas  # noqa: E402

shmemx.init(heap_size=HEAP)
me, R = shmemx.my_pe(), shmemx.n_pes()
K, E_LOC = 3, 2
ctx = _ctx(K, aiv_num=3)
assert [ctx.ep.near(r) for r in range(R)] == [r // (R // 2) == me // (R // 2) for r in range(R)], \
    f"pe {me}: near ranks {[ctx.ep.near(r) for r in range(R)]}"
for it in range(6):
    _check_pair(ctx, it, R, K, E_LOC * R, quant_mode=2 if it == 3 else 0, skew="one_expert" if it == 4 else "",
                diagnose=it == 5)
shmemx.aclshmem_barrier_all()
disp, comb = _flag_areas(ctx, R, K, E_LOC * R)
assert not any(a.any() for a in disp + comb), f"pe {me}: a flag was left behind"
ctx.close()
print(f"pe {me}: cam across hosts ok", flush=True)
