"""Running a job: one OS process per PE, their output, their failures, and the job's shared memory.

``launch(n, target, ...)`` is what ``shmemx run`` does, as a function: it creates the job's control segment,
forks one process per PE (``multiprocess``'s fork context: the ranks inherit the imported numpy and shmemx, so 8
ranks start in tens of milliseconds instead of ~0.5 s with spawn, machine_limits.md 4), forwards their output
line by line with a ``[pe N]`` tag, and returns the job's exit status:

* 0 when every rank exits 0; otherwise the first failing rank's code (a ``SystemExit`` code as it is; 1 for an
  uncaught exception; 128 + n for a rank killed by signal n, reported by the signal's name);
* 124 when ``timeout`` passed (after printing what every PE waits on); 130 on Ctrl-C, 143 on SIGTERM.

Post-mortem: when the job times out or a rank fails (an uncaught exception such as a ``CompletionError`` from an
error CQE, a non-zero exit, a signal), the launcher first prints a short diagnosis (who waits on what, which
queues hold WQEs the engine has not executed, which are in error), then writes the full dump of every queue,
wait and allocation as JSON (``shmemx-dump-<job>.json`` in ``dump_dir``, ``$SHMEMX_DUMP_DIR`` or the current
directory; ``shmemx dump --file`` reads it), all before it stops the other ranks and removes the segments.
With ``trace=`` it merges the ranks' trace parts into one Chrome trace-event file, with ``stats=True`` it prints
every PE's counters (``counters.JobStats.table``), both after the ranks ended and before the segments go.

When one rank fails, the others are stopped (SIGTERM, then SIGKILL after 2 s) and the launcher says which rank
failed and why. The launcher owns the job's segments: whatever way the job ends, every ``shmemx_<job>_*`` file is
removed before ``launch`` returns; if the launcher itself dies first (kill -9), its reaper (``reaper``) removes
them once the ranks have ended. Ranks die with the launcher (PR_SET_PDEATHSIG) and ignore Ctrl-C, which the
launcher handles. A reader that goes away (``shmemx run ... | head -1``) costs only the rest of that stream's
output: the job runs on and is cleaned up as usual.
"""

from __future__ import annotations

import ctypes
import io
import os
import runpy
import secrets
import selectors
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Sequence

import multiprocess

from shmemx import runtime as rt_module
from shmemx.errors import PeerFailedError
from shmemx.observe.counters import JobStats
from shmemx.observe import dump as dumps
from shmemx.observe.reader import JobReader
from shmemx.observe import record
from shmemx.observe.trace import TRACE_DIR_ENV, TRACE_T0_ENV, merge_parts
from shmemx.api.engines import RANKS_PER_SERVER_ENV
from shmemx.shm.control import Control, JobState, PeStatus
from shmemx.shm.segment import describe_shm_space, remove_job_segments
from shmemx.udma.chaos import CHAOS_ENV
from shmemx.udma.check.analyze import analyze
from shmemx.udma.events import read_job_logs
from shmemx.udma.check.recorder import CHECK_ENV
from shmemx.udma.check.report import EXIT_FINDINGS

from . import deepep
from .options import RunOptions
from .reaper import Reaper

__all__ = ["launch", "Job", "RunOptions", "EXIT_TIMEOUT", "EXIT_INTERRUPTED", "EXIT_TERMINATED", "EXIT_FINDINGS"]

EXIT_TIMEOUT = 124
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143
_KILL_GRACE = 2.0  # seconds between SIGTERM and SIGKILL when stopping ranks
_WAIT_MARGIN = 2.0  # rank waits time out this long after the job timeout, so the launcher reports first
_PR_SET_PDEATHSIG = 1
_DIAGNOSIS_LINES = 40  # printed at most; the dump file has everything
_DUMP_LIMIT = 4096  # WQEs and CQEs per queue in a post-mortem dump


def launch(n: int, target: str | Callable, args: Sequence = (), options: RunOptions | None = None,
           **overrides) -> int:
    """Run ``target`` on ``n`` PEs and return the job's exit status.

    Args:
        n: number of PEs (processes).
        target: a script path, a module name (with ``module=True``) or a function (called as
            ``target(*args)`` in every rank; for fast tests, it is inherited by fork, never pickled).
        args: the script's / module's command-line arguments, or the function's arguments.
        options: how the job runs (``RunOptions``; default: every field's default).
        overrides: fields of ``options`` by name, replacing its values:
            module: ``target`` is a module name (``python -m``).
            heap_size: heap bytes per PE (int or "64M"); default 1 GiB (sparse).
            timeout: stop the job after this many seconds (exit 124) and report what every PE waits on.
            tag_output: prefix every output line with ``[pe N]``.
            env: extra environment variables for the ranks.
            stdout, stderr: text streams for the ranks' output and the launcher's messages (default sys's).
            trace: write a Chrome trace-event JSON of every WQE, wait, barrier and region to this path.
            record: write a recording of every post, quiet, wait, barrier, region and compute annotation to this
                path, for ``shmemx replay`` (virtual time on a modelled topology; ``observe.record``).
            stats: print every PE's counters when the job ends.
            dump_dir: where a post-mortem dump goes (default ``$SHMEMX_DUMP_DIR`` or the current directory).
            dump: write a post-mortem dump at all (the diagnosis is printed either way).
            check: run the protocol sanitizer (``shmemx run --check``): findings are printed as ``shmemx check:``
                lines and written as JSON lines beside the dump; exit status 3 when the job otherwise succeeded.
            chaos: a seed (int) for the seeded jitter of kernel threads (``--chaos SEED``), or "random" to pick
                one (printed).
            deepep: DeepEP mode (``--deepep``, ``launcher.deepep``): ``import deep_ep`` is shmemx's, CUDA is the
                CPU, ``torch.multiprocessing.spawn`` runs on the job's ranks, DeepEP's variables are set.
    """
    return Job(n, target, args, RunOptions.of(options, overrides, "launch")).run()


def _read_to_end(s) -> None:
    """Everything left in a rank's output pipe into ``s.partial``; the pipe closed."""
    try:
        while data := os.read(s.fd, 65536):
            s.partial += data
    except OSError:
        pass
    os.close(s.fd)
    s.fd = -1


class _Interrupted(Exception):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@dataclass
class _Stream:
    rank: int
    kind: str  # "out" or "err"
    fd: int
    partial: bytes = b""


@dataclass
class _Rank:
    rank: int
    proc: object
    exitcode: int | None = None
    streams: list = field(default_factory=list)


class Job:
    """One run of ``n`` ranks; see ``launch``."""

    def __init__(self, n: int, target: str | Callable, args: Sequence, options: RunOptions):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"number of PEs must be a positive integer, got {n!r}")
        if options.timeout is not None and options.timeout <= 0:
            raise ValueError(f"timeout must be positive, got {options.timeout!r}")
        self.n = n
        self.target = target
        self.args = list(args)
        self.module = options.module
        self.heap_size = options.heap_size
        self.timeout = options.timeout
        self.tag_output = options.tag_output
        self.env = dict(options.env or {})
        self.out = options.stdout or sys.stdout
        self.err = options.stderr or sys.stderr
        self.launcher_pid = os.getpid()
        self.job_id = f"{self.launcher_pid:x}{secrets.token_hex(3)}"
        self.ranks: list[_Rank] = []
        self.pes = range(n)  # the PEs this launcher starts: all of them, or its host's (launcher.hosts)
        self.host = None  # a job of several hosts: this host's part (launcher.hosts.HostPart), else None
        self.ctl: Control | None = None
        self.failure: tuple[int, int] | None = None  # (rank, exit status) of the first failure
        self.stopping_since: float | None = None
        self.interrupted: int | None = None  # the first SIGINT / SIGTERM the launcher received
        self._defer_signals = False  # inside a section that a signal must not cut short
        self.trace_path = os.path.abspath(options.trace) if options.trace else None
        self.trace_dir: str | None = None
        self.record_path = os.path.abspath(options.record) if options.record else None
        self.record_dir: str | None = None
        self.record_failed = False  # --record: the recording could not be written (the run then fails)
        self.t0 = time.perf_counter_ns()
        self.stats = options.stats
        self.dump_dir = options.dump_dir
        self.dump = options.dump
        self.dump_path: str | None = None  # the post-mortem dump written, if any
        self.reaper: Reaper | None = None
        self.check = options.check  # --check: the ranks log events, the launcher analyses them (udma.check)
        self.chaos = options.chaos  # --chaos SEED
        self.check_findings = None  # the analysis' Findings once the ranks ended
        self.check_failed = False  # the analysis itself raised: a clean job must not pass unchecked
        self.deepep = options.deepep  # --deepep: DeepEP's scripts unchanged (launcher.deepep)
        self.deepep_port: int | None = None  # its torch.distributed rendezvous port
        self._gone: set[int] = set()  # ids of output streams whose reader went away
        self._timed_out = False

    # --- the whole run -------------------------------------------------------------------------------------

    def run(self) -> int:
        code = self._run()
        if code == 0 and self.check_findings is not None and self.check_findings.errors:
            code = EXIT_FINDINGS
        if code == 0 and (self.record_failed or self.check_failed):
            code = 1
        return code

    def _run(self) -> int:
        if self.heap_size is not None:
            self.heap_size = rt_module.parse_size(self.heap_size)
        if self.chaos == "random":
            self.chaos = secrets.randbelow(1 << 32)
            self._message(f"chaos seed {self.chaos} (rerun it with --chaos {self.chaos})")
        elif self.chaos is not None:
            self.chaos = int(self.chaos)
        handlers = self._install_signal_handlers()
        self.reaper = Reaper(self.job_id)  # before anything is created that it may have to remove
        if self.trace_path:
            self.trace_dir = tempfile.mkdtemp(prefix=f"shmemx_{self.job_id}_trace_")
            self.reaper.trace_dir(self.trace_dir)
        if self.record_path:
            self.record_dir = tempfile.mkdtemp(prefix=f"shmemx_{self.job_id}_record_")
            self.reaper.trace_dir(self.record_dir)
        try:
            host = None if self.host is None else (self.host.hosts.n_hosts, self.host.hosts.index, self.pes.start,
                                                   len(self.pes))
            self.ctl = Control.create(self.job_id, self.n, heap_size=self.heap_size or 0,
                                      timeout=self.timeout or 0.0, script=self._target_name(), host=host)
            if self.deepep:
                self.deepep_port = deepep.free_port()  # one per job, chosen before the ranks fork
            self._start_ranks()
            if self.host is not None:
                self.host.started(self)  # the NIC, once the ranks are forked (no MPI state in a rank)
            self.ctl.header["state"] = JobState.RUNNING
            return self._supervise()
        except _Interrupted as exc:
            self._message(f"interrupted by {signal.Signals(exc.signum).name}; stopping {len(self.pes)} PEs")
            self._stop_all(grace=0.5)
            return EXIT_INTERRUPTED if exc.signum == signal.SIGINT else EXIT_TERMINATED
        finally:
            self._defer_signals = True  # a second Ctrl-C must not cut the cleanup short (leaked segments)
            try:
                self._reap_all()
                self._drain_all()
                if self.host is not None:
                    self.host.finished(self)
                self._finish_inspection()
                if self.ctl is not None:
                    self.ctl.close()
                remove_job_segments(self.job_id)
            finally:
                self.reaper.done()  # (had the cleanup failed half-way, the reaper would remove them instead)
                self._restore_signal_handlers(handlers)

    def _target_name(self) -> str:
        if callable(self.target):
            return getattr(self.target, "__qualname__", repr(self.target))
        return (f"-m {self.target}" if self.module else str(self.target)) + "".join(f" {a}" for a in self.args)

    # --- starting ranks ------------------------------------------------------------------------------------

    def _rank_env(self, rank: int) -> dict:
        env = {"SHMEMX_JOB": self.job_id, "SHMEMX_RANK": str(rank), "SHMEMX_SIZE": str(self.n)}
        if self.heap_size:
            env["SHMEMX_HEAP_SIZE"] = str(self.heap_size)
        if self.timeout:
            env["SHMEMX_TIMEOUT"] = str(self.timeout + _WAIT_MARGIN)
        if self.trace_dir:
            env[TRACE_DIR_ENV] = self.trace_dir
            env[TRACE_T0_ENV] = str(self.t0)
        if self.check:
            env[CHECK_ENV] = "1"
        if self.chaos is not None:
            env[CHAOS_ENV] = str(self.chaos)
        if self.record_dir:
            env[record.RECORD_DIR_ENV] = self.record_dir
        if self.host is not None:
            env.update(self.host.hosts.env())
            if len(set(self.host.hosts.counts)) == 1:  # a host is a server of the topology model
                env.setdefault(RANKS_PER_SERVER_ENV, str(self.host.hosts.counts[0]))
        if self.deepep:
            env.update(deepep.rank_env(rank, self.n, self.deepep_port))
        env.update({k: str(v) for k, v in self.env.items()})
        return env

    def _start_ranks(self) -> None:
        # A signal between a fork and the rank's registration would orphan that rank: hold it until all started.
        self._defer_signals = True
        try:
            self._fork_ranks()
        finally:
            self._defer_signals = False
        if self.interrupted is not None:
            raise _Interrupted(self.interrupted)

    def _fork_ranks(self) -> None:
        ctx = multiprocess.get_context("fork")
        parent_fds: list[int] = []
        for rank in self.pes:
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            proc = ctx.Process(target=_rank_main, name=f"shmemx-pe{rank}", daemon=False,
                               args=(rank, self, out_w, err_w, parent_fds + [out_r, err_r, self.reaper.fd]))
            proc.start()
            self.reaper.watch(proc.pid)
            os.close(out_w)
            os.close(err_w)
            parent_fds += [out_r, err_r]
            self.ranks.append(_Rank(rank, proc, streams=[_Stream(rank, "out", out_r), _Stream(rank, "err", err_r)]))

    # --- supervising ---------------------------------------------------------------------------------------

    def _supervise(self) -> int:
        sel = selectors.DefaultSelector()
        for r in self.ranks:
            for s in r.streams:
                sel.register(s.fd, selectors.EVENT_READ, s)
            sel.register(r.proc.sentinel, selectors.EVENT_READ, r)
        deadline = time.monotonic() + self.timeout if self.timeout else None
        timed_out = False
        while sel.get_map():
            wait = 0.25
            if deadline is not None and not timed_out:
                wait = max(0.0, min(wait, deadline - time.monotonic()))
            for key, _ in sel.select(wait):
                if isinstance(key.data, _Stream):
                    self._read(sel, key.data)
                else:
                    sel.unregister(key.fileobj)
                    self._exited(key.data)
            now = time.monotonic()
            if deadline is not None and not timed_out and now >= deadline and self._alive():
                timed_out = True
                self._report_timeout()
                self._stop_all(grace=0.0)
            if self.stopping_since is not None and now - self.stopping_since > _KILL_GRACE:
                self._kill_alive(signal.SIGKILL)
            if self.host is not None and self.failure is None and not timed_out:
                self._host_failure(self.host.failure())
        if timed_out:
            return EXIT_TIMEOUT
        if self.failure is not None:
            return _status(self.failure[1])
        return 0

    def _alive(self) -> list[_Rank]:
        return [r for r in self.ranks if r.exitcode is None]

    def _read(self, sel, stream: _Stream) -> None:
        try:
            data = os.read(stream.fd, 65536)
        except OSError:
            data = b""
        if not data:
            sel.unregister(stream.fd)
            os.close(stream.fd)
            stream.fd = -1
            if stream.partial:
                self._emit(stream, stream.partial + b"\n")
                stream.partial = b""
            return
        data = stream.partial + data
        cut = data.rfind(b"\n") + 1
        stream.partial = data[cut:]
        if cut:
            self._emit(stream, data[:cut])

    def _emit(self, stream: _Stream, data: bytes) -> None:
        text = data.decode(errors="replace")
        if self.tag_output:
            tag = f"[pe {stream.rank}] "
            text = "".join(tag + line for line in text.splitlines(keepends=True))
        self._write(self.out if stream.kind == "out" else self.err, text)

    def _write(self, dest, text: str) -> None:
        """Write to the launcher's stdout or stderr; once its reader has gone away (a closed pipe), drop the rest
        of that stream's output instead of dying with the job's segments left behind."""
        if id(dest) in self._gone:
            return
        try:
            dest.write(text)
            dest.flush()
        except (BrokenPipeError, ValueError):  # ValueError: the stream object itself was closed
            self._gone.add(id(dest))
            _silence(dest)

    def _exited(self, r: _Rank) -> None:
        r.proc.join()
        r.exitcode = r.proc.exitcode
        if r.exitcode == 0 or self.stopping_since is not None:
            return
        self.failure = (r.rank, r.exitcode)
        if r.exitcode < 0:
            why = f"was killed by signal {_signame(-r.exitcode)}"
            if -r.exitcode == signal.SIGBUS:  # the usual cause: a page of a (sparse) heap that tmpfs cannot back
                why += (f" ({describe_shm_space()}: a shared page could not be backed; run fewer PEs or "
                        f"a smaller --heap-size, or enlarge /dev/shm)")
        else:
            error = self.ctl.pes[r.rank]["error"].item().decode(errors="replace") if self.ctl else ""
            why = f"failed with exit code {r.exitcode}" + (f": {error}" if error else "")
        others = len(self._alive())
        self._message(f"pe {r.rank} {why}" + (f"; stopping the other {others} PEs" if others else ""))
        self._post_mortem(f"pe {r.rank} {why}", "what each PE was doing:")
        self.ctl.header["failed_pe"] = r.rank
        if self.host is not None:
            self.host.abort(f"pe {r.rank} {why}")
        self._stop_all(grace=_KILL_GRACE)

    def _host_failure(self, why: str | None) -> None:
        """Another host ended the job (it died, or one of its PEs failed): stop this host's PEs, saying why."""
        if why is None:
            return
        self.failure = (-1, 1)
        others = len(self._alive())
        self._message(why + (f"; stopping the {others} PEs of this host" if others else ""))
        if others:
            self._post_mortem(why, "what each PE of this host was doing:")
        self._stop_all(grace=0.5)

    @property
    def timed_out(self) -> bool:
        return self._timed_out

    def _report_timeout(self) -> None:
        self._timed_out = True
        if self.host is not None:
            self.host.abort(f"timed out after {self.timeout:g} s")
        self._post_mortem(f"timed out after {self.timeout:g} s",
                          f"job {self.job_id} timed out after {self.timeout:g} s; what each PE waits on:")

    def _post_mortem(self, reason: str, title: str) -> None:
        """Print the diagnosis, then write the dump (before any rank is stopped or segment removed)."""
        reader = JobReader(self.ctl)
        try:
            doc = dumps.snapshot(reader, limit=_DUMP_LIMIT, reason=reason)
        except Exception:  # a bug in the dump must not keep the launcher from stopping the job: say it, go on
            self._message(f"{title}\n(could not read the job for the diagnosis, a shmemx bug:\n"
                          f"{traceback.format_exc()})")
            return
        finally:
            reader.close()
        self._message(title)
        lines = doc["diagnosis"]
        for line in lines[:_DIAGNOSIS_LINES]:
            self._message("  " + line)
        if len(lines) > _DIAGNOSIS_LINES:
            self._message(f"  ... {len(lines) - _DIAGNOSIS_LINES} more lines in the dump")
        if not self.dump:
            return
        directory = self.dump_dir or os.environ.get("SHMEMX_DUMP_DIR") or os.getcwd()
        path = os.path.join(directory, f"shmemx-dump-{self.job_id}.json")
        try:
            dumps.save(doc, path)
        except OSError as exc:
            self._message(f"could not write the dump to {path}: {exc}")
            return
        self.dump_path = path
        relative = os.path.relpath(path)
        shown = path if relative.startswith("..") else os.path.join(".", relative)
        self._message(f"dump of every queue, wait and allocation: {shown} (read it with shmemx dump --file)")

    def _finish_inspection(self) -> None:
        """After the ranks ended: print the counters (--stats), merge the trace parts (--trace) and the recording
        parts (--record), analyse the event logs (--check). A host of a job of several hosts leaves that to the
        front command: its trace and recording parts are in the front's directories already, and it copies its
        PEs' event logs there (``launcher.hosts``)."""
        if self.ctl is None:
            return
        if self.host is not None:
            self.host.export(self)
            return
        if self.check:
            self._analyse()
        if self.stats:
            try:
                table = JobStats.read(self.job_id, self.n).table()
            except (OSError, ValueError) as exc:
                self._message(f"could not read the counters: {exc}")
            else:
                self._message(f"counters of job {self.job_id} ({self.n} PEs):")
                self._write(self.err, table + "\n")
        if self.trace_dir:
            try:
                meta = {"job": self.job_id, "n_pes": self.n, "script": self._target_name()}
                missing = merge_parts(self.trace_path, self.trace_dir, self.n, meta)
            except OSError as exc:
                self._message(f"could not write the trace to {self.trace_path}: {exc}")
            else:
                note = f" (no events from pe {', '.join(map(str, missing))}: stopped before finalize)" if missing \
                    else ""
                self._message(f"trace written to {self.trace_path}{note}; open it in Perfetto (ui.perfetto.dev)")
            finally:
                shutil.rmtree(self.trace_dir, ignore_errors=True)
                self.trace_dir = None
        if self.record_dir:
            self._finish_recording()

    def _finish_recording(self) -> None:
        try:
            meta = {"job": self.job_id, "script": self._target_name()}
            missing = record.merge_parts(self.record_path, self.record_dir, self.n, meta)
        except OSError as exc:
            self._message(f"could not write the recording to {self.record_path}: {exc}")
            self.record_failed = True
        else:
            note = f" (no events from pe {', '.join(map(str, missing))}: stopped before finalize; a replay " \
                   f"needs every PE)" if missing else ""
            self._message(f"recording written to {self.record_path}{note}; replay it with shmemx replay "
                          f"{os.path.relpath(self.record_path)} --topology ascend950")
        finally:
            shutil.rmtree(self.record_dir, ignore_errors=True)
            self.record_dir = None

    def _analyse(self) -> None:
        """--check: replay every PE's event log; print one ``shmemx check:`` line per finding, write them as JSON
        lines beside the dump (``shmemx-check-<job>.jsonl``)."""
        try:
            heap = int(self.ctl.pes[0]["heap_size"]) or self.heap_size or rt_module.DEFAULT_HEAP_SIZE
            logs, full = read_job_logs(self.job_id, self.n)
            findings = self.check_findings = analyze(logs, heap)
        except Exception:  # say why there is no analysis; a job that succeeded exits 1, never passes unchecked
            self._message(f"--check: the analysis failed (a shmemx bug):\n{traceback.format_exc()}")
            self.check_failed = True
            return
        for line in findings.lines():
            self._write(self.err, line + "\n")
        missing = sorted(set(range(self.n)) - {log.pe for log in logs})
        note = (f"; no log from pe {', '.join(map(str, missing))}" if missing else "") + \
            (f"; the log of pe {', '.join(map(str, full))} ran out of room (raise SHMEMX_EVENTS)" if full else "")
        errors, warnings = len(findings.errors), len(findings.warnings)
        if not errors and not warnings:
            self._message(f"--check: no findings ({sum(len(log.records) for log in logs)} events of {len(logs)} "
                          f"PEs){note}")
            return
        directory = self.dump_dir or os.environ.get("SHMEMX_DUMP_DIR") or os.getcwd()
        path = os.path.join(directory, f"shmemx-check-{self.job_id}.jsonl")
        try:
            findings.write_jsonl(path)
            where = f"; JSON lines in {path}"
        except OSError as exc:
            where = f"; could not write {path}: {exc}"
        self._message(f"--check: {errors} finding{'s' if errors != 1 else ''}, {warnings} warning"
                      f"{'s' if warnings != 1 else ''}{note}{where}")

    def _message(self, text: str) -> None:
        self._write(self.err, f"shmemx: {text}\n")

    # --- stopping ------------------------------------------------------------------------------------------

    def _stop_all(self, grace: float) -> None:
        if self.stopping_since is None:
            if self.ctl is not None:
                self.ctl.header["state"] = JobState.ABORTING
            self.stopping_since = time.monotonic() - (_KILL_GRACE - grace)
            self._kill_alive(signal.SIGTERM)

    def _kill_alive(self, sig: int) -> None:
        for r in self._alive():
            try:
                os.kill(r.proc.pid, sig)
            except ProcessLookupError:
                pass

    def _reap_all(self) -> None:
        """Make sure no rank outlives the launcher (used on every way out of ``run``)."""
        if self._alive():
            self._kill_alive(signal.SIGTERM)
            end = time.monotonic() + _KILL_GRACE
            for r in self._alive():
                r.proc.join(max(0.0, end - time.monotonic()))
            self._kill_alive(signal.SIGKILL)
        for r in self.ranks:
            r.proc.join()
            if r.exitcode is None:
                r.exitcode = r.proc.exitcode

    def _drain_all(self) -> None:
        """Read what the ranks' pipes still hold and emit every stream's last partial line."""
        for r in self.ranks:
            for s in r.streams:
                if s.fd >= 0:
                    _read_to_end(s)
                if s.partial:
                    self._emit(s, s.partial if s.partial.endswith(b"\n") else s.partial + b"\n")
                    s.partial = b""

    def _install_signal_handlers(self):
        if threading.current_thread() is not threading.main_thread():
            return None

        def handler(signum, frame):
            if self.interrupted is not None:
                return  # already stopping; the first signal decided the exit status
            self.interrupted = signum
            if not self._defer_signals:
                raise _Interrupted(signum)

        return {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}

    @staticmethod
    def _restore_signal_handlers(handlers) -> None:
        for sig, old in (handlers or {}).items():
            signal.signal(sig, old)


def _silence(stream) -> None:
    """Point a stream whose reader went away at /dev/null, so that flushing it again (at exit) is quiet."""
    try:
        fd = stream.fileno()
    except (OSError, ValueError, AttributeError):
        return  # not a file (a StringIO): dropping its output is enough
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def _status(exitcode: int) -> int:
    return 128 - exitcode if exitcode < 0 else exitcode


def _signame(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


# --- inside a rank -----------------------------------------------------------------------------------------


def _rank_main(rank: int, job: Job, out_w: int, err_w: int, inherited: list[int]) -> None:
    """The body of a rank process (after fork): set up, run the target, report, and exit."""
    launcher_pid = job.launcher_pid
    for fd in inherited:
        os.close(fd)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    os.close(out_w)
    os.close(err_w)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if job.host is not None:  # mpiexec tells its processes' groups of a failure by SIGUSR1: the launcher's to handle
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != launcher_pid:  # the launcher died before the death signal was set: nobody supervises us
        os._exit(1)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
    os.environ.update(job._rank_env(rank))
    ctl = Control.attach(job.job_id)
    ctl.pes[rank]["pid"] = os.getpid()
    ctl.pes[rank]["status"] = PeStatus.STARTED
    code = _run_target(rank, job, ctl)
    if ctl.pes[rank]["status"] != PeStatus.FAILED:
        ctl.pes[rank]["status"] = PeStatus.EXITED if code == 0 else PeStatus.FAILED
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _run_target(rank: int, job: Job, ctl: Control) -> int:
    try:
        if job.deepep:
            deepep.install()
        if callable(job.target):
            job.target(*job.args)
        elif job.module:
            sys.argv = [job.target, *map(str, job.args)]
            runpy.run_module(job.target, run_name="__main__", alter_sys=True)
        else:
            path = os.path.abspath(job.target)
            sys.argv = [job.target, *map(str, job.args)]
            sys.path.insert(0, os.path.dirname(path))
            runpy.run_path(path, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except PeerFailedError:  # the launcher is stopping the job and has said why: leave quietly
        rt_module.abandon()
        return 1
    except BaseException as exc:
        _print_user_traceback(exc)
        summary = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
        ctl.pes[rank]["error"] = summary.encode(errors="replace")[:511]
        ctl.pes[rank]["status"] = PeStatus.FAILED
        _release_frames(exc)
        rt_module.abandon()
        return 1
    try:
        if code == 0:
            rt_module.finalize()
        else:
            rt_module.abandon()
    except BaseException as exc:
        traceback.print_exc()
        ctl.pes[rank]["error"] = f"finalize: {type(exc).__name__}: {exc}".encode(errors="replace")[:511]
        rt_module.abandon()
        return 1
    return code


def _release_frames(exc: BaseException) -> None:
    """Drop the locals of the frames a failing rank's traceback holds (and of the exceptions chained to it),
    before the teardown closes the --check log: a heap view that a frame still held (the argument of the
    function that raised, after C code read it) dies now, so that the checker logs its read instead of taking it
    for a view that was kept."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def _print_user_traceback(exc: BaseException) -> None:
    """Print the traceback from the user's first frame on (not the launcher's and runpy's frames)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None and (
        tb.tb_frame.f_code.co_filename == __file__ or "runpy" in tb.tb_frame.f_code.co_filename
    ):
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb)


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1
