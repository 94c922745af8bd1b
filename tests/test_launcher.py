"""The launcher: exit statuses, failure injection, --timeout reports, and no segment left behind, however a job ends.

Jobs run through ``launch`` (forked from pytest); ``test_cli.py`` drives the real ``shmemx run`` command.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time

import numpy as np
import pytest

import shmemx

EQ, GE = shmemx.ACLSHMEM_CMP_EQ, shmemx.ACLSHMEM_CMP_GE


def _hello():
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    a = shmemx.full(4, me, np.int32, name="a")
    shmemx.aclshmem_barrier_all()
    assert (shmemx.aclshmem_ptr(a, (me + 1) % n) == (me + 1) % n).all()
    print(f"hello from pe {me} of {n}")


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_normal_exit_tags_output(run_ok, no_leak, n):
    result = run_ok(n, _hello)
    assert sorted(result.out.splitlines()) == sorted(f"[pe {p}] hello from pe {p} of {n}" for p in range(n))
    assert result.err == ""


def test_untagged_output(run_ok):
    result = run_ok(2, _hello, tag_output=False)
    assert sorted(result.out.splitlines()) == ["hello from pe 0 of 2", "hello from pe 1 of 2"]


def test_launch_rejects_bad_arguments():
    from shmemx.launcher import launch

    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="number of PEs must be a positive integer"):
            launch(bad, _hello)
    with pytest.raises(ValueError, match="timeout must be positive"):
        launch(1, _hello, timeout=0)
    with pytest.raises(TypeError, match="launch\\(\\) got an unexpected keyword argument 'heapsize'"):
        launch(1, _hello, heapsize="64M")
    with pytest.raises(TypeError, match="options must be a RunOptions"):
        launch(1, _hello, (), {"timeout": 5})


def test_run_options_object_and_overrides(run_ok):
    """``launch(n, f, args, RunOptions(...))`` runs with those options; a keyword overrides its field only."""
    from shmemx.launcher import RunOptions

    options = RunOptions(tag_output=False, heap_size="64M")
    result = run_ok(2, _hello, options=options)
    assert sorted(result.out.splitlines()) == ["hello from pe 0 of 2", "hello from pe 1 of 2"]
    result = run_ok(2, _hello, options=options, tag_output=True)
    assert sorted(result.out.splitlines()) == ["[pe 0] hello from pe 0 of 2", "[pe 1] hello from pe 1 of 2"]
    assert options.tag_output is False  # frozen: an override makes a new record


# --- failure injection -------------------------------------------------------------------------------------


def _fail_on(rank: int, how: str, where: str):
    """PE ``rank`` fails (``how``) while every other PE blocks (``where``): in a barrier or a wait."""
    if where == "before init" and int(os.environ["SHMEMX_RANK"]) == rank:
        _die(rank, how)
    shmemx.init()
    me = shmemx.my_pe()
    flag = shmemx.zeros(1, np.int64, name="flag")
    if me == rank:
        _die(rank, how)
    if where == "wait":
        shmemx.aclshmem_wait_until(flag, EQ, 1)  # nobody ever sets it
    shmemx.aclshmem_barrier_all()


def _die(rank: int, how: str):
    if how == "raise":
        raise RuntimeError(f"rank {rank} fails on purpose")
    if how == "exit":
        sys.exit(3)
    if how == "exit message":
        sys.exit(f"pe {rank} gives up")
    os.kill(os.getpid(), signal.SIGKILL)


EXPECT = {  # how -> (exit status, what the launcher says)
    "raise": (1, "pe {r} failed with exit code 1: RuntimeError: rank {r} fails on purpose"),
    "exit": (3, "pe {r} failed with exit code 3"),
    "exit message": (1, "pe {r} failed with exit code 1"),
    "sigkill": (137, "pe {r} was killed by signal SIGKILL"),
}


def _check_failure(result, n: int, rank: int, how: str) -> None:
    code, message = EXPECT[how]
    message = "shmemx: " + message.format(r=rank)
    assert result.code == code, result.report()
    assert result.seconds < 10, result.report()
    stopping = f"; stopping the other {n - 1} PEs" if n > 1 else ""
    lines = [line for line in result.err.splitlines() if line.startswith("shmemx: ")]
    assert lines[0] in (message + stopping, message), result.report()
    # one report: the first failure (then the post-mortem: "what each PE was doing:", indented lines, the dump)
    assert not any("failed with" in line or "was killed" in line for line in lines[1:]
                   if not line.startswith("shmemx:   ")), result.report()
    if how == "raise":  # the failing rank's traceback, tagged, from the user's frame on
        assert f"[pe {rank}] Traceback (most recent call last):" in result.err
        assert f"[pe {rank}] RuntimeError: rank {rank} fails on purpose" in result.err
        assert "runpy" not in result.err and "_rank_main" not in result.err
    if how == "exit message":
        assert f"[pe {rank}] pe {rank} gives up" in result.err
    others = [p for p in range(n) if p != rank]
    assert not any(f"[pe {p}] Traceback" in result.err for p in others), result.report()


@pytest.mark.parametrize("rank", range(4))
def test_each_rank_in_turn_raises(run_job, no_leak, rank):
    _check_failure(run_job(4, _fail_on, rank, "raise", "barrier"), 4, rank, "raise")


@pytest.mark.parametrize("how", ["raise", "exit", "exit message", "sigkill"])
@pytest.mark.parametrize("n", [1, 2, 8])
def test_failures_stop_the_job(run_job, no_leak, n, how):
    for rank in sorted({0, n - 1}):
        where = ("barrier", "wait", "before init")[rank % 3]
        _check_failure(run_job(n, _fail_on, rank, how, where), n, rank, how)


def _finalize_raises():
    shmemx.init()
    if shmemx.my_pe() == 0:
        shmemx.finalize()
        shmemx.aclshmem_barrier_all()  # ClosedError: used after finalize


def test_error_after_finalize(run_job, no_leak):
    result = run_job(2, _finalize_raises)
    assert result.code == 1
    assert "shmemx: pe 0 failed with exit code 1: ClosedError: pe 0: shmemx was finalized" in result.err


# --- --timeout ---------------------------------------------------------------------------------------------


def _one_pe_waits_forever():
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    flags = shmemx.zeros(4, np.int64, name="flags")
    flags[1] = 100 + me
    shmemx.aclshmem_barrier_all()
    if me == n - 1:
        shmemx.aclshmem_wait_until(flags[1:], GE, 1000 + me)
    shmemx.aclshmem_barrier_all()


@pytest.mark.parametrize("n,timeout", [(8, 5.0), (2, 1.0)])
def test_timeout_reports_what_every_pe_waits_on(run_job, no_leak, n, timeout):
    result = run_job(n, _one_pe_waits_forever, timeout=timeout)
    assert result.code == 124, result.report()
    assert timeout <= result.seconds < timeout + 5, result.report()
    err = result.err
    assert f"timed out after {timeout:g} s; what each PE waits on:" in err, err
    last = n - 1
    assert re.search(f"^shmemx:   pe {last} waits in wait_until on 'flags'\\+0x8 >= {1000 + last}, "
                     f"current value {100 + last} \\(for [0-9.]+ s\\)$", err, re.M), err
    for p in range(n - 1):
        assert re.search(f"^shmemx:   pe {p} waits in barrier_all \\(barrier #[0-9]+\\) for [0-9.]+ s; "
                         f"not arrived: pe {last}$", err, re.M), err
    assert "Traceback" not in err, err  # the stopped ranks leave quietly


# --- 128 ranks ---------------------------------------------------------------------------------------------


def _big_job():
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    a = shmemx.full(64, me, np.int32, name="a")
    shmemx.aclshmem_barrier_all()
    for p in ((me + 1) % n, (me + n // 2) % n, n - 1 - me):
        assert (shmemx.aclshmem_ptr(a, p) == p).all()
    count = shmemx.zeros(1, np.int64, name="count")
    shmemx.aclshmemx_signal_op(count, me + 1, shmemx.ACLSHMEM_SIGNAL_ADD, 0)
    shmemx.aclshmem_barrier_all()
    if me == 0:
        assert count[0] == n * (n + 1) // 2
    shmemx.aclshmem_free(count)
    shmemx.aclshmem_free(a)


def test_128_ranks(run_ok, no_leak):
    result = run_ok(128, _big_job, heap_size="1M", timeout=120)
    assert result.seconds < 60, result.report()
