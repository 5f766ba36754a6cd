"""Benchmark `ffdebug weights-diff` on two large checkpoints: peak RSS and wall time.

Writes two single-file safetensors checkpoints of `--size` GiB each (float32, 64 MiB tensors; the
target equals the reference in half the tensors and is the reference + 1e-3·noise in the other
half, so both the byte-equal fast path and the float64 maths run), then measures, each in its own
process:
- baseline: `import torch, safetensors` (the interpreter floor every process pays);
- read-only: every tensor of both files read once through safetensors (one at a time);
- weights-diff: `ffdebug weights-diff A B --json`.
Peak RSS comes from wait4() of each child. Issue 3's target: peak RSS < 1 GiB on 2 × 2 GiB.

    python bench/bench_weights_diff.py --size 0.05     # smoke
    python bench/bench_weights_diff.py --size 2        # the figure (needs ~4 GiB free in --dir)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

TENSOR_ELEMS = 16 << 20  # 64 MiB of float32 per tensor

READ_ONLY = textwrap.dedent(
    """
    import sys
    from safetensors import safe_open
    total = 0.0
    for path in sys.argv[1:]:
        with safe_open(path, "pt") as f:
            names = list(f.keys())
        for name in names:
            with safe_open(path, "pt") as f:  # one tensor per handle: its mapped pages are released
                total += float(f.get_tensor(name).reshape(-1)[::1024].sum())  # every 4 KiB page
    print(total)
    """
)

WRITE = textwrap.dedent(
    """
    import sys, torch
    from safetensors.torch import save_file
    size, elems, ref_path, tgt_path = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    total = int(size * (1 << 30)) // 4
    g = torch.Generator().manual_seed(0)
    ref, tgt = {}, {}
    i = 0
    while total > 0:
        n = min(elems, total)
        cols = 4096 if n % 4096 == 0 else 1
        t = torch.randn(n // cols, cols, generator=g)
        name = f"model.layers.{i}.mlp.weight"
        ref[name] = t
        tgt[name] = t if i % 2 == 0 else t + 1e-3 * torch.randn(t.shape, generator=g)
        total -= n
        i += 1
    save_file(ref, ref_path)
    del ref
    save_file(tgt, tgt_path)
    print(i)
    """
)


def measure(cmd: list[str]) -> tuple[float, float, int]:
    """(wall seconds, peak RSS MiB, exit code) of one child process."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode not in (0, 1):
        err = proc.stderr.read().decode(errors="replace")
        raise SystemExit(f"{' '.join(cmd)} failed with {proc.returncode}: {err[-2000:]}")
    return wall, usage.ru_maxrss / 1024.0, proc.returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=float, default=0.05, help="GiB per checkpoint (default 0.05: a smoke run)")
    ap.add_argument("--dir", default=None, help="Where to write the checkpoints (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="Keep the checkpoints")
    ap.add_argument("--repeat", type=int, default=3, help="Interleaved runs of each command (median)")
    args = ap.parse_args()

    work = args.dir or tempfile.mkdtemp(prefix="ffdebug-bench-wd-")
    os.makedirs(work, exist_ok=True)
    a, b = os.path.join(work, "ref.safetensors"), os.path.join(work, "target.safetensors")
    py = sys.executable
    env_threads = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    os.environ.update(env_threads)
    try:
        t0 = time.perf_counter()
        out = subprocess.run(
            [py, "-c", WRITE, str(args.size), str(TENSOR_ELEMS), a, b], check=True, capture_output=True
        )
        n = int(out.stdout.decode().strip())
        gib = os.path.getsize(a) / (1 << 30)
        print(f"wrote 2 × {gib:.2f} GiB ({n} tensors each) in {time.perf_counter() - t0:.1f} s to {work}")

        base_wall, base_rss, _ = measure([py, "-c", "import torch, safetensors"])
        # Interleaved repeats: this machine's page cache is reclaimed in the background, so a
        # single run of either command can pay for disk reads the other did not.
        reads, diffs = [], []
        for _ in range(args.repeat):
            reads.append(measure([py, "-c", READ_ONLY, a, b]))
            diffs.append(measure([py, "-m", "ffdebug.cli.app", "weights-diff", a, b, "--json"]))
        read_wall = statistics.median(r[0] for r in reads)
        diff_wall = statistics.median(d[0] for d in diffs)
        read_rss = max(r[1] for r in reads)
        diff_rss = max(d[1] for d in diffs)
        code = diffs[-1][2]
        print(
            f"{'median of ' + str(args.repeat):26s}{'wall s':>9s}{'peak RSS MiB':>14s}{'over baseline':>15s}"
        )
        print(f"{'baseline (import torch)':26s}{base_wall:9.2f}{base_rss:14.0f}{0:15.0f}")
        print(f"{'read-only (safetensors)':26s}{read_wall:9.2f}{read_rss:14.0f}{read_rss - base_rss:15.0f}")
        print(f"{'ffdebug weights-diff':26s}{diff_wall:9.2f}{diff_rss:14.0f}{diff_rss - base_rss:15.0f}")
        print(
            f"walls: read-only {[round(r[0], 2) for r in reads]}, weights-diff {[round(d[0], 2) for d in diffs]}"
        )
        print(
            f"weights-diff exit {code}; wall {diff_wall / read_wall:.2f}× the read-only script; "
            f"{2 * gib / diff_wall:.2f} GiB/s over both sides incl. start-up; peak RSS {diff_rss:.0f} MiB "
            f"({'under' if diff_rss < 1024 else 'OVER'} the 1 GiB target)"
        )
    finally:
        if not args.keep:
            for p in (a, b):
                if os.path.exists(p):
                    os.remove(p)
            if args.dir is None:
                shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
