"""The embedded default job: a tiny DeepSeek-V3-style causal LM, dumped as `ref` and as a `target`
with a known bug, then compared.

The model (built from a config, no download) has one dense layer followed by three MoE layers.
The target is a "port" that forgot DeepSeek-V3's `routed_scaling_factor` in the MoE router — the
bug class that only shows on one class of layers. Each side runs in its own process with the
`FFDEBUG_FWD_DUMP_*` variables set and a one-line `ffdebug.install(model)`, exactly as a user's
reference and engine would.

Run a side by hand: `FFDEBUG_FWD_DUMP_DIR=D FFDEBUG_FWD_DUMP_SIDE=ref python -m ffdebug.demo`
(`--bug` for the target).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

DEMO_CONFIG = dict(
    vocab_size=256,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=4,
    first_k_dense_replace=1,  # layer 0 dense, layers 1-3 MoE
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    q_lora_rank=None,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
DEMO_SEED = 0
EXPECTED = {"layer": 1, "layer_class": "moe", "stage": "ffn_out"}


def build_model(seed: int = DEMO_SEED):
    """The demo model with deterministic random weights (same on both sides)."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**DEMO_CONFIG)).eval()
    with torch.no_grad():  # the router weights start at zero; give them values so routing matters
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                gate.weight.normal_(0.0, 0.5)
    return model


def inject_routed_scaling_bug(model) -> int:
    """The target's bug: MoE routers skip `routed_scaling_factor`. Returns the layers changed."""
    changed = 0
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "routed_scaling_factor"):
            gate.routed_scaling_factor = 1.0
            changed += 1
    return changed


def demo_input_ids():
    import torch

    g = torch.Generator().manual_seed(1234)
    return torch.randint(3, DEMO_CONFIG["vocab_size"], (2, 12), generator=g)


def run_side(bug: bool) -> None:
    """One side, env-driven: what a user's reference or engine script looks like."""
    import torch

    import ffdebug

    torch.set_num_threads(1)
    model = build_model()
    if bug:
        inject_routed_scaling_bug(model)
    ffdebug.install(model)  # no-op unless FFDEBUG_FWD_DUMP_DIR is set
    with torch.no_grad():
        model(input_ids=demo_input_ids())


def dump_both_sides(directory: str, extra_env: dict | None = None) -> None:
    """Run the ref and target sides in two processes (in parallel) with env-var dumps."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("FFDEBUG_", "ATOM_"))}
    base.update(
        {
            "HF_HUB_OFFLINE": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "OMP_NUM_THREADS": "1",
            "TRANSFORMERS_VERBOSITY": "error",
            "FFDEBUG_FWD_DUMP_DIR": directory,
            "FFDEBUG_FWD_DUMP_OVERWRITE": "1",
        }
    )
    base.update(extra_env or {})
    procs = []
    for side, bug in (("ref", False), ("target", True)):
        env = dict(base, FFDEBUG_FWD_DUMP_SIDE=side)
        cmd = [sys.executable, "-m", "ffdebug.demo"] + (["--bug"] if bug else [])
        procs.append(
            (side, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        )
    for side, p in procs:
        out, err = p.communicate()
        if p.returncode != 0:
            from ffdebug.errors import FFDebugError

            last = (err or out).strip().splitlines()[-1:] or ["no output"]
            raise FFDebugError(f"demo side '{side}' failed (exit {p.returncode}): {last[0]}")


def run_demo(directory: str | None = None):
    """Dump both sides and compare them; returns (CompareResult, directory)."""
    from ffdebug.comparison.engine import compare

    directory = directory or tempfile.mkdtemp(prefix="ffdebug-demo-")
    dump_both_sides(directory)
    result = compare(os.path.join(directory, "ref"), os.path.join(directory, "target"))
    return result, directory


@dataclass(frozen=True)
class DemoRun:
    """What `ffdebug demo` found: the comparison, where the dumps are, whether the injected bug was
    located, and the bisect's summary (its keys as in `ffdebug bisect --json`)."""

    compare: object  # CompareResult
    directory: str
    located: bool
    bisect: dict
    elapsed_s: float

    def to_json(self) -> dict:
        """`ffdebug demo --json`: the comparison's keys, plus `demo` (where, expected, located) and `bisect`."""
        demo = {"dir": self.directory, "expected": EXPECTED, "located": self.located}
        return dict(self.compare.to_json(), demo=demo, bisect=self.bisect)


def located_expected(result) -> bool:
    first = result.first_divergence
    return first is not None and all(getattr(first, k) == v for k, v in EXPECTED.items())


if __name__ == "__main__":
    run_side(bug="--bug" in sys.argv[1:])
