"""scripts/bench_sync.py runs (its --quick smoke mode) and prints its one table with every row.

The bars themselves are not asserted here: on a shared 2-core machine a smoke run's numbers are rough. Run the
full benchmark (``python scripts/bench_sync.py --check``) to check them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "scripts" / "bench_sync.py"
ROWS = ["start-up + exit, 8 ranks, empty script", "start-up + exit, 32 ranks, empty script", "barrier_all, 2 ranks",
        "barrier_all, 8 ranks", "barrier_all, 16 ranks", "signal ping-pong round trip, 2 ranks",
        "signal ring, per hop, 8 ranks"]


def test_bench_sync_quick_prints_one_table():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHMEMX_")}
    proc = subprocess.run([sys.executable, str(BENCH), "--quick"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("shmemx bench_sync (quick run") and lines[1].startswith("measurement")
    assert [line[:42].rstrip() for line in lines[3:]] == ROWS, proc.stdout
    for line in lines[3:]:
        assert " s [" in line or " us [" in line, line  # a median and its range
    for line in lines[-2:]:  # the signal rows stand beside the raw futex primitive, with the ratio
        assert line.count(" us [") == 2 and "x  <= 1.5x raw" in line, line
    assert proc.stderr == ""
