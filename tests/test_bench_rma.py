"""scripts/bench_rma.py runs (its --quick smoke mode) and prints its one table with every row.

The bars are printed, not asserted, here: a smoke run's numbers on a shared 2-core machine are rough. Run the full
benchmark (``python scripts/bench_rma.py --check``) to check them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "scripts" / "bench_rma.py"
ROWS = ["put 64 B (x256) + quiet", "put 4 KiB (x256) + quiet", "put 1 MiB (x16) + quiet", "put 16 MiB (x1) + quiet",
        "(put 1 MiB + quiet) x16", "(put 16 MiB + quiet) x1",
        "64 B qp_put_nbi loop, quiet/1024, 1 sender", "64 B put_nbi local->heap rows, quiet/1024, 1 sender",
        "64 B defer/submit, batches of 1024, 1 sender", "64 B raw path, batches of 4096, 1 sender",
        "put_signal -> wait_until, half round trip"]


def test_bench_rma_quick_prints_one_table():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHMEMX_")}
    proc = subprocess.run([sys.executable, str(BENCH), "--quick"], env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("shmemx bench_rma (quick run") and "load average" in lines[0]
    table = lines[lines.index(next(line for line in lines if line.startswith("measurement"))) + 2:]
    assert [line[:56].rstrip() for line in table] == ROWS, proc.stdout
    for line in table:  # every row: a median with its range beside the reference's, and the ratio
        assert len(re.findall(r"\d[\d.,]*k? \[", line)) == 2 and re.search(r" \d+\.\d\dx ", line), line
    for line in table:
        if line.startswith(("put 1 MiB", "put 16 MiB")):
            assert ">= 0.8x copyto" in line and line.rstrip().endswith(("PASS", "FAIL")), line
        if "qp_put_nbi loop" in line:
            assert ">= 150k WQE/s" in line and line.rstrip().endswith(("PASS", "FAIL")), line
        if "raw path" in line:
            assert ">= 2M WQE/s" in line and line.rstrip().endswith(("PASS", "FAIL")), line
        if "local->heap rows" in line:
            assert ">= 370k WQE/s" in line and line.rstrip().endswith(("PASS", "FAIL")), line
        if "put_signal" in line:
            assert "<= 5 us" in line and line.rstrip().endswith(("PASS", "FAIL")), line
    assert "peer columns skipped (not requested): shmem4py, mpi" in proc.stdout  # a quick run measures no peers
    assert proc.stderr == ""
