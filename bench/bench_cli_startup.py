"""`ffdebug --help` wall time against `python -c pass` (docs/benchmarks.md "Benchmarks"; target < 0.3 s).

Usage: python bench/bench_cli_startup.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def wall(cmd: list[str], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    base = wall([sys.executable, "-c", "pass"], args.repeat)
    help_ = wall([sys.executable, "-m", "ffdebug.cli.app", "--help"], args.repeat)
    torch = wall([sys.executable, "-c", "import torch"], args.repeat)
    print(f"python -c pass        {base:.3f} s")
    print(f"ffdebug --help        {help_:.3f} s   ratio {help_ / base:.1f}x   (target < 0.3 s)")
    print(f"python -c import torch {torch:.3f} s   (what --help avoids)")


if __name__ == "__main__":
    main()
