"""The reference drafter-training loop: a speculative-decoding drafter distilled from a frozen target LM.

    python examples/drafter_training/make_fixtures.py FIX
    FFDEBUG_FWD_DUMP_DIR=dumps FFDEBUG_FWD_DUMP_SIDE=ref \\
        python examples/drafter_training/reference_loop.py FIX --steps 4

Written the Hugging Face way: the target's features come from `output_hidden_states=True`, the
drafter reuses `LlamaDecoderLayer` and shares the target's embedding and LM head. Its taps follow
the LM training contract (docs/trainer-taps.md "LM training"); `port_loop.py` is the same training
written in another codebase's style, tapped alike, so `ffdebug bisect` can compare the two.

Notation (per record, positions t = 0 … S − 1, S = 16):
    h_l[t]      the target's hidden state after decoder layer l (l ∈ FEATURE_LAYERS)
    f[t]        = fc([h_0[t]; h_1[t]; h_2[t]])              [b, S, H]
    z[t]        = lm_head(norm(layer(f[t] + E[x_t])))        the drafter's logits, [b, S, V]
    p[t]        = softmax(target logits at t)                the target's next-token distribution
    m[t]        = 1 where x_{t+1} is a completion token      the loss mask
    L           = Σ_t m[t] · CE(p[t], z[t]) / Σ_t m[t]        distillation loss (soft cross-entropy)
Eval (`phase=eval` at `optimizer_step=N`: the weights after N steps): the same L on held-out
records, and the acceptance rate Σ m · [argmax z = argmax p] / Σ m.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import LlamaForCausalLM
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

import ffdebug

FEATURE_LAYERS = (0, 1, 2)
BATCH = 2
EVAL_RECORDS = 2
LR = 3e-3
WARMUP = 2
CLIP = 0.01  # below the gradient norm of this tiny drafter (about 0.02): clipping acts


class Drafter(torch.nn.Module):
    """fc over the concatenated target features, one decoder layer, a norm; the target's embedding
    and LM head, shared and frozen."""

    def __init__(self, target: LlamaForCausalLM, layers: tuple[int, ...]) -> None:
        super().__init__()
        config = target.config
        self.embed = target.get_input_embeddings()
        self.fc = torch.nn.Linear(len(layers) * config.hidden_size, config.hidden_size, bias=False)
        self.layers = torch.nn.ModuleList([LlamaDecoderLayer(config, layer_idx=0)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary = LlamaRotaryEmbedding(config)
        self.lm_head = target.lm_head

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        e = self.embed(input_ids)
        f = ffdebug.tap("fc.out", self.fc(features))
        h = f + e
        positions = torch.arange(input_ids.shape[1])[None]
        rope = self.rotary(h, positions)
        causal = torch.full((input_ids.shape[1],) * 2, float("-inf")).triu(1)[None, None]
        for layer in self.layers:
            h = layer(h, attention_mask=causal, position_ids=positions, position_embeddings=rope)
            h = h[0] if isinstance(h, tuple) else h
        return self.lm_head(self.norm(h))


def load_records(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def batch_of(records: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids [b, S], labels [b, S], loss_mask [b, S]): labels[t] = x_{t+1} where counted, else -100."""
    ids = torch.tensor([r["prompt"] + r["completion"] for r in records])
    prompt_len = torch.tensor([len(r["prompt"]) for r in records])
    positions = torch.arange(ids.shape[1])
    mask = (positions[None, :] + 1 >= prompt_len[:, None]) & (positions[None, :] < ids.shape[1] - 1)
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = torch.where(mask[:, :-1], ids[:, 1:], -100)
    return ids, labels, mask.float()


def features_of(target: LlamaForCausalLM, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(target logits [b, S, V], the concatenated features [b, S, 3·H]); each layer's is tapped."""
    with torch.no_grad():
        out = target(input_ids, output_hidden_states=True)
    # hidden_states[0] is the embedding output, [l + 1] the output of layer l, but the last entry is
    # the final norm's output, not the last layer's: FEATURE_LAYERS stop before the last layer
    hidden = [out.hidden_states[layer + 1] for layer in FEATURE_LAYERS]
    for layer, h in zip(FEATURE_LAYERS, hidden):
        ffdebug.tap(f"features.layer{layer}", h)
    return out.logits, torch.cat(hidden, dim=-1)


def distill_loss(logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    ce = -(F.softmax(target_logits, dim=-1) * F.log_softmax(logits, dim=-1)).sum(-1)
    return (ce * mask).sum() / mask.sum()


def tap_data(ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> None:
    ffdebug.tap("data.input_ids", ids, input_ids=True)
    ffdebug.tap("data.loss_mask", mask)
    ffdebug.tap("data.labels", labels)


def evaluate(target, drafter, records: list[dict]) -> None:
    ids, labels, mask = batch_of(records)
    tap_data(ids, labels, mask)
    target_logits, features = features_of(target, ids)
    with torch.no_grad():
        logits = drafter(ids, features)
        ffdebug.tap("eval.loss", distill_loss(logits, target_logits, mask))
        hits = (logits.argmax(-1) == target_logits.argmax(-1)).float()
        ffdebug.tap("eval.accept", (hits * mask).sum() / mask.sum())


def lr_at(step: int) -> float:
    return LR * min(1.0, (step + 1) / WARMUP)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("fixtures", type=Path)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--eval-every", type=int, default=2)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    target = LlamaForCausalLM.from_pretrained(args.fixtures / "target", attn_implementation="eager")
    target.eval().requires_grad_(False)
    drafter = Drafter(target, FEATURE_LAYERS)
    missing, unexpected = drafter.load_state_dict(
        load_file(args.fixtures / "drafter_init.safetensors"), strict=False
    )
    if unexpected or [k for k in missing if not k.startswith(("embed.", "lm_head.", "rotary."))]:
        raise SystemExit(f"drafter checkpoint: missing {missing}, unexpected {unexpected}")
    params = [p for n, p in drafter.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    ffdebug.install(target)
    ffdebug.install(drafter)

    records = load_records(args.fixtures / "data.jsonl")
    train, held_out = records[:-EVAL_RECORDS], records[-EVAL_RECORDS:]
    per_epoch = len(train) // BATCH
    for step in range(args.steps + 1):
        if step % args.eval_every == 0 or step == args.steps:
            with ffdebug.step(optimizer_step=step, phase="eval"):
                evaluate(target, drafter, held_out)
        if step == args.steps:
            break
        start = (step % per_epoch) * BATCH
        with ffdebug.step(optimizer_step=step, phase="train", data_epoch=step // per_epoch):
            ids, labels, mask = batch_of(train[start : start + BATCH])
            tap_data(ids, labels, mask)
            target_logits, features = features_of(target, ids)
            logits = drafter(ids, features)
            loss = ffdebug.tap("loss.drafter", distill_loss(logits, target_logits, mask), microbatch=0)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(params, CLIP)
            ffdebug.tap("grad_norm.drafter", norm)
            before = [p.detach().clone() for p in params]
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            deltas = [torch.linalg.vector_norm(p.detach() - b) for p, b in zip(params, before)]
            ffdebug.tap("update.drafter", torch.stack(deltas))
        if not math.isfinite(loss.item()):
            raise SystemExit(f"step {step}: loss {loss.item()}")


if __name__ == "__main__":
    main()
