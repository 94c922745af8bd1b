"""Run the project's kernels under ``--check`` and say which have findings (there must be none).

    flock /tmp/shmemx-heavy.lock python scripts/check_kernels.py           # everything (a few minutes)
    python scripts/check_kernels.py --only examples                        # a part: examples, moe, cam, ...

* examples: every script of ``scripts/examples`` (4 PEs; ``hang_demo.py`` with ``--timeout``, it hangs on purpose);
* moe: ``moe_demo.py`` on 8 PEs with every QP policy, and with two_3_1 on 4 channels (batched lanes and rounds;
  the cached and zero-copy paths run in ``tests/test_check.py``);
* cam: ``cam_moe_demo.py`` on 8 PEs (the quantised path runs in ``tests/test_check.py``);
* schedules: every schedule of ``tests/test_schedules.py`` (fullmesh, groups, hierarchy; scan and compact
  routing; uniform and zipf skews) at 8 and 16 PEs;
* deep_ep: DeepEP's three tests ported (``scripts/deep_ep``: intranode, internode as 2 servers x 4, low latency)
  on 8 PEs in the test suite's CI sizes (skipped without torch);
* bench: the kernels of ``bench_rma``, ``bench_sync``, ``bench_trace``, ``bench_moe`` and ``bench_cam`` in their
  ``--quick`` shapes, each ``launch`` of theirs run with ``check=True``.

Exit status 1 when any run has a finding (warnings are listed, they do not fail).

    flock /tmp/shmemx-heavy.lock python scripts/check_kernels.py --chaos 20   # every part under seeds 1..20

With ``--chaos N`` every run goes under ``--chaos SEED`` (the engine's chaos scheduler and the threads' jitter)
instead of ``--check``, for seeds 1..N: each must exit 0 with correct results (the kernels check themselves).
``--first-seed K`` starts the sweep at seed K (a sweep stopped after seed 9 resumes with ``--first-seed 10``).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import io
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(HERE, "examples")
sys.path.insert(0, HERE)


def _findings(directory: str) -> list[dict]:
    found = []
    for path in glob.glob(os.path.join(directory, "shmemx-check-*.jsonl")):
        with open(path) as f:
            found += [json.loads(line) for line in f]
        os.unlink(path)
    return found


MODE = {"cli": ["--check"], "launch": {"check": True}}  # what each run is under (main sets it per seed)


def _command(label: str, args: list[str], directory: str) -> tuple[str, int, list[dict]]:
    env = dict(os.environ, SHMEMX_DUMP_DIR=directory)
    proc = subprocess.run([sys.executable, "-m", "shmemx", "run", *MODE["cli"], *args], capture_output=True,
                          text=True, env=env)
    return label, proc.returncode, _findings(directory)


def examples(directory: str):
    for script in sorted(glob.glob(os.path.join(EXAMPLES, "*.py"))):
        name = os.path.basename(script)
        if name == "cam_moe_demo.py":
            continue
        extra = ["--timeout", "5"] if name == "hang_demo.py" else []
        if name == "flag_demo.py" and "--check" not in MODE["cli"]:  # (its bug is the point: only the fix)
            yield _command(f"{name} --fixed", ["-n", "2", script, "--fixed"], directory)
            continue
        if name == "flag_demo.py":  # the README's worked example: its bug must be found, its fix clean
            label, code, found = _command(name, ["-n", "2", script], directory)
            kinds = sorted({f["kind"] for f in found})
            yield f"{name} (bug: {', '.join(kinds) or 'NOT FOUND'})", 0 if kinds == ["quiet-wrong-qp"] else 1, []
            yield _command(f"{name} --fixed", ["-n", "2", script, "--fixed"], directory)
            continue
        yield _command(name, ["-n", "4", *extra, script], directory)


def moe(directory: str):
    from shmemx.kernels import moe as moe_pkg

    for policy in moe_pkg.QP_POLICIES:
        yield _command(f"moe_demo.py --policy {policy}", ["-n", "8", os.path.join(EXAMPLES, "moe_demo.py"),
                                                          "--policy", policy], directory)
    for lanes in ("batch", "rounds"):  # 4 channels, 3 of them sharing QP 0: both ways of sharing a lane
        yield _command(f"moe_demo.py --policy two_3_1 --channels 4 --lanes {lanes}",
                       ["-n", "8", os.path.join(EXAMPLES, "moe_demo.py"), "--policy", "two_3_1", "--channels", "4",
                        "--lanes", lanes], directory)


def cam(directory: str):
    demo = os.path.join(EXAMPLES, "cam_moe_demo.py")
    yield _command("cam_moe_demo.py", ["-n", "8", "--heap-size", "440M", demo], directory)


def bench(directory: str):
    import importlib

    from shmemx.launcher import launch

    def checked(*args, **kwargs):
        kwargs.update(MODE["launch"], dump_dir=directory)
        return launch(*args, **kwargs)

    for name, argv in (("bench_rma", ["--quick"]), ("bench_sync", ["--quick"]), ("bench_moe", ["--quick"]),
                       ("bench_cam", ["--quick"])):
        module = importlib.import_module(name)
        module.launch = checked
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                code = module.main(argv) or 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
        yield name, code, _findings(directory)
    from bench_trace import _put_loop

    code = launch(2, _put_loop, (20_000, False), **MODE["launch"], dump_dir=directory, tag_output=False,
                  stdout=io.StringIO(), stderr=io.StringIO())
    yield "bench_trace (put loop)", code, _findings(directory)


def schedules(directory: str):
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    from shmemx.launcher import launch
    from test_schedules import ALL_NAMES, _schedules_job

    for n, server_size in ((8, 4), (16, 4)):
        code = launch(n, _schedules_job, (server_size, ("uniform", "zipf"), ALL_NAMES, 24, 2 * n),
                      **MODE["launch"], dump_dir=directory, heap_size="32M", timeout=900, stdout=io.StringIO(),
                      stderr=io.StringIO())
        yield f"schedules at {n} PEs ({server_size} per server)", code, _findings(directory)


def deep_ep(directory: str):
    try:
        import torch  # noqa: F401 (the ported tests take torch tensors)
    except ImportError:
        print("deep_ep  skipped: torch is not installed (pip install -e '.[torch]')")
        return
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    from test_deep_ep import _CI_SIZES  # the sizes the test suite runs them at (DeepEP's take minutes each here)

    for script, args in _CI_SIZES.items():
        yield _command(script, ["-n", "8", os.path.join(HERE, "deep_ep", script), *args], directory)


PARTS = {"examples": examples, "moe": moe, "cam": cam, "schedules": schedules, "deep_ep": deep_ep, "bench": bench}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=sorted(PARTS), action="append")
    ap.add_argument("--chaos", type=int, default=0, metavar="N", help="run under --chaos 1..N instead of --check")
    ap.add_argument("--first-seed", type=int, default=1, metavar="K",
                    help="with --chaos N: start at seed K (to resume a sweep: --chaos 20 --first-seed 10)")
    args = ap.parse_args(argv)
    bad = 0
    modes = [(f"--chaos {seed}", {"cli": ["--chaos", str(seed)], "launch": {"chaos": seed}})
             for seed in range(args.first_seed, args.chaos + 1)] or [("--check", dict(MODE))]
    with tempfile.TemporaryDirectory(prefix="shmemx_check_kernels_") as directory:
        for (mode, flags), part in ((m, p) for m in modes for p in args.only or list(PARTS)):
            MODE.update(flags)
            for label, code, found in PARTS[part](directory):
                label = f"{label} ({mode})" if args.chaos else label
                errors = [f for f in found if f["severity"] == "error"]
                bad += code not in (0, 124)
                warnings = [f for f in found if f["severity"] != "error"]
                status = "clean" if not errors else f"{len(errors)} FINDING(S)"
                print(f"{part:<9}{label:<52} exit {code:<4} {status}"
                      + (f", {len(warnings)} warning(s)" if warnings else ""), flush=True)
                for f in errors + warnings:
                    print(f"    {f['text'][:400]}")
                bad += bool(errors)
    print(f"{bad} run(s) with findings")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
