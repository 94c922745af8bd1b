"""Every example in scripts/examples/ at 2, 4 and 8 PEs, through the real ``shmemx run`` command in a subprocess.

Each example checks itself (it prints PASS or FAIL per PE and exits non-zero on a failure); the test requires
exit status 0 and one PASS line from every PE, so an example that silently skipped its check fails here too.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "scripts" / "examples"
N_PES = [2, 4, 8]


def _shmemx_command() -> list[str]:
    """The installed ``shmemx`` console script beside this Python (what users run), else ``python -m shmemx``."""
    script = Path(sys.executable).parent / "shmemx"
    if script.exists():
        return [str(script)]
    found = shutil.which("shmemx")
    return [found] if found else [sys.executable, "-m", "shmemx"]


def _run(n: int, script: str, *args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    """``shmemx run -n n script args`` in a scratch directory (a failing rank makes the launcher save a dump in
    the working directory)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHMEMX_")}
    cmd = [*_shmemx_command(), "run", "-n", str(n), "--timeout", "60", str(EXAMPLES / script), *args]
    with tempfile.TemporaryDirectory() as scratch:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=scratch)


def _check_passed(proc: subprocess.CompletedProcess, n: int, pass_line: str) -> None:
    report = f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    assert proc.returncode == 0, report
    passed = {int(m.group(1)) for m in re.finditer(rf"^\[pe (\d+)\] {pass_line}", proc.stdout, re.M)}
    assert passed == set(range(n)), report
    assert "FAIL" not in proc.stdout, report


@pytest.mark.parametrize("n", N_PES)
@pytest.mark.parametrize("script", ["udma_allgather.py", "udma_put_signal.py"])
def test_udma_allgather_examples(n, script):
    _check_passed(_run(n, script), n, r"PASS: pe \d+: all \d+ blocks hold 10 \+ block")


@pytest.mark.parametrize("n", N_PES)
@pytest.mark.parametrize("op", ["put", "get", "put_signal"])
def test_udma_qp_demo(n, op):
    proc = _run(n, "udma_qp_demo.py", "--op", op, "--qp-count", "4")
    suffix = r" signals=4/4" if op == "put_signal" else ""
    _check_passed(proc, n, rf"\[PASS\] op={op} pe=\d+ elements=1048576{suffix}$")


@pytest.mark.parametrize("qp_count, op", [(1, "put_signal"), (32, "get"), (3, "put")])
def test_udma_qp_demo_qp_counts(qp_count, op):
    elems = str(3 << 16) if qp_count == 3 else str(1 << 20)
    proc = _run(4, "udma_qp_demo.py", "--op", op, "--qp-count", str(qp_count), "--elems", elems)
    _check_passed(proc, 4, rf"\[PASS\] op={op} pe=\d+ elements={elems}")


def test_udma_qp_demo_rejects_bad_arguments():
    proc = _run(2, "udma_qp_demo.py", "--qp-count", "3")  # 1 MiB is not divisible by 3
    assert proc.returncode != 0 and "divisible by --qp-count 3" in proc.stderr, proc.stderr
    proc = _run(2, "udma_qp_demo.py", "--qp-count", "33")
    assert proc.returncode != 0 and "--qp-count 33 out of range 1..32" in proc.stderr, proc.stderr
    proc = _run(1, "udma_qp_demo.py")
    assert proc.returncode == 2 and "needs at least 2 PEs" in proc.stderr, proc.stderr


@pytest.mark.parametrize("n", N_PES)
def test_mte_allgather_example(n):
    dtype = {2: "int32", 4: "float16", 8: "bfloat16"}[n]
    proc = _run(n, "mte_allgather.py", "--dtype", dtype, "--len", "2048", "--blocks", "4", "--iters", "3")
    _check_passed(proc, n, rf"PASS: pe \d+: 3 iterations, {n} x 2048 {dtype} gathered, 4 blocks")


# --- CANN SHMEM's own examples, re-expressed (allgather, the sync/barrier demos, the team demos, double-plane MoE)


@pytest.mark.parametrize("n, extra", [(2, ()), (4, ("--dtype", "bfloat16", "--chunk", "700"))])
def test_cann_allgather_example(n, extra):
    dtype = "bfloat16" if extra else "int32"
    proc = _run(n, "allgather.py", "--len", "4096", "--blocks", "4", *extra)
    _check_passed(proc, n, rf"PASS: pe \d+: 2 iterations, {n} x 4096 {dtype} gathered, 2 producer and 2 consumer")


@pytest.mark.parametrize("mode", ["sync_all", "barrier_all", "sync_team", "barrier_team"])
def test_cann_sync_barrier_demo(mode):
    proc = _run(4, "sync_barrier_demo.py", "--mode", mode, "--kib", "64")
    _check_passed(proc, 4, rf"\[PASS\] {mode} (check success|not a member), pe=\d+")
    members = re.findall(rf"\[PASS\] {mode} check success, pe=(\d+)", proc.stdout)
    assert sorted(map(int, members)) == ([1, 3] if mode.endswith("team") else [0, 1, 2, 3]), proc.stdout


@pytest.mark.parametrize("n, x", [(4, 2), (8, 4)])
def test_cann_team_allgather_example(n, x):
    proc = _run(n, "team_allgather.py", "--x", str(x), "--len", "256")
    _check_passed(proc, n, rf"PASS: pe \d+: row \d+ \(team pe \d+ of {x}\), column team pe \d+ of {n // x}: all {n}")


def test_cann_double_plane_moe_example():
    proc = _run(4, "sdma_moe.py", "--tokens", "64", "--hidden", "256")
    _check_passed(proc, 4, r"PASS: pe \d+: 64 tokens dispatched to 8 experts and combined; \d+ segments over SDMA")
    assert re.search(r"; [1-9]\d* segments over SDMA", proc.stdout), proc.stdout  # the SDMA plane was used


@pytest.mark.parametrize("n", N_PES)
def test_ring_example(n):
    """The README's first kernel."""
    _check_passed(_run(n, "ring.py"), n, r"PASS: pe \d+ holds pe \d+'s row")


def test_replay_alltoall_example(tmp_path):
    """The README's replay example: the kernel checks its rows, the replay of its recording reads as shown."""
    rec = tmp_path / "a2a.rec"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHMEMX_")}
    run = [*_shmemx_command(), "run", "-n", "4", "--timeout", "60", "--record", str(rec),
           str(EXAMPLES / "replay_alltoall.py")]
    proc = subprocess.run(run, capture_output=True, text=True, timeout=90, env=env, cwd=tmp_path)
    _check_passed(proc, 4, r"PASS: pe \d+ holds every peer's row")
    replay = subprocess.run([*_shmemx_command(), "replay", str(rec)], capture_output=True, text=True, timeout=90,
                            env=env, cwd=tmp_path)
    assert replay.returncode == 0, replay.stderr
    assert "makespan 7.695 us (pe 1)" in replay.stdout and "bound by compute" in replay.stdout, replay.stdout


def test_counters_example():
    """The README's --stats example: every PE's counters as the README shows them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHMEMX_")}
    cmd = [*_shmemx_command(), "run", "-n", "3", "--timeout", "60", "--stats", str(EXAMPLES / "counters.py")]
    with tempfile.TemporaryDirectory() as scratch:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90, env=env, cwd=scratch)
    _check_passed(proc, 3, r"PASS: pe \d+ got 200 puts and a put_signal from each of 2 peers")
    rows = [line.split() for line in (proc.stdout + proc.stderr).splitlines() if re.match(r"^\s+[0-2]\s+402\s", line)]
    assert len(rows) == 3 and all(r[2] == r[4] == "11,000" and r[-1] == "400" for r in rows), proc.stderr
