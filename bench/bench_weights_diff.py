"""Benchmark `ffdebug weights-diff` on two large checkpoints: peak RSS and wall time.

Writes two single-file safetensors checkpoints of `--size` GiB each (float32, 64 MiB tensors; the
target equals the reference in half the tensors and is the reference + 1e-3·noise in the other
half, so both the byte-equal fast path and the float64 maths run) and two small ones (16 KiB tensors),
then measures, each in its own process, interleaved:
- baseline: `import numpy` (the interpreter floor every process pays);
- read-only: every tensor of both files mapped with numpy and every 4 KiB page touched
  (`bench/floors.py`, as the next);
- floor64: the float64 compute floor: every tensor pair read in 64 Ki-element chunks converted to
  float64, one dot product per pair, on as many forked workers as weights-diff uses; and on the
  small pair (its start-up);
- weights-diff: `ffdebug weights-diff A B --json`, and on the small pair.
Peak RSS comes from wait4() of each child. Targets: past start-up, (weights-diff - its small run)
<= 2 x (floor64 - its small run); peak RSS < 1 GiB.

    python bench/bench_weights_diff.py --size 0.05     # smoke
    python bench/bench_weights_diff.py --size 4        # the figure (needs ~8 GiB free in --dir)
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

FLOORS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "floors.py")  # numpy only

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
    ap.add_argument(
        "--workers",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="workers of weights-diff and the float64 floor alike (default: this process's cores)",
    )
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

        small_a, small_b = (
            os.path.join(work, "small-ref.safetensors"),
            os.path.join(work, "small-target.safetensors"),
        )
        subprocess.run([py, "-c", WRITE, "0.0001", "4096", small_a, small_b], check=True, capture_output=True)
        workers = str(args.workers)
        os.environ["OPENBLAS_NUM_THREADS"] = "1"  # the floors' dot products, as ffdebug's
        cmds = {
            "baseline (import numpy)": [py, "-c", "import numpy"],
            "read-only (numpy maps)": [py, FLOORS, "read", a, b],
            "floor64": [py, FLOORS, "float64", workers, a, b],
            "floor64, small pair": [py, FLOORS, "float64", workers, small_a, small_b],
            "ffdebug weights-diff": [
                py,
                "-m",
                "ffdebug.cli.app",
                "weights-diff",
                a,
                b,
                "--json",
                "--workers",
                workers,
            ],
            "weights-diff, small pair": [
                py,
                "-m",
                "ffdebug.cli.app",
                "weights-diff",
                small_a,
                small_b,
                "--json",
            ],
        }
        # Interleaved repeats: this machine's page cache is reclaimed in the background, so a
        # single run of either command can pay for disk reads the other did not.
        runs: dict[str, list] = {k: [] for k in cmds}
        for _ in range(args.repeat):
            for name, cmd in cmds.items():
                runs[name].append(measure(cmd))
        wall = {k: statistics.median(r[0] for r in v) for k, v in runs.items()}
        rss = {k: max(r[1] for r in v) for k, v in runs.items()}
        print(f"{'median of ' + str(args.repeat):28s}{'wall s':>9s}{'peak RSS MiB':>14s}   walls")
        for name in cmds:
            print(f"{name:28s}{wall[name]:9.2f}{rss[name]:14.0f}   {[round(r[0], 2) for r in runs[name]]}")
        past = (wall["ffdebug weights-diff"] - wall["weights-diff, small pair"]) / (
            wall["floor64"] - wall["floor64, small pair"]
        )
        diff_rss = rss["ffdebug weights-diff"]
        print(
            f"past start-up: (weights-diff - small) / (floor64 - small) {past:.2f}x (target <= 2; "
            f"{workers} workers each); weights-diff / read-only {wall['ffdebug weights-diff'] / wall['read-only (numpy maps)']:.2f}x; "
            f"{2 * gib / wall['ffdebug weights-diff']:.2f} GiB/s over both sides incl. start-up; peak RSS "
            f"{diff_rss:.0f} MiB ({'under' if diff_rss < 1024 else 'OVER'} the 1 GiB target); exit "
            f"{runs['ffdebug weights-diff'][-1][2]}"
        )
    finally:
        if not args.keep:
            for p in (
                a,
                b,
                os.path.join(work, "small-ref.safetensors"),
                os.path.join(work, "small-target.safetensors"),
            ):
                if os.path.exists(p):
                    os.remove(p)
            if args.dir is None:
                shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
