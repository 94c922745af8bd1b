"""``--check``: every bug class of the corpus is reported with its kind and allocation, every twin is clean, and the
project's own kernels run clean (the heavier sweeps are in ``scripts/check_corpus.py``)."""

from __future__ import annotations

import glob
import json
import os

import pytest

from check_corpus import CASES


def _findings(run_job, tmp_path, n, body, **kw):
    result = run_job(n, body, check=True, dump_dir=str(tmp_path), **kw)
    found = []
    for path in glob.glob(os.path.join(tmp_path, "shmemx-check-*.jsonl")):
        with open(path) as f:
            found += [json.loads(line) for line in f]
        os.unlink(path)
    return result, found


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bug_is_reported(case, run_job, tmp_path, no_leak):
    result, found = _findings(run_job, tmp_path, case.n_pes, case.bug)
    hits = [f for f in found if f["kind"] == case.kind and f["severity"] == case.severity]
    assert hits, result.report() + f"\nfindings: {[f['kind'] for f in found]}"
    assert any((f["allocation"] or "") == case.allocation for f in hits), [f["text"] for f in hits]
    lines = [line for line in result.err.splitlines() if line.startswith("shmemx check:")]
    assert any(case.kind in line for line in lines), result.err
    if case.severity == "error":
        assert result.code == 3, result.report()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_twin_is_clean(case, run_job, tmp_path, no_leak):
    result, found = _findings(run_job, tmp_path, case.n_pes, case.twin)
    assert result.code == 0, result.report()
    assert not found, [f["text"] for f in found]
    assert "--check: no findings" in result.err, result.err
