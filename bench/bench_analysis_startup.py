"""Start-up of the analysis commands: this tree against an older commit, interleaved (docs/benchmarks.md
"Benchmarks"; issue "Analysis without torch": compare of a 2-stage store <= 0.35 x its wall time
at the commit that issue started from, and under 1 s on an idle 2-core machine).

The older commit is checked out into a temporary git worktree and run with the same interpreter
(`PYTHONPATH` at that worktree), so both trees see the same packages; runs alternate between the
two so drift in the machine's speed hits both. The store is a 2-stage one (`embed.input_ids` and
one fp32 stage) written here without torch; each run is a whole `python -m ffdebug.cli.app`
process, and the time to `import torch` alone is printed beside for scale.

Usage: python bench/bench_analysis_startup.py [--baseline c9be952] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = "c9be952"  # the last commit before the analysis side dropped torch


def _payload(path: Path, array) -> None:
    """A one-tensor safetensors payload (the store's format), written with numpy."""
    header = {
        "tensor": {
            "dtype": {"float32": "F32", "int64": "I64"}[str(array.dtype)],
            "shape": list(array.shape),
            "data_offsets": [0, array.nbytes],
        }
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + array.tobytes())


def two_stage_store(root: Path, shift: float) -> Path:
    """A store of one call: token ids and one [1, 8, 64] fp32 stage (`shift` added on one side)."""
    import numpy as np

    rank = root / "rank000"
    rank.mkdir(parents=True)
    (root / "run.json").write_text(
        json.dumps({"format_version": 1, "tool": "ffdebug", "side": root.name, "world_size": 1})
    )
    ids = np.arange(8, dtype=np.int64).reshape(1, 8)
    hidden = np.linspace(-1, 1, 512, dtype=np.float32).reshape(1, 8, 64) + np.float32(shift)
    lines = []
    for seq, (key, arr) in enumerate((("embed.input_ids", ids), ("L000.hidden_out", hidden))):
        name = f"{seq:06d}_{key}.safetensors"
        _payload(rank / name, arr)
        lines.append(
            {
                "key": key,
                "seq": seq,
                "file": name,
                "tensor": "tensor",
                "side": root.name,
                "rank": 0,
                "world_size": 1,
                "call": 0,
                "invocation": 0,
                "phase": None,
                "step": {},
                "layer": 0 if key.startswith("L") else None,
                "layer_class": None,
                "module_class": None,
                "module_path": None,
                "io": "out",
                "dtype": str(arr.dtype),
                "shape": list(arr.shape),
                "stats": None,
                "shard": None,
                "reduction": "full",
            }
        )
    (rank / "manifest.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    status = {"records": 2, "written": 2, "stats_only": 0, "over_budget": 0, "complete": True}
    (rank / "status.json").write_text(json.dumps(status))
    return root


def wall(cmd: list[str], env: dict, cwd: Path) -> float:
    """Wall seconds of one whole process, run in `cwd` (not the repository: `python -m` puts the
    working directory first on sys.path, ahead of `PYTHONPATH`); exit 0 is required."""
    t = time.perf_counter()
    p = subprocess.run(cmd, check=False, capture_output=True, env=env, cwd=cwd)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:5])} exited {p.returncode}: {p.stderr.decode()[-500:]}")
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--baseline", default=BASELINE, help="the older commit to measure against")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ref, tgt = two_stage_store(tmp / "ref", 0.0), two_stage_store(tmp / "target", 1e-3)
        old = tmp / "baseline"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old), args.baseline],
            check=True,
            capture_output=True,
        )
        try:
            base_env = {**os.environ, "HF_HUB_OFFLINE": "1", "OPENBLAS_NUM_THREADS": "1"}
            envs = {
                "this tree": {**base_env, "PYTHONPATH": str(ROOT)},
                args.baseline: {**base_env, "PYTHONPATH": str(old)},
            }
            cmd = [sys.executable, "-m", "ffdebug.cli.app", "compare", str(ref), str(tgt), "--json"]
            times: dict[str, list[float]] = {k: [] for k in envs}
            torch_times, pass_times = [], []
            for _ in range(args.repeat):
                for label, env in envs.items():
                    times[label].append(wall(cmd, env, tmp))
                torch_times.append(wall([sys.executable, "-c", "import torch"], base_env, tmp))
                pass_times.append(wall([sys.executable, "-c", "pass"], base_env, tmp))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=False)
    now, then = (statistics.median(times[k]) for k in envs)
    print(f"load average {os.getloadavg()[0]:.2f}; medians of {args.repeat}, interleaved")
    print(f"python -c pass              {statistics.median(pass_times):.3f} s")
    print(f"python -c 'import torch'    {statistics.median(torch_times):.3f} s")
    print(f"compare, 2 stages, {args.baseline:<9} {then:.3f} s")
    print(f"compare, 2 stages, this tree {now:.3f} s   ratio {now / then:.2f} x  (targets <= 0.35 x, < 1 s)")


if __name__ == "__main__":
    main()
