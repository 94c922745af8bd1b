"""``--check`` on RMARaceBench's SHMEM race classes: the tuning set gives every case its label, the hold-out set
meets the bars (precision .98, recall .94), and verdicts do not depend on the timing (``scripts/rma_corpus.py``
prints the table)."""

from __future__ import annotations

import os
import sys

import pytest

import rma_cases
import rma_holdout

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
import rma_corpus  # noqa: E402  (scripts/rma_corpus.py: one run of a case and its verdict)

JOB_TIMEOUT = 60


def _verdict(tmp_path, case) -> tuple[str, tuple, list[str]]:
    """(race / safe / error, the (kind, allocation) of its error findings, its ``shmemx check:`` lines)."""
    run = rma_corpus.run_case(case, str(tmp_path), JOB_TIMEOUT)
    if run.verdict == "error":
        return "error", (), [run.report()]
    lines = [line for line in run.err.splitlines() if line.startswith("shmemx check:")]
    assert (run.code == 3) == any(f["severity"] == "error" for f in run.found), run.report()
    return run.verdict, rma_corpus.signature(run.found), lines


@pytest.mark.parametrize("case", rma_cases.CASES, ids=[c.name for c in rma_cases.CASES])
def test_tuning_case_gets_its_label(case, tmp_path, no_leak):
    verdict, _, lines = _verdict(tmp_path, case)
    assert verdict == case.label, lines
    for line in lines:  # every finding in today's form: kind, both sides with file:line, why, fix
        if "warning:" not in line:
            assert " | why: " in line and " | fix: " in line and ".py:" in line, line


def test_holdout_meets_the_bars(tmp_path, no_leak):
    tp = fp = fn = 0
    wrong = []
    for case in rma_holdout.CASES:
        verdict, _, lines = _verdict(tmp_path, case)
        tp += verdict == "race" == case.label
        fp += verdict != "safe" and case.label == "safe"
        fn += verdict != "race" and case.label == "race"
        if verdict != case.label:
            wrong.append((case.name, verdict, lines[:2]))
    assert tp / max(tp + fp, 1) >= 0.98 and tp / max(tp + fn, 1) >= 0.94, wrong


def test_local_access_names_array_wqe_and_line(tmp_path, no_leak):
    """A get into a local array read before its quiet: the finding names the variable, the WQE (pe, qp, BB) and
    the line of the read."""
    import inspect

    case = next(c for c in rma_cases.CASES if c.name.startswith("conflict/004"))
    src, first = inspect.getsourcelines(rma_cases.conflict_004)
    read = first + next(i for i, line in enumerate(src) if "use(localbuf[0])" in line)
    verdict, sig, lines = _verdict(tmp_path, case)
    assert sig == (("get-before-quiet", ""),), lines
    line = lines[0]
    assert "local array 'localbuf'" in line and f"rma_cases.py:{read} reads" in line, line
    assert "READ to pe 1 qp 0 at BB 0" in line, line


# a race of each class whose verdict once depended on which access ran first: a get racing another PE's put, a
# get into a local array then a put from it, a local buffer of a nonblocking atomic, atomics of two widths
_TIMING = ("conflict/006", "conflict/018", "conflict/019", "conflict/037", "conflict/042", "conflict/043",
           "conflict/011", "atomic/007", "sync/013", "sync/014", "sync/018")


def _stable(tmp_path, case, runs: int) -> None:
    seen = {_verdict(tmp_path, case)[:2] for _ in range(runs)}
    assert len(seen) == 1, (case.name, seen)


@pytest.mark.parametrize("name", _TIMING)
def test_verdict_is_the_same_in_10_runs(name, tmp_path, no_leak):
    case = next(c for c in rma_cases.CASES + rma_holdout.CASES if c.name.startswith(name))
    _stable(tmp_path, case, 10)


@pytest.mark.slow
@pytest.mark.parametrize("case", rma_cases.CASES + rma_holdout.CASES,
                         ids=[c.name for c in rma_cases.CASES + rma_holdout.CASES])
def test_every_case_same_verdict_in_10_runs(case, tmp_path, no_leak):
    _stable(tmp_path, case, 10)
