"""The real ``shmemx run`` command (the console script and ``python -m shmemx``), run as a subprocess.

Covers what only the command line does: argv and ``__main__`` for scripts and modules, the script's folder on
sys.path, output tags, and the launcher stopped from outside with SIGTERM or Ctrl-C (SIGINT), after which no
segment of the job and no rank process may remain.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

SHMEMX_SCRIPT = Path(sys.executable).with_name("shmemx")
COMMANDS = {"shmemx": [str(SHMEMX_SCRIPT)], "python -m shmemx": [sys.executable, "-m", "shmemx"]}

SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import shmemx
    import helper_next_to_script  # found because the script's folder is on sys.path

    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    a = shmemx.full(8, me, np.int64, name="a")
    shmemx.aclshmem_barrier_all()
    peer = (me + 1) % n
    assert (shmemx.aclshmem_ptr(a, peer) == peer).all()
    heap = shmemx.runtime.runtime().heap.size
    print(f"pe {me} of {n} name {__name__} argv {sys.argv[1:]} helper {helper_next_to_script.VALUE} heap {heap}")
""")

MODULE = textwrap.dedent("""
    import sys
    import shmemx

    shmemx.init()
    shmemx.aclshmem_barrier_all()
    print(f"module pe {shmemx.my_pe()} of {shmemx.n_pes()} name {__name__} argv {sys.argv[1:]}")
    if len(sys.argv) > 1 and sys.argv[1] == "fail" and shmemx.my_pe() == shmemx.n_pes() - 1:
        sys.exit(3)
""")

READY = textwrap.dedent("""
    import os
    import numpy as np
    import shmemx

    shmemx.init()
    never = shmemx.zeros(1, np.int32, name="never")
    print("ready", os.getpid(), flush=True)
    shmemx.aclshmem_wait_until(never, shmemx.ACLSHMEM_CMP_EQ, 1)
""")


@pytest.fixture
def scripts(tmp_path: Path) -> Path:
    (tmp_path / "script.py").write_text(SCRIPT)
    (tmp_path / "helper_next_to_script.py").write_text("VALUE = 42\n")
    (tmp_path / "mod_for_shmemx.py").write_text(MODULE)
    (tmp_path / "ready.py").write_text(READY)
    return tmp_path


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHMEMX_")}
    env.update(extra)
    return env


def _run(command: str, args: list[str], cwd: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(COMMANDS[command] + args, cwd=cwd, env=_env(**env), capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("command", COMMANDS)
def test_run_script_with_args(scripts, command):
    proc = _run(command, ["run", "-n", "4", "--heap-size", "1M", "script.py", "a", "--b", "-n", "7"], scripts)
    assert proc.returncode == 0, proc.stderr
    argv = ["a", "--b", "-n", "7"]
    expect = [f"[pe {p}] pe {p} of 4 name __main__ argv {argv} helper 42 heap {1 << 20}" for p in range(4)]
    assert sorted(proc.stdout.splitlines()) == expect, proc.stdout
    assert proc.stderr == ""


def test_run_script_by_absolute_path_from_elsewhere(scripts, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("cwd")
    proc = _run("shmemx", ["run", "-n", "2", "--no-tag-output", str(scripts / "script.py")], elsewhere)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == [
        f"pe {p} of 2 name __main__ argv [] helper 42 heap {1 << 30}" for p in range(2)]  # the default heap: 1 GiB


@pytest.mark.parametrize("command", COMMANDS)
def test_run_module(scripts, command):
    proc = _run(command, ["run", "-n", "3", "--no-tag-output", "-m", "mod_for_shmemx", "x", "--y"], scripts.parent,
                PYTHONPATH=str(scripts))
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == [f"module pe {p} of 3 name __main__ argv ['x', '--y']"
                                                for p in range(3)]


def test_exit_status_and_failure_message(scripts):
    proc = _run("shmemx", ["run", "-n", "2", "-m", "mod_for_shmemx", "fail"], scripts, PYTHONPATH=str(scripts))
    assert proc.returncode == 3, proc.stderr
    assert "shmemx: pe 1 failed with exit code 3" in proc.stderr


def test_usage_errors(scripts):
    for args, text in ((["run", "-n", "2"], "give a script to run"), (["run", "-n", "2", "nope.py"], "not found"),
                       (["run", "-n", "0", "script.py"], "-n"), (["run", "script.py"], "-n")):
        proc = _run("shmemx", args, scripts)
        assert proc.returncode == 2 and text in proc.stderr, (args, proc.stderr)


def test_timeout_from_the_command_line(scripts):
    started = time.monotonic()
    proc = _run("shmemx", ["run", "-n", "2", "--timeout", "1", "ready.py"], scripts)
    assert proc.returncode == 124, proc.stderr
    assert time.monotonic() - started < 8
    for p in range(2):
        assert f"pe {p} waits in wait_until on 'never'+0x0 == 1, current value 0" in proc.stderr, proc.stderr


# --- the launcher stopped from outside ---------------------------------------------------------------------


def _alive(pid: int) -> bool:
    """True while ``pid`` is a live process (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _segments(pid: int) -> list[str]:
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith(f"shmemx_{pid:x}"))


@pytest.mark.parametrize("signals,code", [([signal.SIGTERM], 143), ([signal.SIGINT], 130),
                                          ([signal.SIGINT, signal.SIGINT], 130)],
                         ids=["SIGTERM", "SIGINT", "SIGINT twice"])
@pytest.mark.parametrize("command", COMMANDS)
def test_launcher_stopped_from_outside_leaves_nothing(scripts, command, signals, code):
    n = 4
    before = {name for name in os.listdir("/dev/shm") if name.startswith("shmemx_")}
    proc = subprocess.Popen(COMMANDS[command] + ["run", "-n", str(n), "ready.py"], cwd=scripts, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        rank_pids = []
        while len(rank_pids) < n:
            line = proc.stdout.readline()
            assert line, f"the job ended before every rank was ready: {proc.communicate(timeout=30)}"
            rank_pids.append(int(line.split()[-1]))  # "[pe 3] ready 12345"
        segments = _segments(proc.pid)
        job = segments[0].split("_")[1] if segments else "?"
        assert {f"shmemx_{job}_ctl", *(f"shmemx_{job}_heap{p}" for p in range(n))} <= set(segments), segments
        assert all(_alive(pid) for pid in rank_pids)
        for sig in signals:
            proc.send_signal(sig)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, err
    assert f"shmemx: interrupted by {signals[0].name}; stopping {n} PEs" in err
    assert "Traceback" not in err, err
    assert _segments(proc.pid) == []
    after = {name for name in os.listdir("/dev/shm") if name.startswith("shmemx_")}
    assert not {name for name in after - before if name.startswith(f"shmemx_{proc.pid:x}")}
    deadline = time.monotonic() + 5
    while any(map(_alive, rank_pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in rank_pids if _alive(pid)], "rank processes outlived the launcher"


def _start_ready_job(scripts: Path, n: int, command: str = "shmemx", **popen) -> tuple[subprocess.Popen, list[int]]:
    """``shmemx run -n N ready.py`` as a subprocess, returned once every rank said it is ready (with their pids)."""
    proc = subprocess.Popen(COMMANDS[command] + ["run", "-n", str(n), "ready.py"], cwd=scripts, env=_env(),
                            stdout=subprocess.PIPE, text=True, **popen)
    rank_pids = []
    while len(rank_pids) < n:
        line = proc.stdout.readline()
        assert line, f"the job ended before every rank was ready: {proc.communicate(timeout=30)}"
        rank_pids.append(int(line.split()[-1]))
    return proc, rank_pids


def _gone_within(pid: int, seconds: float) -> float | None:
    """Seconds until launcher ``pid``'s jobs had no segment left, or None if some were still there after ``seconds``."""
    start = time.monotonic()
    while _segments(pid):
        if time.monotonic() - start > seconds:
            return None
        time.sleep(0.02)
    return time.monotonic() - start


@pytest.mark.parametrize("command", COMMANDS)
def test_kill_9_of_the_launcher_leaves_no_segment(scripts, command):
    """The ranks die with the launcher; its reaper then removes the job's segments (bar: within 5 s)."""
    n = 4
    proc, rank_pids = _start_ready_job(scripts, n, command, stderr=subprocess.DEVNULL)
    try:
        assert len(_segments(proc.pid)) >= 1 + 3 * n, _segments(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        seconds = _gone_within(proc.pid, 5.0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert seconds is not None, f"segments left 5 s after kill -9 of the launcher: {_segments(proc.pid)}"
    deadline = time.monotonic() + 5
    while any(map(_alive, rank_pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in rank_pids if _alive(pid)], "rank processes outlived the launcher"


def test_a_killed_reaper_costs_only_the_safety_net(capfd):
    """A reaper killed before its job ends (e.g. by ``pkill -f`` of the launcher's command line, which the forked
    reaper shares): the launcher goes on, says once on stderr that the safety net is gone, and ``done`` is quiet."""
    from shmemx.launcher.reaper import Reaper

    reaper = Reaper("testkilledreaper")
    os.kill(reaper.pid, signal.SIGKILL)
    os.waitpid(reaper.pid, 0)
    reaper.watch(os.getpid())  # the pipe's reader is gone: no BrokenPipeError
    reaper.trace_dir("/nonexistent")
    reaper.done()
    err = capfd.readouterr().err
    assert err.count("reaper") == 1 and "is gone" in err, err


def test_a_reader_that_goes_away_costs_only_the_output(scripts):
    """``shmemx run ... | head -1``: the launcher's stdout pipe closes while ranks still print; the job runs to its
    end (here: every rank fails after printing), reports on stderr, and leaves no segment."""
    (scripts / "chatty.py").write_text(textwrap.dedent("""
        import shmemx
        shmemx.init()
        for i in range(3000):
            print("line", i, flush=True)
        shmemx.aclshmem_barrier_all()
        raise SystemExit(3 if shmemx.my_pe() == 1 else 0)
    """))
    proc = subprocess.Popen(COMMANDS["shmemx"] + ["run", "-n", "4", "chatty.py"], cwd=scripts, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("[pe ")
        proc.stdout.close()  # the reader goes away, as `| head -1` does
        err = proc.stderr.read()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 3, err
    assert "shmemx: pe 1 failed with exit code 3" in err, err
    assert "BrokenPipeError" not in err and "Exception ignored" not in err, err
    assert _segments(proc.pid) == []
