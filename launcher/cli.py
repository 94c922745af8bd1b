"""The ``shmemx`` command line (also ``python -m shmemx``)."""

from __future__ import annotations

import os
import sys

import click

CONTEXT = {"help_option_names": ["-h", "--help"]}


@click.group(context_settings=CONTEXT)
@click.version_option(package_name="shmemx")
def main() -> None:
    """shmemx: write and debug CANN SHMEM / UDMA kernels on any Linux machine."""


@main.command(context_settings={**CONTEXT, "ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("-n", "--np", "n", type=click.IntRange(min=1), required=True, help="Number of PEs (processes).")
@click.option("--heap-size", default=None, metavar="SIZE", help="Symmetric heap per PE, e.g. 64M, 1G (default 64M).")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=None, metavar="SECONDS",
              help="Stop the job after SECONDS, print what every PE waits on, exit 124.")
@click.option("--tag-output/--no-tag-output", default=True, show_default=True,
              help="Prefix every output line with [pe N].")
@click.option("-m", "module", default=None, metavar="MODULE", help="Run a module as a script (like python -m).")
@click.argument("target_and_args", nargs=-1, type=click.UNPROCESSED)
def run(n, heap_size, timeout, tag_output, module, target_and_args) -> None:
    """Run SCRIPT (or -m MODULE) on N PEs: shmemx run -n 8 my_kernel.py [args...]"""
    from shmemx.launcher.job import launch

    if module is None:
        if not target_and_args:
            raise click.UsageError("give a script to run (or -m MODULE)")
        target, args = target_and_args[0], target_and_args[1:]
        if not os.path.isfile(target):
            raise click.UsageError(f"script {target!r} not found")
    else:
        target, args = module, target_and_args
    code = launch(n, target, args, module=module is not None, heap_size=heap_size, timeout=timeout,
                  tag_output=tag_output)
    sys.exit(code)


if __name__ == "__main__":  # pragma: no cover
    main()
