"""Forward time: no ffdebug vs dumps disabled (install returns None) vs stats-only dumps.

Target (docs/benchmarks.md "Benchmarks"): disabled / none ≤ 1.01 (and no hook installed at all). Usage:
python bench/bench_hooks_overhead.py [--iters 200]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time


def timed(model, ids, iters: int) -> float:
    import torch

    with torch.no_grad():
        for _ in range(5):
            model(input_ids=ids)
        samples = []
        for _ in range(iters):
            t = time.perf_counter()
            model(input_ids=ids)
            samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    os.environ.pop("FFDEBUG_FWD_DUMP_DIR", None)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import ffdebug

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=1000,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    ).eval()
    ids = torch.randint(0, 1000, (2, 32))
    # "no ffdebug" and "dumps disabled" run the very same module (install installs nothing), so
    # their rounds are interleaved: drift of a shared machine then hits both alike.
    plain = copy.deepcopy(model)
    assert ffdebug.install(model) is None
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    rounds = 6
    nones, disableds = [], []
    for _ in range(rounds):
        nones.append(timed(plain, ids, args.iters // rounds))
        disableds.append(timed(model, ids, args.iters // rounds))
    base, disabled = statistics.median(nones), statistics.median(disableds)
    with tempfile.TemporaryDirectory() as d:
        with ffdebug.capture(model, dir=d, side="s", mode="stats", calls="all"):
            stats = timed(model, ids, max(20, args.iters // 10))
    print(f"hooks installed when disabled: {hooks}")
    print(f"no ffdebug          {base * 1e3:7.3f} ms/forward")
    print(
        f"dumps disabled      {disabled * 1e3:7.3f} ms/forward  ratio {disabled / base:.3f} (target <= 1.01)"
    )
    print(f"stats-only dumps    {stats * 1e3:7.3f} ms/forward  ratio {stats / base:.2f}")


if __name__ == "__main__":
    main()
