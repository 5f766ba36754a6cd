"""Dump overhead on a medium model built from a config (docs/benchmarks.md "Benchmarks").

A Llama of `--layers` layers, hidden `--hidden`, sequence `--seq` (default 12 / 512 / 256, built
from a config, random weights, eval, no_grad). For each mode — none (no ffdebug), stats, full —
runs `--forwards` forwards inside one capture session and measures
  total    wall time of the N forwards plus the session close (the background writer's drain)
  forward  median latency of one forward (what the caller of the model waits for)
Modes are interleaved over `--rounds` rounds (medians), so drift of a shared machine hits each
alike. Prints total / none per mode (target: stats <= 1.5x), the process CPU time of the same span
(steadier than wall on a shared machine) and forward / none.

Usage: python bench/bench_dump_overhead.py                   (smoke: --layers 2 --forwards 2)
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def build(layers: int, hidden: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
    )
    return LlamaForCausalLM(config).eval()


def run_mode(model, ids, mode: str, forwards: int, root: str, round_: int) -> tuple[float, float, float]:
    """(total wall incl. the drain, median forward latency, process CPU seconds incl. the drain)."""
    import contextlib

    import torch

    import ffdebug

    lat = []
    ctx = (
        ffdebug.capture(model, dir=root, side=f"{mode}{round_}", mode=mode, calls="all")
        if mode != "none"
        else contextlib.nullcontext()
    )
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.no_grad(), ctx:
        for _ in range(forwards):
            t = time.perf_counter()
            model(input_ids=ids)
            lat.append(time.perf_counter() - t)
    return time.perf_counter() - t0, statistics.median(lat), time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--forwards", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    args = ap.parse_args()
    os.environ.pop("FFDEBUG_FWD_DUMP_DIR", None)
    import torch

    torch.set_num_threads(args.threads)
    model = build(args.layers, args.hidden)
    ids = torch.randint(0, 1000, (1, args.seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids)  # warm-up
    modes = ("none", "stats", "full")
    totals: dict[str, list[float]] = {m: [] for m in modes}
    lats: dict[str, list[float]] = {m: [] for m in modes}
    cpus: dict[str, list[float]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as root:
        for r in range(args.rounds):
            for mode in modes:
                total, lat, cpu_s = run_mode(model, ids, mode, args.forwards, root, r)
                totals[mode].append(total)
                lats[mode].append(lat)
                cpus[mode].append(cpu_s)
    total = {m: statistics.median(v) for m, v in totals.items()}
    lat = {m: statistics.median(v) for m, v in lats.items()}
    cpu = {m: statistics.median(v) for m, v in cpus.items()}
    print(
        f"Llama {args.layers} layers, hidden {args.hidden}, seq {args.seq}, {args.forwards} forwards, "
        f"{args.threads} threads; medians of {args.rounds} interleaved rounds"
    )
    for m in modes:
        print(
            f"{m:6s} total {total[m]:7.2f} s  ratio {total[m] / total['none']:5.2f}x   "
            f"CPU {cpu[m]:7.2f} s  ratio {cpu[m] / cpu['none']:5.2f}x   "
            f"forward {lat[m] * 1e3:8.1f} ms  ratio {lat[m] / lat['none']:5.2f}x   "
            f"(totals {', '.join(f'{t:.2f}' for t in totals[m])})"
        )
    print("target: stats total <= 1.5x none")


if __name__ == "__main__":
    main()
