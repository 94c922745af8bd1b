"""Shared fixtures of the test suite: running jobs through ``launch`` and watching /dev/shm for leaks.

Rank bodies are plain module-level functions of the test files: ``launch`` forks the ranks from the pytest
process, so a body is inherited, never pickled, and a failing ``assert`` in any rank makes the job exit 1 with
the rank's traceback in the captured stderr (which the fixtures put into the test's failure message).
"""

from __future__ import annotations

import io
import os
import sys
import time
from dataclasses import dataclass

import pytest

from shmemx.launcher import launch

SHM_DIR = "/dev/shm"
JOB_TIMEOUT = 30.0  # every launch has a deadline, so nothing hangs


@dataclass
class JobResult:
    """What one ``launch`` returned and printed."""

    code: int
    out: str
    err: str
    seconds: float

    def report(self) -> str:
        return f"exit {self.code} after {self.seconds:.2f} s\n--- stdout ---\n{self.out}\n--- stderr ---\n{self.err}"


def shm_entries(prefix: str = "shmemx_") -> set[str]:
    """Names in /dev/shm that start with ``prefix``."""
    return {name for name in os.listdir(SHM_DIR) if name.startswith(prefix)}


def job_prefix(pid: int) -> str:
    """Segment-name prefix of the jobs a launcher process with this pid creates (job ids start with its pid)."""
    return f"shmemx_{pid:x}"


def _run_job(n: int, target, *args, timeout: float = JOB_TIMEOUT, **kwargs) -> JobResult:
    """``launch(n, target, args)`` with the ranks' output and the launcher's messages captured."""
    out, err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    code = launch(n, target, args, timeout=timeout, stdout=out, stderr=err, **kwargs)
    return JobResult(code, out.getvalue(), err.getvalue(), time.monotonic() - start)


def _run_ok(n: int, target, *args, **kwargs) -> JobResult:
    """Run a job that must succeed on every rank; fail the test with everything it printed otherwise."""
    result = _run_job(n, target, *args, **kwargs)
    assert result.code == 0, result.report()
    return result


@pytest.fixture(scope="session", autouse=True)
def _dumps_in_tmp(tmp_path_factory):
    """Post-mortem dumps of failing jobs (``shmemx-dump-<job>.json``) go to a temporary folder, not the checkout."""
    old = os.environ.get("SHMEMX_DUMP_DIR")
    os.environ["SHMEMX_DUMP_DIR"] = str(tmp_path_factory.mktemp("dumps"))
    yield
    if old is None:
        os.environ.pop("SHMEMX_DUMP_DIR", None)
    else:
        os.environ["SHMEMX_DUMP_DIR"] = old


@pytest.fixture
def no_leak():
    """Fail the test if a job started by this pytest process leaves a segment in /dev/shm.

    Only segments of this process's jobs count (their names start with ``shmemx_<pid>``), so that jobs of
    other processes running at the same time cannot make the check flaky.
    """
    prefix = job_prefix(os.getpid())
    before = shm_entries(prefix)
    yield
    leaked = shm_entries(prefix) - before
    assert not leaked, f"segments left in {SHM_DIR}: {sorted(leaked)}"


@pytest.fixture(scope="session")
def run_job():
    """``run_job(n, fn, *args, timeout=30, **launch_kwargs) -> JobResult`` (code, out, err, seconds)."""
    return _run_job


@pytest.fixture(scope="session")
def run_ok():
    """Like ``run_job``, and asserts that the job exited 0 (the failure message shows all its output)."""
    return _run_ok


@pytest.fixture(scope="session")
def python() -> str:
    return sys.executable
