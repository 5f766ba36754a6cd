"""Write what both drafter-training loops read: a tiny target LM, a drafter checkpoint, a dataset.

    python examples/drafter_training/make_fixtures.py OUT

OUT/target/            a 4-layer Llama built from its config (seeded; no download), HF format
OUT/drafter_init.safetensors  the drafter's starting weights, in the reference loop's names
                       (`fc.weight` [H, 3·H], `layers.0.*`, `norm.weight`)
OUT/data.jsonl         pre-tokenised records {"prompt": [...], "completion": [...]}, 16 tokens each

The drafter is an EAGLE / DFlash-style head: the target's hidden states after layers 0, 1 and 2,
concatenated, projected by `fc` to the hidden size, added to the token embedding, one decoder layer,
a norm and the target's own LM head.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SEQ_LEN = 16
RECORDS = 10  # 8 for training (4 steps of 2), 2 held out for the eval
TARGET_CONFIG = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
FEATURE_LAYERS = (0, 1, 2)


def main(argv: list[str] | None = None) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: make_fixtures.py OUT")
    out = Path(args[0])
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = LlamaConfig(**TARGET_CONFIG)
    LlamaForCausalLM(config).save_pretrained(out / "target")

    hidden = config.hidden_size
    fc = torch.nn.Linear(len(FEATURE_LAYERS) * hidden, hidden, bias=False)
    layer = LlamaDecoderLayer(config, layer_idx=0)
    norm = LlamaRMSNorm(hidden)
    state = {"fc.weight": fc.weight.detach()}
    state.update({f"layers.0.{k}": v.detach() for k, v in layer.state_dict().items()})
    state["norm.weight"] = norm.weight.detach() + 0.1 * torch.randn(hidden)  # "pretrained": not ones
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "drafter_init.safetensors"))

    rng = torch.Generator().manual_seed(1)
    with open(out / "data.jsonl", "w") as f:
        for _ in range(RECORDS):
            prompt_len = int(torch.randint(3, 7, (), generator=rng))
            ids = torch.randint(1, config.vocab_size, (SEQ_LEN,), generator=rng).tolist()
            f.write(json.dumps({"prompt": ids[:prompt_len], "completion": ids[prompt_len:]}) + "\n")


if __name__ == "__main__":
    main()
