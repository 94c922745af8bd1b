"""The bug corpus under ``--check`` with many chaos seeds: the findings must not depend on the timing.

    flock /tmp/shmemx-heavy.lock python scripts/check_corpus.py              # seeds 1..20
    python scripts/check_corpus.py --seeds 3                                  # a shorter run

Every buggy kernel of ``tests/check_corpus.py`` runs under ``--check --chaos SEED`` for each seed (the seeded
jitter of kernel threads at waits, quiets, barriers and signal_op moves their timing around), and so does its
correct twin. A line per class: in how many seeds the buggy kernel was reported with its kind and allocation, and
in how many the twin was clean and correct. Exit status 1 unless every buggy run is reported and every twin is
clean. (The engine's side of chaos, which makes the buggy kernels compute wrong results, comes with the engine's
scheduler policy.)
"""

from __future__ import annotations

import argparse
import glob
import io
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from check_corpus import CASES  # noqa: E402


def _run(n: int, body, seed: int, directory: str) -> tuple[int, list[dict]]:
    from shmemx.launcher import launch

    code = launch(n, body, (), check=True, chaos=seed, dump_dir=directory, timeout=120, stdout=io.StringIO(),
                  stderr=io.StringIO())
    found = []
    for path in glob.glob(os.path.join(directory, "shmemx-check-*.jsonl")):
        with open(path) as f:
            found += [json.loads(line) for line in f]
        os.unlink(path)
    return code, found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=20)
    args = ap.parse_args(argv)
    seeds = range(1, args.seeds + 1)
    ok = True
    print(f"{'class':<52}{'bug reported':>14}{'twin clean':>12}")
    with tempfile.TemporaryDirectory(prefix="shmemx_check_corpus_") as directory:
        for case in CASES:
            reported = clean = 0
            for seed in seeds:
                code, found = _run(case.n_pes, case.bug, seed, directory)
                reported += code == case.code and any(
                    f["kind"] == case.kind and (f["allocation"] or "") == case.allocation for f in found)
                code, found = _run(case.n_pes, case.twin, seed, directory)
                clean += code == 0 and not found
            n = len(seeds)
            ok &= reported == n and clean == n
            print(f"{case.name:<52}{reported:>10}/{n:<3}{clean:>8}/{n:<3}", flush=True)
    print("every buggy run reported, every twin clean" if ok else "MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
