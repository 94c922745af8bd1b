"""The reaper: a small process that removes a job's shared memory when its launcher dies without doing it.

The launcher removes every ``shmemx_<job>_*`` segment whenever ``launch`` returns, however the job ended. What it
cannot survive is its own death: a ``kill -9``, an OOM kill, or a crash while it writes. Its ranks die with it
(``PR_SET_PDEATHSIG``), but their segments would stay in /dev/shm until ``shmemx clean --stale``. So before it
creates anything, the launcher forks a reaper that holds the read end of a pipe whose only write end the launcher
keeps. The launcher tells it the pid of every rank it starts and, once it has removed the segments itself, says
``done``; the reaper then exits. If instead the pipe reaches end-of-file (the kernel closed the write end because
the launcher died), the reaper waits until every rank has ended, removes the job's segments (and the trace parts
directory, if any), and exits.

Why a process that waits rather than unlinking the segments once every rank has mapped them: a running job stays
findable by name (``shmemx ps``, ``shmemx dump`` and the launcher's own post-mortem dump read the segments by name
while the job runs), and a launcher that dies is rare enough that one sleeping process per job, forked in about a
millisecond, is the cheaper way to cover it.

The reaper starts its own session (a Ctrl-C in the terminal is the launcher's to handle, not its), points its
standard streams at /dev/null (so it never holds a pipe of the launcher's open, e.g. ``shmemx run ... | head``)
and closes every other inherited descriptor.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import sys
import time

from shmemx.observe.jobs import pid_alive
from shmemx.shm.segment import remove_job_segments

__all__ = ["Reaper"]

_RANKS_GRACE = 30.0  # seconds the reaper waits for the ranks of a dead launcher to end before removing anyway
_POLL = 0.02
_PR_SET_NAME = 15


class Reaper:
    """The launcher's end of the reaper of job ``job_id`` (see the module docstring)."""

    def __init__(self, job_id: str):
        read_fd, self.fd = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the reaper
            try:
                _reap(job_id, read_fd, self.fd)
            finally:
                os._exit(0)
        os.close(read_fd)

    def watch(self, pid: int) -> None:
        """A rank started: the reaper waits for it to end before it removes anything."""
        self._say(f"pid {pid}")

    def trace_dir(self, path: str) -> None:
        """A directory of trace parts to remove along with the segments."""
        self._say(f"dir {path}")

    def done(self) -> None:
        """The launcher removed the segments itself: the reaper exits (waited for, so no zombie is left)."""
        if self.fd >= 0:
            self._say("done")
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
            try:
                os.waitpid(self.pid, 0)
            except ChildProcessError:
                pass

    def _say(self, line: str) -> None:
        if self.fd < 0:
            return
        try:
            os.write(self.fd, line.encode() + b"\n")
        except BrokenPipeError:  # the reaper was killed (e.g. by a pkill of the launcher's command line)
            os.close(self.fd)
            self.fd = -1
            if line != "done":
                print(f"shmemx: the job's reaper (pid {self.pid}) is gone; only the launcher itself will remove "
                      f"the job's segments now (`shmemx clean --stale` removes what a killed launcher leaves)",
                      file=sys.stderr)


def _reap(job_id: str, read_fd: int, write_fd: int) -> None:
    """The reaper's body: read the launcher's lines until ``done`` or end-of-file; on end-of-file clean up."""
    os.close(write_fd)
    _detach(read_fd)
    pids, dirs, buf = [], [], b""
    while True:
        data = os.read(read_fd, 4096)
        if not data:
            break  # the launcher is gone without saying done
        *lines, buf = (buf + data).split(b"\n")
        for line in lines:
            kind, _, value = line.decode().partition(" ")
            if kind == "done":
                return
            if kind == "pid":
                pids.append(int(value))
            elif kind == "dir":
                dirs.append(value)
    deadline = time.monotonic() + _RANKS_GRACE
    while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(_POLL)
    remove_job_segments(job_id)
    for path in dirs:
        shutil.rmtree(path, ignore_errors=True)


def _detach(keep_fd: int) -> None:
    """Leave the launcher's session and streams: own session, stdio on /dev/null, other descriptors closed."""
    os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
    os.closerange(3, keep_fd)
    os.closerange(keep_fd + 1, os.sysconf("SC_OPEN_MAX"))
    try:
        ctypes.CDLL(None).prctl(_PR_SET_NAME, b"shmemx-reaper", 0, 0, 0)
    except (OSError, AttributeError):
        pass
