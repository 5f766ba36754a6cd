"""Build fixtures/analysis/: small stores and checkpoints, and the JSON the analysis commands give
on them, frozen before the analysis side drops torch (docs/architecture.md, "Analysis without
torch"). tests/test_analysis_fixtures.py runs the same commands on the same files and checks the
answers against the frozen ones.

    python scripts/make_analysis_fixtures.py            # rebuild the inputs and the answers
    python scripts/make_analysis_fixtures.py --answers  # only the answers, on the committed inputs

The inputs are built once and committed (their bits depend on the CPU that made them; the test
reads them, it never rebuilds them):

| folder | what | why |
|---|---|---|
| `demo/` | `ffdebug demo`'s reference and target (fp32, a missing routed scaling factor in MoE layers 1-3) | the main job |
| `bf16/` | a tiny Llama in bfloat16, its copy with layer 1's o_proj scaled by 1.05 | bfloat16 payloads |
| `fp8/` | hidden states in float32, the target's stored as float8_e4m3fn / e5m2 (layer 2 wrong) | float8 payloads |
| `ranks/` | a one-rank reference, a two-rank target: cat:1 and cat:0 shards, partial sums, replicas (rank 1 wrong at layer 1) | folding ranks |
| `weights/` | a tiny Llama's fp32 safetensors, its bf16 port with one scaled, one transposed and one renamed tensor, and an fp8 checkpoint with block scales | weights-diff |
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "fixtures" / "analysis"

# (answer file, the command's arguments after `ffdebug`, run in OUT)
COMMANDS: list[tuple[str, list[str]]] = [
    ("demo.compare", ["compare", "demo/ref", "demo/target", "--json"]),
    ("demo.bisect", ["bisect", "demo/ref", "demo/target", "--json"]),
    ("demo.inspect", ["inspect", "demo/target", "--json"]),
    ("bf16.compare", ["compare", "bf16/ref", "bf16/target", "--json"]),
    ("bf16.bisect", ["bisect", "bf16/ref", "bf16/target", "--json"]),
    ("bf16.inspect", ["inspect", "bf16/target", "--json"]),
    ("fp8.compare", ["compare", "fp8/ref", "fp8/target", "--json"]),
    ("fp8.bisect", ["bisect", "fp8/ref", "fp8/target", "--json"]),
    ("fp8.inspect", ["inspect", "fp8/target", "--json"]),
    ("ranks.compare", ["compare", "ranks/ref", "ranks/target", "--json"]),
    ("ranks.bisect", ["bisect", "ranks/ref", "ranks/target", "--json"]),
    ("ranks.inspect", ["inspect", "ranks/target", "--json"]),
    ("weights.port", ["weights-diff", "weights/ref.safetensors", "weights/port.safetensors", "--json"]),
    (
        "weights.fp8",
        ["weights-diff", "weights/ref.safetensors", "weights/fp8.safetensors", "--dequant", "auto", "--json"],
    ),
]


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "OMP_NUM_THREADS": "1",
        "COLUMNS": "200",
    }


def run(args: list[str]) -> tuple[int, dict]:
    """`ffdebug ARGS` in OUT: (exit code, its JSON)."""
    p = subprocess.run(
        [sys.executable, "-m", "ffdebug.cli.app", *args],
        cwd=OUT,
        env=_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    try:
        return p.returncode, json.loads(p.stdout)
    except json.JSONDecodeError:
        raise SystemExit(
            f"ffdebug {' '.join(args)}: no JSON (exit {p.returncode}): {p.stderr[-2000:]}"
        ) from None


def _capture(model, feed, side_dir: Path) -> None:
    import torch

    import ffdebug

    with (
        ffdebug.capture(model, dir=str(side_dir.parent), side=side_dir.name, substages=True),
        torch.no_grad(),
    ):
        model(**feed)


def build_demo() -> None:
    subprocess.run(
        [sys.executable, "-m", "ffdebug.cli.app", "demo", "--dir", str(OUT / "demo")],
        env=_env(),
        check=True,
        capture_output=True,
    )


def _tiny_llama(seed: int, vocab: int, layers: int):
    """A seeded Llama of hidden 32 (4 heads, 2 KV heads, MLP 64) in eval mode, built from its config."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


def build_bf16() -> None:
    import copy

    import torch

    ref = _tiny_llama(0, 256, 3).to(torch.bfloat16)
    target = copy.deepcopy(ref)
    with torch.no_grad():
        target.model.layers[1].self_attn.o_proj.weight.mul_(1.05)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    _capture(ref, {"input_ids": ids}, OUT / "bf16" / "ref")
    _capture(target, {"input_ids": ids}, OUT / "bf16" / "target")


def build_fp8() -> None:
    import torch

    from ffdebug.store.writer import StoreWriter

    g = torch.Generator().manual_seed(2)
    hidden = [torch.randn(2, 8, 32, generator=g)]
    for _ in range(3):
        hidden.append(hidden[-1] + 0.3 * torch.randn(2, 8, 32, generator=g))
    for side in ("ref", "target"):
        w = StoreWriter(str(OUT / "fp8" / side), side)
        for layer in range(3):
            for io, t in (("in", hidden[layer]), ("out", hidden[layer + 1])):
                dtype = torch.float8_e4m3fn if layer != 1 else torch.float8_e5m2
                if side == "target":
                    t = (t * (1.5 if (layer, io) == (2, "out") else 1.0)).to(dtype)
                key = f"L{layer:03d}.hidden_{io}"
                w.write(
                    key,
                    t,
                    {"layer": layer, "layer_class": "decoder", "io": io, "module_path": f"layers.{layer}"},
                )
        w.close()


def build_ranks() -> None:
    import torch

    from ffdebug.store.writer import StoreWriter

    g = torch.Generator().manual_seed(3)
    stages = {}
    for layer in range(3):
        stages[f"L{layer:03d}.attn.q.out"] = torch.randn(2, 6, 16, generator=g)
        stages[f"L{layer:03d}.mlp.down.out"] = torch.randn(2, 6, 16, generator=g)
        stages[f"L{layer:03d}.hidden_out"] = torch.randn(2, 6, 16, generator=g)
        stages[f"L{layer:03d}.moe.router.out"] = torch.randn(12, 8, generator=g)

    def meta(key: str, **more) -> dict:
        layer = int(key[1:4])
        return {
            "layer": layer,
            "layer_class": "decoder",
            "io": "out",
            "module_path": f"layers.{layer}",
            **more,
        }

    w = StoreWriter(str(OUT / "ranks" / "ref"), "ref")
    for key, t in stages.items():
        w.write(key, t, meta(key))
    w.close()
    for rank in range(2):
        w = StoreWriter(str(OUT / "ranks" / "target"), "target", rank=rank, world_size=2)
        for key, t in stages.items():
            if key.endswith("attn.q.out"):  # column-parallel: heads split across ranks
                w.write(
                    key,
                    t.chunk(2, -1)[rank].contiguous(),
                    meta(key, shard={"dim": 2, "index": rank, "count": 2}),
                )
            elif key.endswith("moe.router.out"):  # tokens split across ranks
                w.write(
                    key,
                    t.chunk(2, 0)[rank].contiguous(),
                    meta(key, shard={"dim": 0, "index": rank, "count": 2}),
                )
            elif key.endswith("mlp.down.out"):  # row-parallel: partial sums before the all-reduce
                part = t * (0.25 if rank == 0 else 0.75)
                w.write(key, part.contiguous(), meta(key, reduction="partial"))
            else:  # replicated; rank 1 wrong from layer 1 on
                wrong = rank == 1 and int(key[1:4]) >= 1
                w.write(key, t * (1.2 if wrong else 1.0), meta(key))
        w.close()


def build_weights() -> None:
    import torch
    from safetensors.torch import save_file

    sd = {k: v.contiguous() for k, v in _tiny_llama(4, 128, 2).state_dict().items()}
    d = OUT / "weights"
    d.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(d / "ref.safetensors"))
    port = {k: v.to(torch.bfloat16) for k, v in sd.items()}
    port["model.layers.1.mlp.down_proj.weight"] = (sd["model.layers.1.mlp.down_proj.weight"] * 1.1).bfloat16()
    port["model.layers.0.self_attn.o_proj.weight"] = (
        port["model.layers.0.self_attn.o_proj.weight"].t().contiguous()
    )
    port["model.layers.0.mlp.gate.weight"] = port.pop("model.layers.0.mlp.gate_proj.weight")
    save_file(port, str(d / "port.safetensors"))
    fp8 = {}
    for k, v in sd.items():
        if v.dim() == 2 and k.endswith("proj.weight") and v.shape[0] % 16 == 0 and v.shape[1] % 16 == 0:
            blocks = v.reshape(v.shape[0] // 16, 16, v.shape[1] // 16, 16)
            scale = blocks.abs().amax(dim=(1, 3)) / 448.0
            fp8[k] = (blocks / scale[:, None, :, None]).reshape(v.shape).to(torch.float8_e4m3fn)
            fp8[k.removesuffix("weight") + "weight_scale_inv"] = scale
        else:
            fp8[k] = v
    save_file(fp8, str(d / "fp8.safetensors"))


def answers() -> None:
    out = OUT / "expected"
    out.mkdir(parents=True, exist_ok=True)
    for name, args in COMMANDS:
        code, data = run(args)
        body = {"args": args, "exit_code": code, "json": data}
        (out / f"{name}.json").write_text(json.dumps(body, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        print(f"{name}: exit {code}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--answers", action="store_true", help="only the answers, on the committed inputs")
    opts = ap.parse_args()
    if not opts.answers:
        if OUT.exists():
            shutil.rmtree(OUT)
        OUT.mkdir(parents=True)
        for build in (build_demo, build_bf16, build_fp8, build_ranks, build_weights):
            build()
    answers()


if __name__ == "__main__":
    main()
