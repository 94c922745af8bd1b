"""RMARaceBench's SHMEM cases under ``--check``: precision and recall, beside the published figures.

    python scripts/rma_corpus.py                       # both sets, 3 runs each: the table and the missed cases
    python scripts/rma_corpus.py --set holdout --runs 3
    python scripts/rma_corpus.py --set tune --only sync/0 --runs 1 -v   # some cases, with their findings

Each case of ``tests/rma_cases.py`` (the tuning set: the benchmark's conflict, atomic and sync cases ported) and
``tests/rma_holdout.py`` (the hold-out set: cases of the same classes written apart and never tuned against) runs
under ``--check`` ``--runs`` times. A run's verdict is "race" when ``--check`` reported at least one finding of
severity error, "safe" when it reported none (warnings do not count), and "error" when the job failed for
another reason (then it counts against the case as a wrong verdict). A case whose verdicts differ between its
runs is listed as unstable. Precision = TP / (TP + FP), recall = TP / (TP + FN) over the cases' first run.

Exit status 1 when a hold-out bar is missed (precision .98, recall .94, every case stable).
"""

from __future__ import annotations

import argparse
import glob
import io
import json
import os
import sys
import tempfile
from typing import NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

PUBLISHED = [  # RMARaceBench's SHMEM cases (reference/sanitizer.md): tool, TP, TN, FP, FN
    ("RMASanitizer (ICPP'24), RMARaceBench SHMEM", 59, 38, 1, 4),
]
PUBLISHED_TEXT = ("MUST-RMA has no SHMEM figures (it checks MPI RMA: on RMARaceBench's MPI cases TP 42, TN 43, "
                  "FP 1, FN 21, precision .98, recall .67)")


class CaseRun(NamedTuple):
    """One ``--check`` run of a case: its verdict, the findings (the check's JSON lines), exit status, output."""

    verdict: str  # "race" (an error finding), "safe" (none) or "error" (the job failed otherwise)
    found: list[dict]
    code: int
    out: str
    err: str

    def report(self) -> str:
        return f"{self.verdict}, exit {self.code}\n--- stdout ---\n{self.out}\n--- stderr ---\n{self.err}"


def run_case(case, directory: str, timeout: float = 60.0) -> CaseRun:
    """One ``--check`` run of a case, its findings read from the JSON lines the check wrote into ``directory``
    (and removed from there)."""
    from shmemx.launcher import launch

    out, err = io.StringIO(), io.StringIO()
    code = launch(case.n_pes, case.body, (), check=True, dump_dir=directory, timeout=timeout, stdout=out,
                  stderr=err)
    found = []
    for path in glob.glob(os.path.join(directory, "shmemx-check-*.jsonl")):
        with open(path) as f:
            found += [json.loads(line) for line in f]
        os.unlink(path)
    errors = [f for f in found if f["severity"] == "error"]
    if code not in (0, 3):
        verdict = "error"
    else:
        verdict = "race" if errors else "safe"
    return CaseRun(verdict, found, code, out.getvalue(), err.getvalue())


def signature(found: list[dict]) -> tuple:
    """What must not change between runs of one program: the kinds and allocations of its error findings."""
    return tuple(sorted({(f["kind"], f["allocation"] or "") for f in found if f["severity"] == "error"}))


def run_set(cases, runs: int, directory: str, verbose: bool = False) -> list[dict]:
    rows = []
    for case in cases:
        verdicts, sigs = [], []
        for _ in range(runs):
            run = run_case(case, directory)
            verdicts.append(run.verdict)
            sigs.append(signature(run.found))
            if verbose:
                print(f"  {case.name}: {run.verdict} (exit {run.code}) {[f['kind'] for f in run.found]}")
                if run.verdict == "error":
                    print(run.err[-2000:])
        rows.append({"case": case, "verdicts": verdicts, "signatures": sigs})
    return rows


def score(rows) -> dict:
    tp = tn = fp = fn = 0
    for row in rows:
        got, want = row["verdicts"][0], row["case"].label
        if want == "race":
            tp += got == "race"
            fn += got != "race"
        else:
            tn += got == "safe"
            fp += got != "safe"
    precision = tp / (tp + fp) if tp + fp else 1.0
    recall = tp / (tp + fn) if tp + fn else 1.0
    unstable = [r["case"].name for r in rows if len(set(r["verdicts"])) > 1]
    moved = [r["case"].name for r in rows if len(set(r["signatures"])) > 1]
    return dict(tp=tp, tn=tn, fp=fp, fn=fn, precision=precision, recall=recall, unstable=unstable, moved=moved)


def print_table(results: dict, runs: int) -> None:
    print(f"{'set':<58}{'cases':>6}{'TP':>5}{'TN':>5}{'FP':>5}{'FN':>5}{'precision':>11}{'recall':>8}"
          f"{'stable':>9}")
    for name, (rows, s) in results.items():
        stable = f"{len(rows) - len(s['unstable'])}/{len(rows)}"
        print(f"{'shmemx --check, ' + name + f' ({runs} runs)':<58}{len(rows):>6}{s['tp']:>5}{s['tn']:>5}"
              f"{s['fp']:>5}{s['fn']:>5}{s['precision']:>11.3f}{s['recall']:>8.3f}{stable:>9}")
    for tool, tp, tn, fp, fn in PUBLISHED:
        print(f"{tool:<58}{tp + tn + fp + fn:>6}{tp:>5}{tn:>5}{fp:>5}{fn:>5}{tp / (tp + fp):>11.3f}"
              f"{tp / (tp + fn):>8.3f}{'':>9}")
    print(PUBLISHED_TEXT)


def print_misses(results: dict) -> None:
    for name, (rows, s) in results.items():
        wrong = [r for r in rows if r["verdicts"][0] != r["case"].label]
        if wrong:
            print(f"\n{name}: wrong verdicts")
        for r in wrong:
            print(f"  {r['case'].name}: labelled {r['case'].label}, got {r['verdicts'][0]}"
                  f"{' (' + r['case'].note + ')' if r['case'].note else ''}")
        if s["unstable"]:
            print(f"{name}: verdicts that moved between runs: {', '.join(s['unstable'])}")
        if s["moved"]:
            print(f"{name}: findings (kind, allocation) that moved between runs: {', '.join(s['moved'])}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", choices=["tune", "holdout", "both"], default="both")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--only", default="", help="run only the cases whose name contains this")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    import rma_cases
    sets = {}
    if args.set in ("tune", "both"):
        sets["tuning set (RMARaceBench ported)"] = rma_cases.CASES
    if args.set in ("holdout", "both"):
        import rma_holdout
        sets["hold-out set"] = rma_holdout.CASES
    results = {}
    with tempfile.TemporaryDirectory() as directory:
        for name, cases in sets.items():
            cases = [c for c in cases if args.only in c.name]
            rows = run_set(cases, args.runs, directory, args.verbose)
            results[name] = (rows, score(rows))
    print_table(results, args.runs)
    print_misses(results)
    hold = results.get("hold-out set")
    if hold is not None:
        s = hold[1]
        if s["precision"] < 0.98 or s["recall"] < 0.94 or s["unstable"]:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
