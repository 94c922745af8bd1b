"""A job over several hosts: one launcher per host, started by MPI, joined by the hosts' NICs.

``shmemx run -n N --hosts H`` runs H emulated hosts on this machine; ``--hosts host1:8,host2:8`` (or
``--hostfile FILE``, one ``host[:pes]`` a line) runs on those hosts. Either way the front command starts
``mpiexec`` (MPICH's hydra, from the ``mpich`` wheel of ``shmemx[mpi]``) with one process per host, each running
``python -m shmemx.launcher.hosts`` (``host_main``), which forks the host's launcher and stays its parent, the
host's agent (``_become_launcher``). The launcher is the single-host launcher
(``job.Job``) over the host's PEs (``job.pes``) with its own segments (job id ``<job>.h<k>``, ``shm.hosts``), plus
this host's part (``HostPart``): once the ranks are forked it initialises MPI (never in a rank: the ranks are
plain shmemx processes) and starts the host's NIC (``udma.nic``), which carries every WQE to another host's PE
and the barriers between hosts. On emulated hosts MPI is told to use its network path (``MPIR_CVAR_NOLOCAL``):
no memory is shared between hosts, MPICH's own included.

Ending: a host whose PE fails tells the others (``Nic.abort``); a host that goes silent (its launcher was killed:
its agent tells the front, which names it) is declared dead by every other host after ``nic.DEAD_AFTER`` seconds,
or ``nic.NOTICED_DEAD_AFTER`` once mpiexec has said that a process of the job ended; either way every host's
launcher stops its PEs, saying which host ended the job, and removes its segments (its reaper does when the
launcher itself was killed). The launchers end the same way when the front command dies (``_watch_front``).
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import re
import tempfile
import time
import signal
import socket
import subprocess
import sys
import threading
from typing import Sequence

from shmemx.shm.hosts import HostMap, host_job_id
from shmemx.shm.segment import SHM_DIR, segment_name

from .options import RunOptions

__all__ = ["HostPart", "run_hosts", "parse_hosts", "host_main", "mpi_versions"]

HELLO = "\x1eshmemx-host"  # a host launcher's first line to the front: host, pid, node (not shown)
GONE = "\x1eshmemx-gone"  # a host agent's line to the front: its launcher died of a signal (host, pid, node, signal)
_NOLOCAL = {"MPIR_CVAR_NOLOCAL": "1", "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}


def parse_hosts(spec: str | None, hostfile: str | None, n: int) -> tuple[HostMap, list[str] | None]:
    """(host map, host names or None for emulated hosts) of ``--hosts`` / ``--hostfile``."""
    entries = []
    if hostfile:
        with open(hostfile) as f:
            entries = [line.split("#")[0].strip() for line in f]
        entries = [e for e in entries if e]
    elif spec and not spec.isdigit():
        entries = [e.strip() for e in spec.split(",") if e.strip()]
    if not entries:
        return HostMap.even(n, int(spec or 1)), None
    names, counts = [], []
    for e in entries:
        name, _, pes = e.partition(":")
        names.append(name)
        counts.append(int(pes) if pes else None)
    if any(c is None for c in counts):
        if len(set(counts)) != 1:
            raise ValueError(f"hosts {entries}: give PEs for every host or for none")
        return HostMap.even(n, len(names)), names
    hosts = HostMap(counts)
    if hosts.n_pes != n:
        raise ValueError(f"hosts {entries} hold {hosts.n_pes} PEs, -n asks for {n}")
    return hosts, names


def _mpiexec() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = here if os.path.exists(here) else shutil.which("mpiexec")
    if not found:
        raise RuntimeError("shmemx run --hosts needs MPI: pip install 'shmemx[mpi]' (mpi4py and the mpich wheel)")
    return found


def run_hosts(n: int, hosts: HostMap, names: list[str] | None, target: str, args: Sequence = (),
              options: RunOptions | None = None, *, job_id: str | None = None, **overrides) -> int:
    """Run ``target`` on ``n`` PEs over ``hosts``; the job's exit status (the worst host's). ``options`` and
    ``overrides`` are ``launch``'s (``RunOptions``); ``deepep`` is refused (ValueError). ``stats``: one table of
    every PE's counters, whatever host it is on, after the job."""
    import secrets

    o = RunOptions.of(options, overrides, "run_hosts")
    if o.deepep:
        raise ValueError("--deepep runs on one host: DeepEP's torch.distributed rendezvous over several hosts is not "
                         "mapped (drop --hosts; test_internode.py runs as 2 nodes x 8 ranks on one host)")
    job = job_id or f"{os.getpid():x}{secrets.token_hex(3)}"
    trace, record = (os.path.abspath(p) if p else None for p in (o.trace, o.record))
    # without -disable-auto-cleanup hydra would SIGKILL every process of the job once a host launcher exits with
    # an error; the NICs find a dead host themselves and every launcher stops its PEs, names the host and cleans up
    cmd = [_mpiexec(), "-disable-auto-cleanup", "-n", str(hosts.n_hosts)]
    if names:
        cmd += ["-hosts", ",".join(names), "-ppn", "1"]
    cmd += [sys.executable, "-m", "shmemx.launcher.hosts", "--job", job, "--counts",
            ",".join(map(str, hosts.counts)), "--front", f"{socket.gethostname()}:{os.getpid()}"]
    cmd += _host_flags(o)
    parts = None
    if trace or record or o.check or o.stats:  # the hosts' trace / recording parts, event logs and counters meet
        # here (a shared directory)
        parts = tempfile.mkdtemp(prefix=f"shmemx_{job}_parts_", dir=os.environ.get("SHMEMX_PARTS_DIR"))
        cmd += ["--parts", parts, "--t0", str(time.perf_counter_ns())]
        cmd += ["--trace"] if trace else []
        cmd += ["--record"] if record else []
    cmd += ["--", target, *map(str, args)]
    full_env = dict(os.environ)
    if names is None:
        full_env.update(_NOLOCAL)
    full_env.update({k: str(v) for k, v in (o.env or {}).items()})
    front = _Front(hosts, o.stdout or sys.stdout, o.stderr or sys.stderr)
    try:
        proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=_die_with_parent)
        code = front.follow(proc)
        code = 128 - code if code < 0 else code
        if parts is not None:
            code = _gather(parts, n, job, target, o, code)
    finally:
        if parts is not None:
            shutil.rmtree(parts, ignore_errors=True)
    return code


def _host_flags(o: RunOptions) -> list[str]:
    """The host launchers' flags (``host_main``) for the options they apply on each host."""
    import secrets

    flags = ["--heap-size", str(o.heap_size)] if o.heap_size else []
    flags += ["--timeout", str(o.timeout)] if o.timeout else []
    flags += [] if o.tag_output else ["--no-tag-output"]
    flags += ["--dump-dir", o.dump_dir] if o.dump_dir else []
    flags += [] if o.dump else ["--no-dump"]
    flags += ["--check"] if o.check else []
    flags += ["--stats"] if o.stats else []
    chaos = o.chaos
    if chaos == "random":  # one seed for every host (each host's launcher would draw its own)
        chaos = secrets.randbelow(1 << 32)
        _say(f"chaos seed {chaos} (rerun it with --chaos {chaos})")
    flags += ["--chaos", str(chaos)] if chaos is not None else []
    flags += ["-m"] if o.module else []
    return flags


def _die_with_parent() -> None:
    """SIGTERM when the parent dies: mpiexec when the front command dies, a host agent when mpiexec's proxy does,
    a host launcher when its agent does (each passes it on; the launcher stops its PEs and cleans up)."""
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _say(text: str) -> None:
    sys.stderr.write(f"shmemx: {text}\n")
    sys.stderr.flush()


def _gather(parts: str, n: int, job: str, target: str, o: RunOptions, code: int) -> int:
    """After every host ended: one trace, one recording, one --check analysis of every host's event logs, one
    table of every host's counters (--stats)."""
    from shmemx.observe import record as recording
    from shmemx.observe.trace import merge_parts

    trace, record = (os.path.abspath(p) if p else None for p in (o.trace, o.record))
    if o.stats:
        _stats(os.path.join(parts, "stats"), n, job)
    meta = {"job": job, "n_pes": n, "script": target, "hosts": True}
    if trace:
        missing = merge_parts(trace, os.path.join(parts, "trace"), n, meta)
        note = f" (no events from pe {', '.join(map(str, missing))})" if missing else ""
        _say(f"trace of every host written to {trace}{note}; open it in Perfetto (ui.perfetto.dev)")
    if record:
        missing = recording.merge_parts(record, os.path.join(parts, "record"), n, meta)
        note = f" (no events from pe {', '.join(map(str, missing))}; a replay needs every PE)" if missing else ""
        _say(f"recording of every host written to {record}{note}; replay it with shmemx replay "
             f"{os.path.relpath(record)} --topology ascend950")
        if missing and code == 0:
            code = 1
    if o.check:
        code = _check(os.path.join(parts, "events"), n, o.heap_size, code)
    return code


def _stats(directory: str, n: int, job: str) -> None:
    """--stats over hosts: every host's counters (``JobStats.save``) in one table, as within one host."""
    from shmemx.observe.counters import JobStats

    paths = sorted(glob.glob(os.path.join(directory, "host*.npz")))
    stats = JobStats.merge(paths, n)
    _say(f"counters of job {job} ({n} PEs over {len(paths)} hosts):")
    sys.stderr.write(stats.table() + "\n")
    sys.stderr.flush()


def _check(directory: str, n: int, heap_size, code: int) -> int:
    """--check over hosts: the happens-before analysis of every host's event logs, brought to the front."""
    from shmemx.runtime import DEFAULT_HEAP_SIZE, parse_size
    from shmemx.udma.check.analyze import analyze
    from shmemx.udma.check.report import EXIT_FINDINGS
    from shmemx.udma.events import read_segment

    logs = [read_segment(os.path.join(directory, f"events{pe}")) for pe in range(n)
            if os.path.exists(os.path.join(directory, f"events{pe}"))]
    findings = analyze(logs, parse_size(heap_size) if heap_size else DEFAULT_HEAP_SIZE)
    for line in findings.lines():
        sys.stderr.write(line + "\n")
    missing = sorted(set(range(n)) - {log.pe for log in logs})
    note = f"; no log from pe {', '.join(map(str, missing))}" if missing else ""
    if not findings.errors and not findings.warnings:
        _say(f"--check: no findings across the hosts ({sum(len(log.records) for log in logs)} events of "
             f"{len(logs)} PEs){note}")
        return code
    _say(f"--check: {len(findings.errors)} findings, {len(findings.warnings)} warnings across the hosts{note}")
    return EXIT_FINDINGS if code == 0 and findings.errors else code


class _Front:
    """The front command's view of the host launchers: forwards their output, keeps their announcements (a line
    ``HELLO host pid node`` each, not shown), and turns a host agent's ``GONE`` line (its launcher died of a
    signal) into the message that names the host."""

    def __init__(self, hosts: HostMap, out, err):
        self.hosts, self.out, self.err = hosts, out, err
        self.launchers: dict[int, tuple[int, str]] = {}  # pid -> (host, node)
        self.gone: list[tuple[int, int, str, int]] = []  # (host, launcher pid, node, signal) of dead launchers

    def follow(self, proc) -> int:
        threads = [threading.Thread(target=self._pump, args=(proc.stdout, self.out), daemon=True),
                   threading.Thread(target=self._pump, args=(proc.stderr, self.err), daemon=True)]
        for t in threads:
            t.start()
        try:
            code = proc.wait()
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGINT)
            code = proc.wait()
        for t in threads:
            t.join()
        return code

    def _pump(self, stream, dest) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace")
            while line.startswith((HELLO, GONE)):  # (another host's line or a rank's output may follow on its line)
                line = self._announcement(line)
            if not line:
                continue
            try:
                dest.write(line)
                dest.flush()
            except (BrokenPipeError, ValueError):
                pass

    def _announcement(self, line: str) -> str:
        """Take the HELLO or GONE at the start of ``line``; the rest of the line."""
        if line.startswith(HELLO):
            _, host, pid, node, *rest = line.split(None, 4)
            self.launchers[int(pid)] = (int(host), node)
            return rest[0] if rest else ""
        _, host, pid, node, sig, *rest = line.split(None, 5)
        self.gone.append((int(host), int(pid), node, int(sig)))
        pes = self.hosts.pes(int(host))
        try:
            self.err.write(f"shmemx: host {host} (pes {pes.start}..{pes.stop - 1}, node {node}, launcher pid {pid}) "
                           f"died (killed by {_signame(int(sig))}); its PEs end with it and its reaper removes its "
                           f"segments; the other hosts end the job when they find it silent\n")
            self.err.flush()
        except (BrokenPipeError, ValueError):
            pass
        return rest[0] if rest else ""


def _signame(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class HostPart:
    """This host's part of a job of several hosts, as its launcher (``job.Job.host``) sees it."""

    def __init__(self, hosts: HostMap, parts: str | None = None):
        self.hosts = hosts
        self.parts = parts  # the front's directory of trace / recording parts and event logs, if any
        self.nic = None

    def started(self, job) -> None:
        """The ranks are forked: initialise MPI, start the NIC."""
        import mpi4py
        mpi4py.rc.thread_level = "serialized"
        from mpi4py import MPI

        from shmemx.udma.nic import Nic

        _unlink_mpi_segments()
        comm = MPI.COMM_WORLD
        comm.Set_errhandler(MPI.ERRORS_RETURN)  # a dead host is an exception of the NIC, not an abort of this one
        if comm.Get_size() != self.hosts.n_hosts:
            raise RuntimeError(f"mpiexec started {comm.Get_size()} host launchers for {self.hosts.n_hosts} hosts")
        heap = job.heap_size or 0
        if not heap:
            from shmemx.runtime import DEFAULT_HEAP_SIZE
            heap = DEFAULT_HEAP_SIZE
        self.nic = Nic(job.job_id, self.hosts, job.ctl, comm, heap, chaos=job.chaos)
        self.nic.start()
        if threading.current_thread() is threading.main_thread():  # (after MPI's own handler: ours replaces it)
            signal.signal(signal.SIGUSR1, lambda signum, frame: self.nic.notice())

    def export(self, job) -> None:
        """This host's inspection goes to the front: the trace and recording parts are in its directories; the
        event logs (--check) are copied there from this host's segments, and its PEs' counters (--stats) saved
        there."""
        if job.stats and self.parts:
            from shmemx.observe.counters import JobStats

            os.makedirs(os.path.join(self.parts, "stats"), exist_ok=True)
            try:
                JobStats.read(job.job_id, self.hosts.n_pes).save(
                    os.path.join(self.parts, "stats", f"host{self.hosts.index}.npz"), self.hosts.pes())
            except (OSError, ValueError) as exc:
                job._message(f"could not read this host's counters: {exc}")
        if job.check and self.parts:
            out = os.path.join(self.parts, "events")
            os.makedirs(out, exist_ok=True)
            for pe in self.hosts.pes():
                path = os.path.join(SHM_DIR, segment_name(job.job_id, f"events{pe}"))
                if os.path.exists(path):
                    shutil.copyfile(path, os.path.join(out, f"events{pe}"))

    def failure(self) -> str | None:
        return None if self.nic is None else self.nic.check_heard()

    def abort(self, why: str) -> None:
        if self.nic is not None:
            self.nic.abort(f"host {self.hosts.index}: {why}")

    def finished(self, job) -> None:
        """Every rank of this host ended: stop the NIC once every host's did (unless the job is failing)."""
        if self.nic is None:
            return
        failing = job.failure is not None or job.interrupted is not None or job.timed_out
        # a failing host does not meet the others: they are told (abort) or find out (heartbeat)
        self.nic.stop(meet=not failing)


def _unlink_mpi_segments() -> list[str]:
    """Unlink the /dev/shm files MPI mapped into this process during its initialisation (MPICH's
    ``mpich_shm_*``, its bootstrap segment); the names removed.

    Each host's launcher is the only MPI process of its node (emulated hosts are told ``MPIR_CVAR_NOLOCAL``),
    and MPI_Init returns once every process of a node attached, so no one needs the names any more: the mappings
    live on until the process ends and MPI_Finalize does not mind the missing names. A launcher killed by a
    signal then leaves nothing behind (MPICH only removes them in MPI_Finalize)."""
    names = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(None, 5)[-1]
                if path.startswith(os.path.join(SHM_DIR, "mpich_shm_")):
                    names.add(path)
    except OSError:
        return []
    for path in names:
        try:
            os.unlink(path)
        except OSError:
            pass
    return sorted(names)


def mpi_versions() -> str:
    """The MPI library and mpi4py versions in use (for reports and docs)."""
    import mpi4py
    from mpi4py import MPI

    lib = MPI.Get_library_version().splitlines()[0].strip()
    return f"mpi4py {mpi4py.__version__}, {lib}, MPI {'.'.join(map(str, MPI.Get_version()))}"


def _become_launcher(host: int, front: str = "") -> None:
    """Split the process mpiexec started into the host's agent (which stays mpiexec's child) and the host's
    launcher (its child, which returns from here).

    Why: hydra SIGKILLs every process of the job as soon as one of its own children dies of a signal, whatever
    ``-disable-auto-cleanup`` says, and then no host can say which one died first. With the agent in between, a
    launcher killed by a signal is the agent's child: the agent reports it to the front (``GONE``) and exits
    with a status, so hydra leaves the other hosts alone; they stop their PEs and clean up themselves once they
    find the host silent (``Nic.check_heard``). The launcher dies with its agent (a SIGTERM it handles: it stops
    its PEs and removes its segments), so ending mpiexec, or the front command with it, still ends every host; an
    agent on the front's node (``front`` = node:pid) also watches the front itself and ends its launcher the same
    way when the front is gone, whatever mpiexec does.
    """
    agent = os.getpid()
    pid = os.fork()
    if pid:
        node, _, front_pid = front.rpartition(":")
        os._exit(_agent(pid, host, int(front_pid) if node == socket.gethostname() and front_pid.isdigit() else 0))
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # hydra's notice of a dead process: handled once the NIC runs
    _die_with_parent()
    if os.getppid() != agent:  # the agent died before the death signal was set
        os._exit(1)


def _agent(pid: int, host: int, front: int = 0) -> int:
    """The host agent's life: forward signals to the launcher ``pid``, wait for it (and for the front command
    ``front``, a pid of this node or 0: its end is passed on as a SIGTERM), and report a launcher that died of a
    signal to the front; the launcher's exit status (128 + n for signal n), as an exit status."""
    fd = os.environ.get("PMI_FD", "")
    if fd.isdigit():  # the PMI connection is the launcher's alone: it closes when the launcher dies
        try:
            os.close(int(fd))
        except OSError:
            pass

    def forward(signum, frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):  # SIGUSR1: hydra's notice that a
        signal.signal(sig, forward)  # process of the job ended, for the launcher's NIC (Nic.notice)
    _die_with_parent()  # mpiexec's proxy gone: the launcher is told by a SIGTERM (forwarded), and ends the job
    _watch_front(pid, front)
    _, status = os.waitpid(pid, 0)
    if not os.WIFSIGNALED(status):
        return os.waitstatus_to_exitcode(status)
    sig = os.WTERMSIG(status)
    try:
        sys.stderr.write(f"{GONE} {host} {pid} {socket.gethostname()} {sig}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    return 128 + sig


def _watch_front(pid: int, front: int) -> None:
    """Until the launcher ``pid`` ends: if the front command ``front`` (0: not on this node) ends first, send the
    launcher a SIGTERM (once)."""
    import select

    try:
        fds = {os.pidfd_open(pid): "launcher"}
    except (OSError, AttributeError):  # (no pidfds: the parent-death signals alone)
        return
    try:
        if front:
            fds[os.pidfd_open(front)] = "front"
    except ProcessLookupError:  # gone already
        os.kill(pid, signal.SIGTERM)
    while "launcher" in fds.values():
        for fd in select.select(list(fds), [], [])[0]:
            if fds.pop(fd) == "front":
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            os.close(fd)


def host_main(argv=None) -> int:
    """One host's launcher (started by mpiexec: the host index is the MPI rank from the environment)."""
    p = argparse.ArgumentParser(prog="python -m shmemx.launcher.hosts")
    p.add_argument("--job", required=True)
    p.add_argument("--counts", required=True)
    p.add_argument("--front", default="")  # node:pid of the front command
    p.add_argument("--heap-size", default=None)
    p.add_argument("--timeout", type=float, default=None)
    p.add_argument("--no-tag-output", action="store_true")
    p.add_argument("--dump-dir", default=None)
    p.add_argument("--no-dump", action="store_true")
    p.add_argument("--check", action="store_true")
    p.add_argument("--stats", action="store_true")
    p.add_argument("--chaos", default=None)
    p.add_argument("--parts", default=None)
    p.add_argument("--t0", type=int, default=None)
    p.add_argument("--trace", action="store_true")
    p.add_argument("--record", action="store_true")
    p.add_argument("-m", dest="module", action="store_true")
    p.add_argument("target")
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    index = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    hosts = HostMap([int(c) for c in a.counts.split(",")], index)
    _become_launcher(index, a.front)
    from .job import Job

    print(f"{HELLO} {index} {os.getpid()} {socket.gethostname()}", flush=True)
    options = RunOptions(module=a.module, heap_size=a.heap_size, timeout=a.timeout, tag_output=not a.no_tag_output,
                         dump_dir=a.dump_dir, dump=not a.no_dump, check=a.check, chaos=a.chaos, stats=a.stats)
    job = Job(hosts.n_pes, a.target, a.args, options)
    job.job_id = host_job_id(a.job, index)
    job.pes = hosts.pes()
    job.host = HostPart(hosts, a.parts)
    if a.t0 is not None:
        job.t0 = a.t0  # one clock for every host's trace part (emulated hosts share this machine's clock)
    for kind, on in (("trace", a.trace), ("record", a.record)):
        if on:
            os.makedirs(os.path.join(a.parts, kind), exist_ok=True)
            setattr(job, f"{kind}_dir", os.path.join(a.parts, kind))
    code = job.run()
    sys.stdout.flush()
    sys.stderr.flush()
    if code == 0 and job.host.nic is not None and job.host.nic.failure is None:
        from mpi4py import MPI
        MPI.Finalize()  # every host met in the NICs' last barrier: the finalize cannot wait on a dead one
    os._exit(code)  # a failing host skips MPI_Finalize: mpiexec then ends the other hosts' launchers too


if __name__ == "__main__":
    host_main()
