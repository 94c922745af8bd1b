"""One path: a run observed by --check, --chaos, --trace or --record runs the code a plain run runs.

The default MoE Buffer's dispatch + combine on 8 PEs, with fixed inputs, posts the same WQEs and bytes, rings the
same doorbells, makes the same quiets, block syncs and CQE consumptions, on every PE, in every mode
(``scripts/one_path.py`` is the same comparison at DeepEP's shape, beside what each mode costs).
"""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import one_path  # noqa: E402  (scripts/one_path.py: the rank body and the counters compared)


def _counters(run_ok, tmp_path, **mode) -> dict:
    result = run_ok(8, one_path.body, 64, 256, 8, 64, 2, **mode)
    rows = [json.loads(line.split("] ", 1)[-1]) for line in result.out.splitlines() if "{" in line]
    return next(r["counters"] for r in rows if "counters" in r)


def test_counters_are_the_same_observed_or_not(run_ok, tmp_path, no_leak):
    plain = _counters(run_ok, tmp_path)
    assert all(v > 0 for v in plain["wqes_posted"]) and all(v > 0 for v in plain["quiets"]), plain
    for mode in (dict(check=True), dict(chaos=1), dict(trace=str(tmp_path / "t.json")),
                 dict(record=str(tmp_path / "r.rec"))):
        assert one_path.differences(plain, _counters(run_ok, tmp_path, **mode)) == "same", mode
