"""The ``shmemx`` command line (also ``python -m shmemx``)."""

from __future__ import annotations

import os
import sys
import time

import click

from .options import RunOptions

CONTEXT = {"help_option_names": ["-h", "--help"]}


@click.group(context_settings=CONTEXT)
@click.version_option(package_name="shmemx")
def main() -> None:
    """shmemx: write and debug CANN SHMEM / UDMA kernels on any Linux machine."""


@main.command(context_settings={**CONTEXT, "ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("-n", "--np", "n", type=click.IntRange(min=1), required=True, help="Number of PEs (processes).")
@click.option("--heap-size", default=None, metavar="SIZE", help="Symmetric heap per PE, e.g. 64M, 1G (default 1G; sparse: untouched pages cost nothing).")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=None, metavar="SECONDS",
              help="Stop the job after SECONDS, print what every PE waits on, exit 124.")
@click.option("--tag-output/--no-tag-output", default=True, show_default=True,
              help="Prefix every output line with [pe N].")
@click.option("-m", "module", default=None, metavar="MODULE", help="Run a module as a script (like python -m).")
@click.option("--trace", "trace", default=None, metavar="FILE",
              help="Record every WQE, wait, barrier and region; write Chrome trace-event JSON (Perfetto) to FILE.")
@click.option("--record", "record", default=None, metavar="FILE",
              help="Record every post, quiet, wait, barrier, region and compute annotation to FILE, for "
                   "shmemx replay (modelled time on a topology).")
@click.option("--stats", is_flag=True,
              help="Print every PE's counters (WQEs, bytes, quiet/barrier/wait time) at the end.")
@click.option("--dump-dir", default=None, metavar="DIR",
              help="Where the post-mortem dump goes on a timeout or failure (default $SHMEMX_DUMP_DIR or .).")
@click.option("--check", is_flag=True,
              help="Protocol sanitizer: report flags before payloads, quiets on the wrong QP, reused slots and the "
                   "other ordering bugs from happens-before (one 'shmemx check:' line each; exit 3 if any).")
@click.option("--chaos", default=None, metavar="SEED",
              help="Jitter kernel threads at waits, quiets and signal_op, every choice drawn from SEED "
                   "('random': pick one and print it).")
@click.option("--hosts", "hosts", default=None, metavar="H|HOST[:PES],...",
              help="Span hosts joined by MPI (shmemx[mpi]): a number H runs H emulated hosts on this machine; "
                   "host1:8,host2:8 starts the job on those hosts through mpiexec.")
@click.option("--hostfile", default=None, metavar="FILE", help="Hosts one a line (host[:pes]), as --hosts.")
@click.option("--deepep", is_flag=True,
              help="DeepEP mode: run DeepEP's own scripts unchanged (import deep_ep is shmemx's, CUDA is the CPU, "
                   "torch.multiprocessing.spawn runs on the job's ranks; docs/deepep.md).")
@click.argument("target_and_args", nargs=-1, type=click.UNPROCESSED)
def run(n, module, hosts, hostfile, target_and_args, **options) -> None:
    """Run SCRIPT (or -m MODULE) on N PEs: shmemx run -n 8 my_kernel.py [args...]"""
    from shmemx.launcher.job import launch

    target, args = _target(module, target_and_args)
    run_options = _run_options(module is not None, options)
    if hosts or hostfile:
        from shmemx.launcher.hosts import parse_hosts, run_hosts

        if run_options.deepep:
            raise click.UsageError("--deepep runs on one host: DeepEP's torch.distributed rendezvous over several "
                                   "hosts is not mapped (drop --hosts; test_internode.py runs as 2 nodes x 8 "
                                   "ranks on one host)")
        try:
            host_map, names = parse_hosts(hosts, hostfile, n)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--hosts") from None
        sys.exit(run_hosts(n, host_map, names, target, args, run_options))
    sys.exit(launch(n, target, args, run_options))


def _target(module: str | None, target_and_args: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
    """(script path or module name, its arguments) of ``shmemx run``'s command line."""
    if module is not None:
        return module, target_and_args
    if not target_and_args:
        raise click.UsageError("give a script to run (or -m MODULE)")
    if not os.path.isfile(target_and_args[0]):
        raise click.UsageError(f"script {target_and_args[0]!r} not found")
    return target_and_args[0], target_and_args[1:]


def _run_options(module: bool, flags: dict) -> RunOptions:
    """The ``RunOptions`` of ``shmemx run``'s flags (each flag's parameter is named as the field it sets)."""
    chaos = flags.get("chaos")
    if chaos is not None and chaos != "random":
        try:
            flags = {**flags, "chaos": int(chaos, 0)}
        except ValueError:
            raise click.BadParameter(f"{chaos!r} is not an integer seed or 'random'", param_hint="--chaos") from None
    return RunOptions(module=module, **flags)


@main.command(context_settings=CONTEXT)
@click.argument("name", type=click.Choice(["P0", "P1", "P2", "P3", "P4", "P5", "all"], case_sensitive=False))
@click.option("--quick", is_flag=True, help="Small P and shapes: about a minute per experiment.")
@click.option("--out", "out", default=None, metavar="DIR", help="Write NAME.csv, NAME.json and NAME.png into DIR.")
@click.option("--model", default=None, metavar="TOPO",
              help="Also record each job and add modelled columns from its replay on TOPO (e.g. ascend950).")
@click.option("--hosts", default=None, metavar="H",
              help="Run every job over H emulated hosts joined by MPI (or over hosts a,b,...), as shmemx run --hosts.")
def experiment(name, quick, out, model, hosts) -> None:
    """Run the MoE schedule experiment NAME (P0-P5, or all); print its table and verdict."""
    from pathlib import Path

    from shmemx.launcher.experiment import EXPERIMENTS, run_experiment

    for one in (list(EXPERIMENTS) if name.lower() == "all" else [name.upper()]):
        result = run_experiment(one, quick=quick, out=Path(out) if out else None, model=model, hosts=hosts)
        cols = [c for c in ("n", "schedule", "qp_policy", "routing", "group_width", "token_blocks", "weight_blocks",
                            "skew", "hidden", "rounds", "wqes", "qp_wqes", "qp_bytes_max_min", "cross_server_mb",
                            "max_in_degree", "quiets", "route_reads", "dispatch_ms_max", "dispatch_ms_p50")]
        cols += ["model_dispatch_us", "model_combine_us", "model_bound"] if model else []
        over = f", over hosts {hosts}" if hosts else ""
        click.echo(f"{one}: {result['what']} ({result['seconds']} s{over})")
        click.echo("  ".join(cols))
        for r in result["rows"]:
            click.echo("  ".join(str(r.get(c, "")) for c in cols))
        click.echo(f"verdict: {result['verdict']}\n")


@main.command(context_settings=CONTEXT)
@click.option("--json", "as_json", is_flag=True, help="One JSON document (a list of jobs).")
def ps(as_json) -> None:
    """List the shmemx jobs on this machine (from /dev/shm/shmemx_*_ctl); 'stale' = the launcher is gone. A job
    of several hosts is one line, followed by one line per host part (h0, h1, ... with its PEs)."""
    import json

    from shmemx.observe.jobs import list_jobs

    jobs = list_jobs()
    if as_json:
        click.echo(json.dumps(jobs, indent=1))
        return
    if not jobs:
        click.echo("no shmemx jobs")
        return
    rows = [("JOB", "PES", "STATE", "STARTED", "AGE", "LAUNCHER", "SHM", "PE STATUS", "SCRIPT")]
    now = time.time()
    groups: dict[str, list[dict]] = {}
    for j in jobs:  # a job of several hosts: one line, then one per host part found here
        groups.setdefault(j["base"] if j["n_hosts"] > 1 else j["job"], []).append(j)
    for base, parts in groups.items():
        if parts[0]["n_hosts"] > 1:
            rows.append(_ps_job_row(base, parts, now))
            rows += [_ps_row(j, now, f"  h{j['host']}", _pe_range(j["host_pes"]), "") for j in parts]
        else:
            rows.append(_ps_row(parts[0], now, parts[0]["job"], str(parts[0]["n_pes"] or "-"),
                                parts[0]["script"]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        click.echo(("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1]).rstrip())


def _ps_row(j: dict, now: float, name: str, pes: str, script: str) -> tuple:
    started = time.strftime("%H:%M:%S", time.localtime(j["start_time"])) if j["start_time"] else "-"
    age = _age(now - j["start_time"]) if j["start_time"] else "-"
    launcher = f"{j['launcher_pid']}" + (" (stale)" if j["stale"] else "") if j["launcher_pid"] else "stale"
    return (name, pes, j["state"].lower(), started, age, launcher, _size(j["bytes"]), _statuses(j["pes"]), script)


def _ps_job_row(base: str, parts: list[dict], now: float) -> tuple:
    """The line of a job of several hosts: its PEs, its state (each host's), its hosts here, all their PEs."""
    first = parts[0]
    starts = [j["start_time"] for j in parts if j["start_time"]]
    states = sorted({j["state"].lower() for j in parts})
    here = f"{len(parts)} of {first['n_hosts']} hosts here" if len(parts) < first["n_hosts"] else \
        f"{first['n_hosts']} hosts"
    total: dict[str, int] = {}
    for j in parts:
        for k, v in j["pes"].items():
            total[k] = total.get(k, 0) + v
    return (base, str(first["n_pes"] or "-"), "/".join(states), time.strftime("%H:%M:%S", time.localtime(
        min(starts))) if starts else "-", _age(now - min(starts)) if starts else "-", here,
        _size(sum(j["bytes"] for j in parts)), _statuses(total), first["script"])


def _statuses(pes: dict) -> str:
    return ",".join(f"{v} {k.lower()}" for k, v in pes.items()) or "-"


def _pe_range(host_pes) -> str:
    return f"{host_pes[0]}..{host_pes[0] + host_pes[1] - 1}" if host_pes else "-"


def _age(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def _size(nbytes: int) -> str:
    for unit in ("B", "K", "M", "G"):
        if nbytes < 1024 or unit == "G":
            return f"{nbytes:.0f}{unit}" if unit == "B" else f"{nbytes:.1f}{unit}"
        nbytes /= 1024
    return str(nbytes)


@main.command(context_settings=CONTEXT)
@click.argument("job", required=False)
@click.option("--stale", is_flag=True, help="Remove the segments of every job whose launcher is gone.")
@click.option("--force", is_flag=True, help="Remove JOB's segments even though its launcher is alive.")
def clean(job, stale, force) -> None:
    """Remove a dead job's shared memory (/dev/shm/shmemx_<job>_*); the launcher normally does it itself."""
    from shmemx.observe.jobs import clean_job, find_job, list_jobs

    if (job is None) == (not stale):
        raise click.UsageError("give a JOB or --stale (shmemx ps lists the jobs)")
    if stale:
        jobs = [j["job"] for j in list_jobs() if j["stale"]]
    else:
        try:
            jobs = [find_job(job)]
        except LookupError as exc:
            raise click.ClickException(str(exc)) from None
    if not jobs:
        click.echo("no stale jobs")
    for j in jobs:
        try:
            removed = clean_job(j, force=force)
        except RuntimeError as exc:
            raise click.ClickException(str(exc)) from None
        click.echo(f"job {j}: removed {len(removed)} segments")


@main.command(context_settings=CONTEXT)
@click.argument("job", required=False)
@click.option("--pe", "pes", type=int, multiple=True, metavar="P", help="Only PE P (repeatable).")
@click.option("--peer", "peers", type=int, multiple=True, metavar="Q", help="Only queues to peer Q (repeatable).")
@click.option("--qp", "qps", type=int, multiple=True, metavar="K", help="Only QP index K (repeatable).")
@click.option("--all-queues", is_flag=True, help="List idle queues too (default: only queues with work in flight).")
@click.option("--limit", type=int, default=None, metavar="N",
              help="WQEs and CQEs listed per queue (default 64; -1 = all). Counts are always complete.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the dump as one JSON document (schema in docs/formats.md).")
@click.option("--file", "path", default=None, metavar="F", type=click.Path(exists=True, dir_okay=False),
              help="Read a saved dump (e.g. the launcher's post-mortem shmemx-dump-<job>.json) instead of a job.")
def dump(job, pes, peers, qps, all_queues, limit, as_json, path) -> None:
    """Show every SQ, CQ, wait and allocation of a running JOB (read-only; default: the one live job)."""
    import json

    from shmemx.observe import dump as dumps
    from shmemx.observe.jobs import find_job
    from shmemx.observe.reader import JobReader

    sel = {"pes": set(pes) or None, "peers": set(peers) or None, "qps": set(qps) or None}
    if path is not None:
        if job is not None:
            raise click.UsageError("give a JOB or --file, not both")
        try:
            doc = dumps.load(path)
        except ValueError as exc:
            raise click.ClickException(str(exc)) from None
    else:
        try:
            job_id = find_job(job)
            reader = JobReader.attach(job_id)
        except (LookupError, FileNotFoundError, ValueError) as exc:
            raise click.ClickException(str(exc)) from None
        try:
            doc = dumps.snapshot(reader, pes=sel["pes"], peers=sel["peers"], qps=sel["qps"], all_queues=all_queues,
                                 limit=dumps.DEFAULT_LIMIT if limit is None else limit)
        finally:
            reader.close()
    if as_json:
        click.echo(json.dumps(doc, indent=1))
    else:
        click.echo(dumps.render(doc, **sel), nl=False)


@main.command(context_settings=CONTEXT)
@click.argument("recording", type=click.Path(exists=True, dir_okay=False))
@click.option("--topology", default="ascend950", show_default=True, metavar="TOPO",
              help="A topology TOML file, or a built-in one: ascend950, h800_cx7.")
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
              help="Override a topology value, e.g. --set intra.bandwidth_GBps=100 (repeatable).")
@click.option("--json", "as_json", is_flag=True,
              help="Print the replay as one JSON document (schema in docs/formats.md).")
@click.option("--perfetto", default=None, metavar="FILE",
              help="Also write a Chrome trace-event JSON of the replay in virtual time (open it in Perfetto).")
def replay(recording, topology, settings, as_json, perfetto) -> None:
    """Replay a recording (shmemx run --record FILE) in virtual time on a modelled two-tier topology."""
    import json

    from shmemx.observe.replay import SimError, render, replay as run_replay

    overrides = {}
    for item in settings:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.UsageError(f"--set {item!r}: expected KEY=VALUE, e.g. intra.bandwidth_GBps=100")
        overrides[key.strip()] = value.strip()
    try:
        doc = run_replay(recording, topology, overrides, perfetto=perfetto)
    except (ValueError, SimError) as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(doc, indent=1))
    else:
        click.echo(render(doc), nl=False)
        if perfetto:
            click.echo(f"virtual-time trace written to {perfetto}; open it in Perfetto (ui.perfetto.dev)")


if __name__ == "__main__":  # pragma: no cover
    main()
