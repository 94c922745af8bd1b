"""Time one benchmark under two installs of shmemx, alternately, in one run: before and after a change.

    flock /tmp/shmemx-heavy.lock python scripts/ab_compare.py --before /path/to/old/venv/bin/python \\
        --repeat 5 -- scripts/one_path.py --modes plain --rounds 1

Runs ``PYTHON SCRIPT ARGS`` with the ``--before`` interpreter and with ``--after`` (default: this one), one
after the other, ``--repeat`` times (the machine's drift cancels out of each pair), reads the number after
``--pattern`` (a regular expression with one group; default: the plain row of scripts/one_path.py's timing table,
in ms) from each output, and prints each pair, the median of each side and the paired ratio after / before.
The script path is this checkout's, so both installs run the same benchmark code.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys


def measure(python: str, command: list[str], pattern: str) -> float:
    done = subprocess.run([python] + command, capture_output=True, text=True, timeout=3600)
    found = re.search(pattern, done.stdout, re.M)
    if done.returncode not in (0, 1) or found is None:
        sys.exit(f"{python} {' '.join(command)}: exit {done.returncode}, no match for {pattern!r}\n"
                 f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return float(found.group(1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the python of the install before the change")
    ap.add_argument("--after", default=sys.executable, help="the python of the install after (default: this one)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--pattern", default=r"^plain\s+([\d.]+)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS...")
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    pairs = []
    for k in range(args.repeat):
        b = measure(args.before, command, args.pattern)
        a = measure(args.after, command, args.pattern)
        pairs.append((b, a))
        print(f"pair {k + 1}: before {b:.3f}, after {a:.3f}, after / before {a / b:.3f}", flush=True)
    ratios = [a / b for b, a in pairs]
    print(f"\nmedian before {statistics.median(b for b, _ in pairs):.3f}, after {statistics.median(a for _, a in pairs):.3f}; "
          f"paired after / before: median {statistics.median(ratios):.3f}, geometric mean "
          f"{statistics.geometric_mean(ratios):.3f} over {len(pairs)} pairs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
