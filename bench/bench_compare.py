"""`ffdebug compare` and `ffdebug bisect` against read and compute floors (docs/benchmarks.md "Benchmarks").

Writes two stores (ref, target = ref + small noise) of `--size` bytes of fp32 each, as layer stages
`L{i}.hidden_out`, in one of two layouts:
  uniform  `--count` tensors of equal size (default 200: 1 GiB = 200 x 5.1 MiB)
  mixed    `--count` tensors from 4 KiB to 64 MiB (sizes 4 KiB x 16384^(u^p), u in [0, 1], p chosen
           so the sizes add up to `--size`; shuffled with a fixed seed)
each 1-D, or with `--width W` shaped [1, tokens, W] like a layer's hidden states (so compare also
breaks the error down per token), plus a 2-stage store (`bench_analysis_startup.two_stage_store`),
then measures, each as a whole process, interleaved `--repeat` times (medians; peak RSS = max).
Every floor (`bench/floors.py`) reads the payloads as numpy arrays over a mapping of the file (no
torch, no ffdebug):
  floor      touches every 4 KiB page of every payload of both stores (1/1024 of the values read)
  sum-all    sums every value (every byte through the CPU once, one thread), for reference
  floor64    the float64 compute floor: every payload pair read chunk by chunk (64 Ki elements),
             each chunk converted to float64 and one dot product taken per pair, on as many forked
             workers as compare is given (`--workers`, default one per core)
  floor64-2  the same on the 2-stage store (its start-up)
  naive      a loop that loads each pair and computes whole-tensor float64 cos, rel and max |a - b|
  compare    `ffdebug compare REF TARGET --json`, and `compare-2` on the 2-stage store
  bisect     `ffdebug bisect REF TARGET --json`
and prints past start-up (compare - compare-2) / (floor64 - floor64-2) (target <= 2), compare-2
(target < 1 s idle), compare / floor, compare / naive, peak RSS (<= 600 MiB), bisect / compare
(<= 1.15), and the in-process metric maths (both fp32 inputs counted, one thread) in wall time
and in thread CPU time (a shared machine steals wall time).

Usage: python bench/bench_compare.py --size 4GiB                     (smoke: --size 64MiB --count 20)
       python bench/bench_compare.py --size 1GiB --layout mixed --count 2000
       python bench/bench_compare.py --size 1GiB --width 4096              (3-D layer stages)
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FLOORS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "floors.py")  # numpy only

MAKE_STORES = r"""
import sys
sys.path.insert(0, sys.argv[5])
from bench_compare import make_stores
print(make_stores(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[6])))
"""


def parse_size(s: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMG]i?B)?", s.strip(), re.I)
    if not m:
        raise SystemExit(f"--size {s!r}: use e.g. 64MiB or 1GiB")
    mult = {"kib": 1 << 10, "kb": 1000, "mib": 1 << 20, "mb": 10**6, "gib": 1 << 30, "gb": 10**9}
    return int(float(m.group(1)) * mult.get((m.group(2) or "b").lower(), 1))


def tensor_numels(size: int, count: int, layout: str) -> list[int]:
    """Element counts of the `count` tensors of one store (fp32)."""
    if layout == "uniform":
        return [max(1, size // count // 4)] * count
    lo, hi = 4 << 10, 64 << 20
    if count * lo > size:
        raise SystemExit(f"--size too small for {count} tensors of at least 4 KiB")
    us = [k / max(count - 1, 1) for k in range(count)]

    def sizes(p: float) -> list[int]:
        return [int(lo * (hi / lo) ** (u**p)) // 4 * 4 for u in us]

    a, b = 0.01, 100.0  # total(p) falls as p grows
    for _ in range(60):
        p = (a * b) ** 0.5
        a, b = (p, b) if sum(sizes(p)) > size else (a, p)
    import random

    out = [s // 4 for s in sizes(b)]
    random.Random(0).shuffle(out)
    return out


def make_stores(root: str, size: int, count: int, layout: str, width: int = 0) -> str:
    import torch

    import ffdebug

    numels = tensor_numels(size, count, layout)
    if width:  # whole rows of `width` channels, at least one
        numels = [max(width, n // width * width) for n in numels]
    for side, noise in (("ref", 0.0), ("target", 1e-4)):
        g = torch.Generator().manual_seed(0)
        with ffdebug.capture(None, dir=root, side=side):
            ffdebug.tap("embed.input_ids", torch.tensor([[1, 2, 3]]), input_ids=True)
            for i, n in enumerate(numels):
                x = torch.randn(n, generator=g)
                if noise:
                    x = x + noise * torch.randn(n, generator=torch.Generator().manual_seed(i))
                ffdebug.tap(f"L{i:04d}.hidden_out", x.reshape(1, -1, width) if width else x, layer=i)
    return f"{len(numels)} {min(numels) * 4} {max(numels) * 4} {sum(numels) * 4}"


def measure(cmd: list[str]) -> tuple[float, int, float]:
    """Wall time, peak RSS (bytes) and CPU seconds (user + system) of a child process."""
    t = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    code = os.waitstatus_to_exitcode(status)
    if code not in (0, 1, 4):
        raise SystemExit(f"{' '.join(cmd[:4])} failed with {code}: {p.stderr.read().decode()[-2000:]}")
    return wall, ru.ru_maxrss * 1024, ru.ru_utime + ru.ru_stime


def metric_throughput(numel: int, repeat: int) -> tuple[float, float]:
    """(wall GB/s, thread-CPU GB/s) of `compare_tensors` on two in-memory fp32 arrays (medians)."""
    import numpy as np

    from ffdebug.comparison.metrics import compare_tensors

    rng = np.random.default_rng(0)
    a = rng.standard_normal(numel, dtype=np.float32)
    b = a + np.float32(1e-4) * rng.standard_normal(numel, dtype=np.float32)
    compare_tensors(a[: 1 << 16], b[: 1 << 16])
    walls, cpus = [], []
    for _ in range(repeat):
        t, c = time.perf_counter(), time.thread_time()
        compare_tensors(a, b)
        walls.append(time.perf_counter() - t)
        cpus.append(time.thread_time() - c)
    nbytes = 2 * numel * 4
    return nbytes / statistics.median(walls) / 1e9, nbytes / statistics.median(cpus) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="64MiB", help="bytes per store (1GiB for the figure)")
    ap.add_argument("--count", type=int, default=200, help="tensors per store")
    ap.add_argument("--layout", choices=("uniform", "mixed"), default="uniform")
    ap.add_argument("--width", type=int, default=0, help="shape tensors [1, tokens, WIDTH] (0: 1-D)")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved runs of each command (median)")
    ap.add_argument("--no-bisect", action="store_true")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument(
        "--workers",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="workers of compare, bisect and the float64 floor alike (default: this process's cores)",
    )
    args = ap.parse_args()
    size = parse_size(args.size)
    root = tempfile.mkdtemp(prefix="ffdebug-bench-")
    py = sys.executable
    try:
        # Stores are written by a child process: a forked child inherits its parent's peak RSS,
        # so this process must stay small for the children's ru_maxrss to mean anything.
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(
            [py, "-c", MAKE_STORES, root, str(size), str(args.count), args.layout, here, str(args.width)],
            check=True,
            capture_output=True,
            text=True,
        )
        count, smallest, largest, total = map(int, out.stdout.strip().splitlines()[-1].split())
        ref, tgt = os.path.join(root, "ref"), os.path.join(root, "target")
        subprocess.run(["sync"], check=False)
        measure([py, FLOORS, "read", ref, tgt])  # warm the page cache
        from bench_analysis_startup import two_stage_store

        small = os.path.join(root, "small")
        small_ref = str(two_stage_store(Path(small) / "ref", 0.0))
        small_tgt = str(two_stage_store(Path(small) / "target", 1e-3))
        workers = str(args.workers)
        os.environ["OPENBLAS_NUM_THREADS"] = "1"  # every child's dot products on one BLAS thread
        cmds = {
            "floor": [py, FLOORS, "read", ref, tgt],
            "sum-all": [py, FLOORS, "sum", ref, tgt],
            "floor64": [py, FLOORS, "float64", workers, ref, tgt],
            "floor64-2": [py, FLOORS, "float64", workers, small_ref, small_tgt],
            "naive": [py, FLOORS, "naive", ref, tgt],
            "compare": [py, "-m", "ffdebug.cli.app", "compare", ref, tgt, "--json", "--workers", workers],
            "compare-2": [
                py,
                "-m",
                "ffdebug.cli.app",
                "compare",
                small_ref,
                small_tgt,
                "--json",
                "--workers",
                workers,
            ],
        }
        if not args.no_bisect:
            cmds["bisect"] = [py, "-m", "ffdebug.cli.app", "bisect", ref, tgt, "--json"]
        runs: dict[str, list[tuple[float, int, float]]] = {k: [] for k in cmds}
        for _ in range(args.repeat):
            for name, cmd in cmds.items():
                runs[name].append(measure(cmd))
        wall = {k: statistics.median(w for w, _, _ in v) for k, v in runs.items()}
        rss = {k: max(r for _, r, _ in v) for k, v in runs.items()}
        cpu = {k: statistics.median(c for _, _, c in v) for k, v in runs.items()}
        gbps, gbps_cpu = metric_throughput(min(largest // 4, 16 << 20), max(3, args.repeat))
        mib = 1 << 20
        print(
            f"stores: 2 x {total / mib:.0f} MiB, {count} fp32 tensors ({args.layout}"
            f"{f', [1, tokens, {args.width}]' if args.width else ''}, "
            f"{smallest / 1024:.0f} KiB .. {largest / mib:.1f} MiB); medians of {args.repeat} interleaved runs"
        )
        for name in cmds:
            walls = ", ".join(f"{w:.2f}" for w, _, _ in runs[name])
            print(
                f"{name:10s} {wall[name]:7.2f} s   CPU {cpu[name]:7.2f} s   peak RSS {rss[name] / mib:7.1f} MiB"
                f"   (walls {walls})"
            )
        past = (wall["compare"] - wall["compare-2"]) / (wall["floor64"] - wall["floor64-2"])
        print(
            f"past start-up: (compare - compare of 2 stages) / (float64 floor - its 2-stage run) "
            f"{past:6.2f}x  (target <= 2; {workers} workers each)"
        )
        print(f"compare of 2 stages    {wall['compare-2']:6.2f} s  (target < 1 s idle)")
        print(
            f"compare / read floor   {wall['compare'] / wall['floor']:6.2f}x wall, "
            f"{cpu['compare'] / cpu['floor']:.2f}x CPU  (target <= 1.25)"
        )
        print(
            f"compare / sum-all      {wall['compare'] / wall['sum-all']:6.2f}x wall, "
            f"{cpu['compare'] / cpu['sum-all']:.2f}x CPU  (one fp32 pass over every byte: no target)"
        )
        print(
            f"compare / naive loop   {wall['compare'] / wall['naive']:6.2f}x wall, "
            f"{cpu['compare'] / cpu['naive']:.2f}x CPU  (target <= 0.5)"
        )
        print(f"compare peak RSS       {rss['compare'] / mib:6.0f} MiB (target <= 600 MiB)")
        if "bisect" in wall:
            print(
                f"bisect / compare       {wall['bisect'] / wall['compare']:6.2f}x wall, "
                f"{cpu['bisect'] / cpu['compare']:.2f}x CPU  (target <= 1.15)"
            )
        print(f"metric maths           {gbps:6.2f} GB/s wall, {gbps_cpu:.2f} GB/s thread CPU (target >= 4)")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
