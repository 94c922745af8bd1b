"""``--check``: every bug class of the corpus is reported with its kind and allocation, every twin is clean, and the
project's own kernels run clean (the heavier sweeps are in ``scripts/check_corpus.py``)."""

from __future__ import annotations

import glob
import json
import os

import pytest

from check_corpus import CASES


def _findings(run_job, tmp_path, n, body, *args, **kw):
    result = run_job(n, body, *args, check=True, dump_dir=str(tmp_path), **kw)
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


# --- the project's kernels run clean (all of them, at 8 PEs: scripts/check_kernels.py) -------------------------

def _clean(result, found):
    assert result.code == 0, result.report()
    errors = [f["text"] for f in found if f["severity"] == "error"]
    assert not errors, "\n".join(errors)


def test_moe_kernels_are_clean(run_job, tmp_path, no_leak):
    """DeepEP-style dispatch + combine: the CI schedules, quantised rows, error paths, zero copy and cached."""
    from test_moe import CI_SCHEDULES, _moe_job, _zero_copy_job

    _clean(*_findings(run_job, tmp_path, 4, _moe_job, CI_SCHEDULES[4], ["random"], True, True, timeout=240))
    _clean(*_findings(run_job, tmp_path, 2, _zero_copy_job, timeout=240))


def test_cam_kernels_are_clean(run_job, tmp_path, no_leak):
    """CAM window mode: dispatch + combine pairs (bf16, fp16, a skewed routing), and the int8 path."""
    from test_cam import HEAP, _pairs, _quant_and_diagnose

    _clean(*_findings(run_job, tmp_path, 4, _pairs, 4, 2, 2, ["", "one_expert"], heap_size=HEAP, timeout=240))
    _clean(*_findings(run_job, tmp_path, 4, _quant_and_diagnose, 3, 2, heap_size="880M", timeout=240))


def test_flag_demo_is_found_and_its_fix_is_clean(tmp_path, python):
    """The README's worked example, through the real command: the finding line, exit 3; the fix: exit 0."""
    import subprocess

    demo = os.path.join(os.path.dirname(__file__), "..", "scripts", "examples", "flag_demo.py")
    env = dict(os.environ, SHMEMX_DUMP_DIR=str(tmp_path))
    bug = subprocess.run([python, "-m", "shmemx", "run", "-n", "2", "--check", demo], capture_output=True, text=True,
                         env=env, timeout=120)
    assert bug.returncode == 3, bug.stderr
    line = next(x for x in bug.stderr.splitlines() if x.startswith("shmemx check:"))
    assert "quiet-wrong-qp" in line and "'inbox'+0x0" in line and "flag_demo.py:26" in line and "qp 1" in line
    assert "aclshmemx_udma_qp_quiet(1, 1)" in line
    assert glob.glob(os.path.join(tmp_path, "shmemx-check-*.jsonl"))
    fixed = subprocess.run([python, "-m", "shmemx", "run", "-n", "2", "--check", demo, "--fixed"],
                           capture_output=True, text=True, env=env, timeout=120)
    assert fixed.returncode == 0 and "no findings" in fixed.stderr, fixed.stderr
