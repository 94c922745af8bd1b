"""Jobs over several hosts (``shmemx run --hosts``): emulated hosts on this machine joined by MPI.

Each case runs the real command; skipped when mpi4py (``shmemx[mpi]``) is absent. The bodies live in
tests/hosts/ and assert themselves; a case passes when every PE of every host printed its line and the job
exited 0 with no segment left."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mpi4py")

from shmemx.observe.jobs import list_jobs  # noqa: E402
from shmemx.shm.control import Control  # noqa: E402

HERE = Path(__file__).parent / "hosts"
SHMEMX = [sys.executable, "-m", "shmemx"]


def _segments(job: str) -> list[str]:
    return glob.glob(f"/dev/shm/shmemx_{job}.h*")


def _run(n: int, script: str, *args, hosts: str = "2", timeout: float = 300,
         options: tuple = ()) -> subprocess.CompletedProcess:
    cmd = SHMEMX + ["run", "-n", str(n), "--hosts", hosts, "--timeout", "240", *options, str(HERE / script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_basics_across_two_hosts(n):
    """put / get (heap and private arrays) / put_signal / atomics / signal_op / waits / barrier / sync_all, an
    error CQE from the other host's check, MTE refused."""
    proc = _run(n, "basics.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for pe in range(n):
        assert f"pe {pe}: hosts basics ok" in proc.stdout, proc.stdout + proc.stderr


def test_multi_qp_blocks_and_batches_across_hosts():
    proc = _run(4, "multi_qp.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert all(f"pe {pe}: multi ok" in proc.stdout for pe in range(4)), proc.stdout + proc.stderr


def test_team_slots_come_back_to_the_host_that_claimed_them():
    """A team led on another host than the one that claimed its slot gives the slot back (more rounds than one
    host's share of slots); teams across hosts are destroyed without losing a relayed barrier arrival."""
    proc = _run(4, "team_slots.py")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert all(f"pe {pe}: team slots ok" in proc.stdout for pe in range(4)), proc.stdout[-3000:] + proc.stderr


def test_cam_across_two_hosts_under_check():
    """CAM's moe_dispatch_normal / moe_combine_normal over 2 hosts against tests/test_cam.py's reference: ranks of
    the other host over UDMA (kernels/cam/far.py), of this host through their windows; --check finds nothing."""
    proc = _run(4, "cam.py", options=("--check",))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert all(f"pe {pe}: cam across hosts ok" in proc.stdout for pe in range(4)), proc.stdout + proc.stderr
    assert "--check: no findings across the hosts" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_cam_8_pes_over_2_hosts_and_its_demo():
    proc = _run(8, "cam.py")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert all(f"pe {pe}: cam across hosts ok" in proc.stdout for pe in range(8)), proc.stdout + proc.stderr
    demo = Path(__file__).parent.parent / "scripts" / "examples" / "cam_moe_demo.py"
    cmd = SHMEMX + ["run", "-n", "8", "--hosts", "2", "--heap-size", "440M", "--timeout", "100", str(demo)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0 and proc.stdout.count("PASS: pe") == 8, proc.stdout[-3000:] + proc.stderr[-3000:]


def _start_ready(args: list[str]) -> subprocess.Popen:
    """``shmemx run -n 4 --hosts 2 --timeout 120 *args``, returned once its 4 PEs have each printed 'ready'."""
    proc = subprocess.Popen(SHMEMX + ["run", "-n", "4", "--hosts", "2", "--timeout", "120", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = 0
        while ready < 4:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            ready += "ready" in line
    except BaseException:
        proc.kill()
        raise
    return proc


def _spin_script(tmp_path: Path) -> Path:
    """A script whose PEs print 'ready' after init, then meet in barriers until they are stopped."""
    script = tmp_path / "spin.py"
    script.write_text("import time, shmemx\nshmemx.init(heap_size='16M')\nshmemx.aclshmem_barrier_all()\n"
                      "print('ready', flush=True)\nwhile True:\n    shmemx.aclshmem_barrier_all()\n"
                      "    time.sleep(0.02)\n")
    return script


def test_ps_groups_a_jobs_hosts_and_stats_merge_them(tmp_path):
    """`shmemx ps` lists a job of 2 hosts as one job with its two host parts under it; `--stats` prints one table
    with every PE's counters, whatever host it ran on."""
    go = tmp_path / "go"
    proc = _start_ready(["--stats", str(HERE / "ps_stats.py"), str(go)])
    try:
        job = next(j for j in list_jobs() if "ps_stats.py" in j["script"] and str(go) in j["script"])["base"]
        listing = subprocess.run(SHMEMX + ["ps"], capture_output=True, text=True, timeout=60).stdout
        go.write_text("")
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    lines = listing.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(job))
    assert lines[at].split()[:2] == [job, "4"] and "2 hosts" in lines[at] and "4 ready" in lines[at], listing
    assert [line.split()[:2] for line in lines[at + 1:at + 3]] == [["h0", "0..1"], ["h1", "2..3"]], listing
    assert sum(line.startswith(job) for line in lines) == 1, listing  # (no line of its own per host part)
    head = err.index(f"counters of job {job} (4 PEs over 2 hosts):")
    table = err[head:].splitlines()[1:]
    cols = table[0].split()
    rows = {r.split()[0]: r.split() for r in table[1:5]}
    assert sorted(rows) == ["0", "1", "2", "3"], err[head:]
    for pe in "0123":  # at least the 7 puts of 8 KiB to the other host, counted on every host
        assert int(rows[pe][cols.index("wqes_posted")].replace(",", "")) >= 7, err[head:]
        assert int(rows[pe][cols.index("bytes_posted")].replace(",", "")) >= 7 * 8192, err[head:]
    assert "no counters from" not in err[head:], err[head:]


def test_experiment_configuration_over_two_hosts_counts_as_on_one():
    """``shmemx experiment --hosts``: one configuration run as a job of 2 hosts (its ranks run the experiment
    module by name) moves exactly what it moves on one host; a hierarchy whose servers straddle hosts is
    refused before anything runs."""
    from shmemx.launcher.experiment import BASE, run_config

    rows = []
    for hosts in (None, 2):
        cfg = dict(BASE, n=4, tokens=16, hidden=256, topk=4, experts_per_rank=2, reps=1, hosts=hosts)
        rows.append(run_config(cfg, timeout=120)[0])
    keys = ("rounds", "wqes", "payload_mb", "qp_wqes", "recv_rows", "quiets", "syncs", "flag_writes", "route_reads")
    assert {k: rows[0][k] for k in keys} == {k: rows[1][k] for k in keys}, rows
    assert rows[1]["hosts"] == 2 and "hosts" not in rows[0]
    bad = dict(BASE, n=12, schedule="hierarchy", server_size=4, hosts=2)  # hosts of 6 PEs, servers of 4
    with pytest.raises(ValueError, match=r"servers of 4 PEs must lie within hosts .* hosts of \[6, 6\] PEs"):
        run_config(bad)


def test_uneven_hosts_and_host_list_parse():
    from shmemx.launcher.hosts import parse_hosts

    hosts, names = parse_hosts("a:3,b:1", None, 4)
    assert hosts.counts == [3, 1] and names == ["a", "b"]
    hosts, names = parse_hosts("3", None, 8)
    assert hosts.counts == [3, 3, 2] and names is None
    with pytest.raises(ValueError, match="hold 5 PEs"):
        parse_hosts("a:3,b:2", None, 4)


def test_run_hosts_takes_launchs_options():
    """run_hosts takes launch's RunOptions and keywords (one list); what it cannot do is refused before a start."""
    from shmemx.launcher import RunOptions
    from shmemx.launcher.hosts import _host_flags, parse_hosts, run_hosts

    hosts, names = parse_hosts("2", None, 4)
    with pytest.raises(ValueError, match="--deepep runs on one host"):
        run_hosts(4, hosts, names, "x.py", (), RunOptions(deepep=True))
    with pytest.raises(TypeError, match="run_hosts\\(\\) got an unexpected keyword argument 'hostfile'"):
        run_hosts(4, hosts, names, "x.py", hostfile="h")
    flags = _host_flags(RunOptions(heap_size="16M", timeout=5.0, tag_output=False, dump=False, check=True,
                                   chaos=7, module=True))
    assert flags == ["--heap-size", "16M", "--timeout", "5.0", "--no-tag-output", "--no-dump", "--check",
                     "--chaos", "7", "-m"]


def test_killed_host_launcher_ends_the_job_everywhere(tmp_path):
    """kill -9 of one host's launcher: every rank of every host gone and no segment left within 5 s (shmemx's, and
    MPI's own), and the front names the host."""
    script = _spin_script(tmp_path)
    proc = _start_ready([str(script)])
    try:
        jobs = [j for j in list_jobs() if j["script"].endswith(str(script)) or str(script) in j["script"]]
        assert len(jobs) == 2, jobs
        base = jobs[0]["job"].rsplit(".h", 1)[0]
        pids = []
        for j in jobs:
            ctl = Control.attach(j["job"], readonly=True)
            pids += [int(ctl.pes[p]["pid"]) for p in range(4) if int(ctl.pes[p]["pid"])]
            ctl.close()
        victim = next(j for j in jobs if j["job"].endswith(".h1"))
        for j in jobs:  # MPI's own /dev/shm files (MPICH's mpich_shm_*) were unlinked once MPI was up
            with open(f"/proc/{j['launcher_pid']}/maps") as f:
                mpi = [line.split(None, 5)[-1].strip() for line in f if "/dev/shm/mpich_shm_" in line]
            assert all(m.endswith("(deleted)") for m in mpi), mpi
        start = time.monotonic()
        os.kill(victim["launcher_pid"], signal.SIGKILL)
        while time.monotonic() - start < 5:
            if not any(_alive(p) for p in pids) and not _segments(base):
                break
            time.sleep(0.05)
        took = time.monotonic() - start
        assert not any(_alive(p) for p in pids), f"ranks alive {took:.1f} s after the kill"
        assert not _segments(base), _segments(base)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode != 0
        assert f"host 1 (pes 2..3, node {os.uname().nodename}, launcher pid {victim['launcher_pid']}) died (killed " \
               f"by SIGKILL)" in err, err  # the front names the host, from its agent's report
        assert "host 1 (pes 2..3) stopped answering" in err, err  # and host 0 found it silent itself
    finally:
        if proc.poll() is None:
            proc.kill()


def test_killed_front_ends_every_host(tmp_path):
    """kill -9 of the front command (``shmemx run``): mpiexec gets a SIGTERM (its parent-death signal), each host's
    agent passes it to its launcher, which stops its PEs and removes its segments; nothing of the job is left
    within 5 s (mpiexec and its proxy, agents, launchers, reapers, ranks, segments)."""
    script = _spin_script(tmp_path)
    proc = _start_ready([str(script)])
    try:
        jobs = [j for j in list_jobs() if str(script) in j["script"]]
        base = jobs[0]["job"].rsplit(".h", 1)[0]
        job_pids = _descendants(proc.pid)
        assert len(job_pids) >= 1 + 1 + 2 * (1 + 1 + 1 + 2), job_pids  # mpiexec, proxy, per host agent, launcher,
        start = time.monotonic()  # reaper, 2 ranks
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        while time.monotonic() - start < 5 and (any(_alive(p) for p in job_pids) or _segments(base)):
            time.sleep(0.05)
        assert not [p for p in job_pids if _alive(p)], f"alive {time.monotonic() - start:.1f} s after the kill"
        assert not _segments(base), _segments(base)
    finally:
        if proc.poll() is None:
            proc.kill()


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children first found through /proc's ppid fields)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                pass
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        found += kids
        todo += kids
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.mark.slow
def test_moe_oracle_8_pes_over_2_hosts():
    """The MoE Buffer (default schedule, and the hierarchy with server_size = PEs per host) against the hold-out
    model at 8 PEs over 2 hosts."""
    oracle = Path(__file__).parent.parent / "scripts" / "holdout" / "moe_oracle.py"
    configs = '[{}, {"server_size": 4, "schedule": "hierarchy"}]'
    cmd = SHMEMX + ["run", "-n", "8", "--hosts", "2", "--timeout", "100", str(oracle), "--tokens", "48",
                    "--hidden", "128", "--topk", "4", "--experts", "16", "--configs", configs]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    import json
    lines = [json.loads(line.split("HOLDOUT ", 1)[1]) for line in proc.stdout.splitlines() if "HOLDOUT " in line]
    assert sorted(d["pe"] for d in lines) == list(range(8))
    for d in lines:
        assert len(d["results"]) == 2 and all(r["checks"] > 0 and not r["failed"] for r in d["results"]), d


@pytest.mark.slow
def test_chaos_trace_record_and_check_across_hosts(tmp_path):
    """--chaos over hosts keeps the results; --trace / --record give one file each with every PE; --check runs
    one analysis of both hosts' logs; the recording replays."""
    trace, rec = tmp_path / "t.json", tmp_path / "r.zip"
    cmd = SHMEMX + ["run", "-n", "4", "--hosts", "2", "--timeout", "60", "--chaos", "11", "--trace", str(trace),
                    "--record", str(rec), "--check", str(HERE / "basics.py")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert all(f"pe {pe}: hosts basics ok" in proc.stdout for pe in range(4)), proc.stdout + proc.stderr
    assert "across the hosts" in proc.stderr, proc.stderr  # one --check analysis of every host's logs
    import json
    doc = json.loads(trace.read_text())
    assert doc["otherData"]["missing_pes"] == [] and len(doc["traceEvents"]) > 0
    replay = subprocess.run(SHMEMX + ["replay", str(rec), "--topology", "ascend950"], capture_output=True,
                            text=True, timeout=60)
    assert replay.returncode == 0, replay.stderr
