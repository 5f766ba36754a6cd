"""A compare across processes (docs/across-nodes.md) against one process, on one machine.

Writes a 4-rank dump, both sides (`--size` bytes of fp32 per side, 1-D stages spread over the
ranks; the target is the reference plus small noise), with StoreWriter, then measures, each as
whole processes, interleaved `--repeat` times (medians):
  single   `ffdebug compare REF TARGET --json`, one process (its own forked workers)
  shared   2 processes as torchrun starts them, both seeing the whole dump (a shared filesystem)
  nodes    2 processes standing for 2 nodes (FFDEBUG_TEST_NODE_ROOTS): ranks 0-1 of both sides
           on one, ranks 2-3 on the other (hard links, nothing copied)
  ref1     as nodes, but the reference is single-rank (rank 0 of a 1-rank dump of the same
           values folded) and lives on node 0 only: its payloads move to node 1's process
and prints the ratios against `single` and, from rank 0's last stderr line, the payload bytes
moved between processes and the bytes of results exchanged. Every JSON is checked equal to
`single`'s.

    python bench/bench_across.py --size 0.05     # smoke
    python bench/bench_across.py --size 2        # the figure: 2 x 2 GiB
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

RANKS = 4
TENSOR_ELEMS = 4 << 20  # 16 MiB fp32 per stage and rank

WRITE = textwrap.dedent(
    """
    import sys, torch
    from ffdebug.store.writer import StoreWriter
    root, size, elems, ranks = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    per_rank = int(size * (1 << 30)) // 4 // ranks
    stages = max(1, per_rank // elems)
    g = torch.Generator().manual_seed(0)
    full = {}
    for rank in range(ranks):
        wr = StoreWriter(f"{root}/ref", side="ref", rank=rank, world_size=ranks, overwrite=rank == 0)
        wt = StoreWriter(f"{root}/target", side="target", rank=rank, world_size=ranks, overwrite=rank == 0)
        for i in range(stages):
            x = torch.randn(elems, generator=g)
            meta = {"call": 0, "layer": i, "layer_class": "Block", "shard": {"dim": 0, "index": rank, "count": ranks}}
            wr.write(f"L{i}.hidden_out", x, meta)
            wt.write(f"L{i}.hidden_out", x + 1e-3 * torch.randn(elems, generator=g), meta)
            full.setdefault(i, []).append(x)
        wr.close()
        wt.close()
    w = StoreWriter(f"{root}/ref1", side="ref", rank=0, world_size=1, overwrite=True)
    for i, parts in full.items():
        w.write(f"L{i}.hidden_out", torch.cat(parts), {"call": 0, "layer": i, "layer_class": "Block"})
    w.close()
    print(stages)
    """
)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def _single(root: str, ref: str) -> tuple[float, str]:
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "ffdebug", "compare", ref, "target", "--json"],
        cwd=root,
        env=_env(),
        capture_output=True,
        text=True,
    )
    return time.perf_counter() - t0, r.stdout


def _group(roots: list[str], ref: str, cwd: str) -> tuple[float, str, str]:
    port = _port()
    procs = []
    t0 = time.perf_counter()
    for i in range(len(roots)):
        env = {
            **_env(),
            "RANK": str(i),
            "LOCAL_RANK": str(i),
            "WORLD_SIZE": str(len(roots)),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "FFDEBUG_TEST_NODE_ROOTS": os.pathsep.join(roots),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "ffdebug", "compare", ref, "target", "--json"],
                cwd=cwd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = [p.communicate() for p in procs]
    wall = time.perf_counter() - t0
    return wall, outs[0][0], outs[0][1].strip().splitlines()[-1] if outs[0][1].strip() else ""


def _linked(src: str, dst: str, sides: dict[str, list[str]]) -> None:
    """Hard links of the named rank directories of each side (and its run.json)."""
    for side, dirs in sides.items():
        os.makedirs(os.path.join(dst, side), exist_ok=True)
        if os.path.exists(os.path.join(src, side, "run.json")):
            os.link(os.path.join(src, side, "run.json"), os.path.join(dst, side, "run.json"))
        for d in dirs:
            os.makedirs(os.path.join(dst, side, d))
            for f in os.listdir(os.path.join(src, side, d)):
                os.link(os.path.join(src, side, d, f), os.path.join(dst, side, d, f))


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=float, default=2.0, help="GiB of fp32 per side (default 2)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write the dumps (default: a temporary directory)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        stages = subprocess.run(
            [sys.executable, "-c", WRITE, root, str(args.size), str(TENSOR_ELEMS), str(RANKS)],
            env=_env(),
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        names = [f"rank{r:03d}" for r in range(RANKS)]
        half = RANKS // 2
        nodes = [os.path.join(root, "node0"), os.path.join(root, "node1")]
        _linked(root, nodes[0], {"ref": names[:half], "target": names[:half], "ref1": ["rank000"]})
        _linked(root, nodes[1], {"ref": names[half:], "target": names[half:]})
        runs = {
            "single": lambda: _single(root, "ref") + ("",),
            "shared": lambda: _group([root, root], "ref", root),
            "nodes": lambda: _group(nodes, "ref", root),
            "single-ref1": lambda: _single(root, "ref1") + ("",),
            "ref1": lambda: _group(nodes, "ref1", root),
        }
        walls: dict[str, list[float]] = {k: [] for k in runs}
        outs: dict[str, tuple] = {}
        for _ in range(args.repeat):
            for name, fn in runs.items():
                wall, out, moved = fn()
                walls[name].append(wall)
                outs[name] = (out, moved)
        for name, want in (("shared", "single"), ("nodes", "single"), ("ref1", "single-ref1")):
            if outs[name][0] != outs[want][0]:
                raise SystemExit(f"{name}: the JSON differs from {want}'s")
        print(
            f"dump: 2 x {args.size:g} GiB, {RANKS} ranks, {stages} stages of {TENSOR_ELEMS * 4 >> 20} MiB per rank"
        )
        med = {k: statistics.median(v) for k, v in walls.items()}
        for name in runs:
            base = "single-ref1" if name == "ref1" else "single"
            line = f"{name:12s} {med[name]:7.2f} s  ({med[name] / med[base]:.2f} x {base})"
            if outs[name][1]:
                line += "   " + outs[name][1].split("; ", 1)[-1]
            print(line)


if __name__ == "__main__":
    main(sys.argv[1:])
