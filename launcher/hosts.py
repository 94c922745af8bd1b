"""A job over several hosts: one launcher per host, started by MPI, joined by the hosts' NICs.

``shmemx run -n N --hosts H`` runs H emulated hosts on this machine; ``--hosts host1:8,host2:8`` (or
``--hostfile FILE``, one ``host[:pes]`` a line) runs on those hosts. Either way the front command starts
``mpiexec`` (MPICH's hydra, from the ``mpich`` wheel of ``shmemx[mpi]``) with one process per host, each running
``python -m shmemx.launcher.hosts`` (``host_main``): the host's launcher. It is the single-host launcher
(``job.Job``) over the host's PEs (``job.pes``) with its own segments (job id ``<job>.h<k>``, ``shm.hosts``), plus
this host's part (``HostPart``): once the ranks are forked it initialises MPI (never in a rank: the ranks are
plain shmemx processes) and starts the host's NIC (``udma.nic``), which carries every WQE to another host's PE
and the barriers between hosts. On emulated hosts MPI is told to use its network path (``MPIR_CVAR_NOLOCAL``):
no memory is shared between hosts, MPICH's own included.

Ending: a host whose PE fails tells the others (``Nic.abort``); a host that goes silent (its launcher was killed)
is declared dead by every other NIC after ``nic.DEAD_AFTER`` seconds, and mpiexec ends the processes of a job
one of which was killed; either way every host's launcher stops its PEs, saying which host ended the job, and
removes its segments (its reaper does when the launcher itself was killed).
"""

from __future__ import annotations

import argparse
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
    ``overrides`` are ``launch``'s (``RunOptions``); ``stats`` is not merged across hosts yet (ignored), and
    ``deepep`` is refused (ValueError)."""
    import secrets

    o = RunOptions.of(options, overrides, "run_hosts")
    if o.deepep:
        raise ValueError("--deepep runs on one host: DeepEP's torch.distributed rendezvous over several hosts is not "
                         "mapped (drop --hosts; test_internode.py runs as 2 nodes x 8 ranks on one host)")
    job = job_id or f"{os.getpid():x}{secrets.token_hex(3)}"
    trace, record = (os.path.abspath(p) if p else None for p in (o.trace, o.record))
    # hydra would SIGKILL every host's launcher once one dies, leaving no word of which; the NICs find a dead host
    # themselves (heartbeats) and every launcher then stops its PEs, names the host and removes its segments
    cmd = [_mpiexec(), "-disable-auto-cleanup", "-n", str(hosts.n_hosts)]
    if names:
        cmd += ["-hosts", ",".join(names), "-ppn", "1"]
    cmd += [sys.executable, "-m", "shmemx.launcher.hosts", "--job", job, "--counts",
            ",".join(map(str, hosts.counts))]
    cmd += _host_flags(o)
    parts = None
    if trace or record or o.check:  # the hosts' trace / recording parts and event logs meet here (a shared directory)
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
            code = _gather(parts, n, job, target, trace, record, o.check, o.heap_size, code)
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
    chaos = o.chaos
    if chaos == "random":  # one seed for every host (each host's launcher would draw its own)
        chaos = secrets.randbelow(1 << 32)
        _say(f"chaos seed {chaos} (rerun it with --chaos {chaos})")
    flags += ["--chaos", str(chaos)] if chaos is not None else []
    flags += ["-m"] if o.module else []
    return flags


def _die_with_parent() -> None:
    """mpiexec gets SIGTERM when the front command dies (it then ends every host's launcher)."""
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _say(text: str) -> None:
    sys.stderr.write(f"shmemx: {text}\n")
    sys.stderr.flush()


def _gather(parts: str, n: int, job: str, target: str, trace, record, check, heap_size, code: int) -> int:
    """After every host ended: one trace, one recording, one --check analysis of every host's event logs."""
    from shmemx.observe import record as recording
    from shmemx.observe.trace import merge_parts

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
    if check:
        code = _check(os.path.join(parts, "events"), n, heap_size, code)
    return code


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
    """The front command's view of the host launchers: forwards their output, keeps their announcements (a
    line ``HELLO host pid node`` each, not shown), and names the host when mpiexec reports a launcher's death."""

    _DEATH = re.compile(r"PID (\d+) RUNNING AT (\S+)")
    _CODE = re.compile(r"EXIT STRING: (.+ \(signal \d+\))|KILLED BY SIGNAL: (\d+)")

    def __init__(self, hosts: HostMap, out, err):
        self.hosts, self.out, self.err = hosts, out, err
        self.launchers: dict[int, tuple[int, str]] = {}  # pid -> (host, node)
        self.dead: list[tuple[int, str]] = []  # (pid, node) of launchers mpiexec saw die
        self.code: int | None = None

    def follow(self, proc) -> int:
        threads = [threading.Thread(target=self._pump, args=(proc.stdout, self.out), daemon=True),
                   threading.Thread(target=self._pump, args=(proc.stderr, self.err), daemon=True)]
        for t in threads:
            t.start()
        try:
            code = self._watch(proc)
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGINT)
            code = proc.wait()
        for t in threads:
            t.join()
        if code and self.code_text and not self.dead and self.first_gone is not None:
            self.dead.append((self.first_gone, socket.gethostname()))
        for pid, node in self.dead[:1]:
            host, _ = self.launchers.get(pid, (None, node))
            pes = self.hosts.pes(host) if host is not None else None
            who = f"host {host} (pes {pes.start}..{pes.stop - 1}, node {node}, launcher pid {pid})" if pes \
                else f"the launcher pid {pid} on node {node}"
            how = f" ({self.code_text})" if self.code_text else ""
            self.err.write(f"shmemx: {who} died{how}; mpiexec ended the launchers of every other host, their PEs "
                           f"ended with them and their segments were removed\n")
            self.err.flush()
        return code

    code_text = ""
    first_gone: int | None = None  # the launcher on this node that ended first while the others ran

    def _watch(self, proc) -> int:
        """Wait for mpiexec; meanwhile note which launcher of this node ends first (mpiexec's report of a dead
        launcher need not say which one it was)."""
        here = socket.gethostname()
        while True:
            try:
                return proc.wait(timeout=0.02)
            except subprocess.TimeoutExpired:
                pass
            if self.first_gone is None:
                mine = [pid for pid, (_, node) in self.launchers.items() if node == here]
                gone = [pid for pid in mine if not _running(pid)]
                if gone and len(gone) < len(self.launchers):
                    self.first_gone = gone[0]

    def _pump(self, stream, dest) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace")
            while line.startswith(HELLO):  # (another host's hello or a rank's output may follow on its line)
                _, host, pid, node, *rest = line.split(None, 4)
                self.launchers[int(pid)] = (int(host), node)
                line = rest[0] if rest else ""
            if not line:
                continue
            m = self._DEATH.search(line)
            if m:
                self.dead.append((int(m.group(1)), m.group(2)))
            m = self._CODE.search(line)
            if m:
                self.code_text = m.group(1).lower() if m.group(1) else f"killed by signal {m.group(2)}"
            try:
                dest.write(line)
                dest.flush()
            except (BrokenPipeError, ValueError):
                pass


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


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

    def export(self, job) -> None:
        """This host's inspection goes to the front: the trace and recording parts are in its directories; the
        event logs (--check) are copied there from this host's segments."""
        if job.check and self.parts:
            out = os.path.join(self.parts, "events")
            os.makedirs(out, exist_ok=True)
            for pe in self.hosts.pes():
                path = os.path.join(SHM_DIR, segment_name(job.job_id, f"events{pe}"))
                if os.path.exists(path):
                    shutil.copyfile(path, os.path.join(out, f"events{pe}"))

    def failure(self) -> str | None:
        return None if self.nic is None else self.nic.failure

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


def mpi_versions() -> str:
    """The MPI library and mpi4py versions in use (for reports and docs)."""
    import mpi4py
    from mpi4py import MPI

    lib = MPI.Get_library_version().splitlines()[0].strip()
    return f"mpi4py {mpi4py.__version__}, {lib}, MPI {'.'.join(map(str, MPI.Get_version()))}"


def host_main(argv=None) -> int:
    """One host's launcher (started by mpiexec: the host index is the MPI rank from the environment)."""
    p = argparse.ArgumentParser(prog="python -m shmemx.launcher.hosts")
    p.add_argument("--job", required=True)
    p.add_argument("--counts", required=True)
    p.add_argument("--heap-size", default=None)
    p.add_argument("--timeout", type=float, default=None)
    p.add_argument("--no-tag-output", action="store_true")
    p.add_argument("--dump-dir", default=None)
    p.add_argument("--no-dump", action="store_true")
    p.add_argument("--check", action="store_true")
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
    from .job import Job

    print(f"{HELLO} {index} {os.getpid()} {socket.gethostname()}", flush=True)
    options = RunOptions(module=a.module, heap_size=a.heap_size, timeout=a.timeout, tag_output=not a.no_tag_output,
                         dump_dir=a.dump_dir, dump=not a.no_dump, check=a.check, chaos=a.chaos)
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
