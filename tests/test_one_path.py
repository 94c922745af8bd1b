"""One path: a run observed by --check, --chaos, --trace or --record runs the code a plain run runs.

The default MoE Buffer's dispatch + combine on 8 PEs, with fixed inputs, posts the same WQEs and bytes, rings the
same doorbells, makes the same quiets, block syncs and CQE consumptions, on every PE, in every mode
(``scripts/one_path.py`` is the same comparison at DeepEP's shape, beside what each mode costs).
"""

from __future__ import annotations

import glob
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


# --- the default path's credit protocol, checked and stressed -------------------------------------------------

T, H, K, E, CALLS = 64, 256, 4, 32, 4


def _credits(early: bool) -> None:
    """A fresh dispatch, then cached ones (no notify: only the credits order one call's copy-out before the next
    call's rows land) of the default Buffer, every call's rows checked against the reference. ``early``: the bug,
    every source gets its credit before this PE copied its rows out of the workspace."""
    import numpy as np

    import shmemx
    from shmemx.kernels import moe
    from shmemx.kernels.moe import dispatch as D
    from shmemx.kernels.moe import reference as ref

    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    if early:
        copy, credit = D._copy_rows, D.give_credits

        def credit_first(a, lo, hi):
            credit(a, range(a.n_pes), a.stats.timer(0))
            copy(a, lo, hi)

        D._copy_rows = credit_first
        D.give_credits = lambda a, sources, timer: None

    def inputs(rank: int, call: int):
        rng = np.random.default_rng(rank)
        topk = np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int64)
        x = ref.origin_x(rank, T, H)
        x[:, 3] = call  # the call a row belongs to
        return x, topk, rng.random(topk.shape, np.float32)

    buf = moe.Buffer(T, H, K, E)
    handle, bad = None, []
    for call in range(CALLS):
        everyone = [inputs(r, call) for r in range(n)]
        x, topk, w = everyone[me]
        got = buf.dispatch(x, topk_idx=topk, topk_weights=w) if handle is None else buf.dispatch(x, handle=handle)
        handle = got.handle
        want = ref.reference_dispatch(*zip(*everyone), E, me)
        if not np.array_equal(np.asarray(got.recv_x).view(np.uint16), want.recv_x.view(np.uint16)):
            bad.append(call)
    assert not bad, f"pe {me}: dispatches {bad} received wrong rows"
    shmemx.finalize()


def _findings(run_job, tmp_path, n, body, *args):
    result = run_job(n, body, *args, check=True, dump_dir=str(tmp_path))
    found = []
    for path in glob.glob(os.path.join(tmp_path, "shmemx-check-*.jsonl")):
        with open(path) as f:
            found += [json.loads(line) for line in f]
        os.unlink(path)
    return result, found


def test_a_credit_before_the_copy_out_is_named_by_check(run_job, tmp_path, no_leak):
    result, found = _findings(run_job, tmp_path, 4, _credits, True)
    hits = [f for f in found if f["kind"] == "slot-reuse" and "dispatch.py" in f["text"]]
    assert hits, result.report() + f"\nfindings: {[f['kind'] for f in found]}"
    result, found = _findings(run_job, tmp_path, 4, _credits, False)
    assert result.code == 0 and not found, [f["text"] for f in found]


def test_chaos_makes_a_credit_before_the_copy_out_fail_within_four_seeds(run_job, no_leak):
    failed = []
    for seed in (1, 2, 3, 4):
        result = run_job(4, _credits, True, chaos=seed)
        if result.code != 0:
            assert "received wrong rows" in result.err, result.report()
            failed.append(seed)
            break
    assert failed, "no chaos seed of 1..4 made the early credit corrupt a dispatch"
    for seed in (1, 2):
        result = run_job(4, _credits, False, chaos=seed)
        assert result.code == 0, result.report()
