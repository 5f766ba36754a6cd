"""Step time of the reference trainer's GRPO on two CPU ranks (DDP over gloo) against one rank, as a ratio.

    python bench/bench_ddp_step.py [--short 4] [--long 44] [--config examples/grpo/full/sd3_tiny/default.yaml]

Both sides train the same global batch from the same fixture: one process with the config's
``prompts_per_iteration`` P (``backend.kind single``), and ``torchrun --nproc-per-node 2`` with P/2 per
rank (``backend.kind ddp``). Each side is launched once untimed (warm caches), then twice, for ``--short`` and ``--long`` optimizer
steps; its time per step is the difference of the two wall times over the difference of the steps, so
process start, imports, loading and the final checkpoint cancel out. Printed: ms/step of each side and
the ratio two ranks / one rank (below 1: the two ranks are faster; on a 2-core machine the tiny model
is overhead-bound and the gloo all-reduce of every backward costs more than the halved rollout saves).
Not part of CI.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples/grpo/full/sd3_tiny/default.yaml"


def wall(command: list[str], out: Path) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    start = time.monotonic()
    subprocess.run([*command, "--output-dir", str(out)], env=env, cwd=REPO, check=True, capture_output=True)
    return time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", type=int, default=4)
    parser.add_argument("--long", type=int, default=44)
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--prompts", type=int, default=2, help="P of the one-rank side (P/2 per rank)")
    args = parser.parse_args()
    train = ["-m", "reference_trainer", "train", str(args.config), "--set", "checkpoint.every=0"]
    one = [sys.executable, *train, "--set", f"train.prompts_per_iteration={args.prompts}"]
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    launch += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]
    two = [
        *launch,
        *train,
        "--set",
        "backend.kind=ddp",
        "--set",
        f"train.prompts_per_iteration={args.prompts // 2}",
    ]
    per_step = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, command in (("one rank", one), ("two ranks", two)):
            wall([*command, "--max-steps", "1"], Path(tmp) / f"{name}-warmup")  # caches warm, not timed
            times = [
                wall([*command, "--max-steps", str(steps)], Path(tmp) / f"{name}-{steps}")
                for steps in (args.short, args.long)
            ]
            per_step[name] = (times[1] - times[0]) / (args.long - args.short)
            print(
                f"{name:9s}: {per_step[name] * 1e3:8.1f} ms/step  (walls {times[0]:.1f} s, {times[1]:.1f} s)"
            )
    print(f"ratio two ranks / one rank: {per_step['two ranks'] / per_step['one rank']:.2f}")


if __name__ == "__main__":
    main()
