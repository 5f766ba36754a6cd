"""Compare two ~SIZE stores against simply reading them (README "Benchmarks").

Writes two stores (ref, target = ref + small noise) of `--size` bytes of fp32 each, in tensors of
`--tensor-mb`, then measures as whole processes:
  baseline  a script that reads both stores with safetensors and touches every page
  compare   `ffdebug compare REF TARGET --json`
and prints wall-time ratio (target ≤ 1.5× the baseline), throughput relative to read speed (≥ 0.5),
peak RSS (target ≤ 600 MiB at 1 GiB, ≤ 3 × largest tensor + 300 MB) and the in-process metric
throughput (target ≥ 4 GB/s).

Usage: python bench/bench_compare.py --size 1GiB      (smoke: --size 64MiB)
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

READ_ONLY = r"""
import sys, glob, json, os
from safetensors import safe_open
total = 0.0
for side in sys.argv[1:]:
    for path in sorted(glob.glob(os.path.join(side, "rank*", "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            for k in f.keys():
                t = f.get_tensor(k)
                total += float(t.reshape(-1)[:: 1024].sum())  # touch every page
print(total)
"""


def parse_size(s: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMG]i?B)?", s.strip(), re.I)
    if not m:
        raise SystemExit(f"--size {s!r}: use e.g. 64MiB or 1GiB")
    mult = {"kib": 1 << 10, "kb": 1000, "mib": 1 << 20, "mb": 10**6, "gib": 1 << 30, "gb": 10**9}
    return int(float(m.group(1)) * mult.get((m.group(2) or "b").lower(), 1))


def run(cmd: list[str]) -> tuple[float, int]:
    """Wall time and peak RSS (bytes) of a child process."""
    t = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, _, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    return wall, ru.ru_maxrss * 1024


MAKE_STORES = r"""
import sys
sys.path.insert(0, sys.argv[4])
from bench_compare import make_stores
print(make_stores(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
"""


def make_stores(root: str, size: int, tensor_mb: int) -> int:
    import torch

    import ffdebug

    numel = tensor_mb * (1 << 20) // 4
    count = max(1, size // (numel * 4))
    g = torch.Generator().manual_seed(0)
    for side, noise in (("ref", 0.0), ("target", 1e-4)):
        g.manual_seed(0)
        with ffdebug.capture(None, dir=root, side=side):
            for i in range(count):
                x = torch.randn(numel, generator=g)
                if noise:
                    x = x + noise * torch.randn(numel, generator=torch.Generator().manual_seed(i))
                ffdebug.tap(f"t{i:04d}", x)
    return numel * 4


def metric_throughput(numel: int) -> float:
    import torch

    from ffdebug.compare.metrics import compare_tensors

    a = torch.randn(numel)
    b = a + 1e-4
    compare_tensors(a[: 1 << 16], b[: 1 << 16])
    t = time.perf_counter()
    compare_tensors(a, b)
    return 2 * a.numel() * 4 / (time.perf_counter() - t) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="64MiB", help="bytes per store (1GiB for the figure)")
    ap.add_argument("--tensor-mb", type=int, default=64, help="size of each tensor in MiB")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    size = parse_size(args.size)
    root = tempfile.mkdtemp(prefix="ffdebug-bench-")
    try:
        # Stores are written by a child process: a forked child inherits its parent's peak RSS,
        # so this process must stay small for the children's ru_maxrss to mean anything.
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                MAKE_STORES,
                root,
                str(size),
                str(min(args.tensor_mb, max(1, size >> 20))),
                os.path.dirname(os.path.abspath(__file__)),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        largest = int(out.stdout.strip().splitlines()[-1])
        ref, tgt = os.path.join(root, "ref"), os.path.join(root, "target")
        subprocess.run(["sync"], check=False)
        run([sys.executable, "-c", READ_ONLY, ref, tgt])  # warm the page cache
        base_t, base_rss = run([sys.executable, "-c", READ_ONLY, ref, tgt])
        cmp_t, cmp_rss = run([sys.executable, "-m", "ffdebug.cli.app", "compare", ref, tgt, "--json"])
        gbps = metric_throughput(min(largest // 4, 64 << 20))
        mib = 1 << 20
        print(f"stores: 2 x {size / mib:.0f} MiB, largest tensor {largest / mib:.0f} MiB")
        print(f"read-only baseline   {base_t:6.2f} s   peak RSS {base_rss / mib:7.1f} MiB")
        print(f"ffdebug compare      {cmp_t:6.2f} s   peak RSS {cmp_rss / mib:7.1f} MiB")
        print(f"wall ratio           {cmp_t / base_t:6.2f}x  (target <= 1.5x)")
        print(f"throughput vs read   {base_t / cmp_t:6.2f}   (target >= 0.5)")
        print(
            f"peak RSS             {cmp_rss / mib:6.0f} MiB = {cmp_rss / largest:.2f} x largest tensor "
            f"(target <= 3 x largest + 300 MB; <= 600 MiB at 1 GiB)"
        )
        print(f"metric maths         {gbps:6.2f} GB/s in-process (target >= 4 GB/s)")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
