"""The same drafter training, written the way an engine codebase writes it (the "port").

    FFDEBUG_FWD_DUMP_DIR=dumps FFDEBUG_FWD_DUMP_SIDE=port \\
        python examples/drafter_training/port_loop.py FIX --steps 4

It imports nothing from `reference_loop.py`: the target's features are taken by forward hooks on
its decoder layers, the drafter (`DraftModel`) keeps its own frozen copy of the token embedding,
stores its projection transposed (`proj` [3·H, H], applied as `x @ proj`, the layout of a
column-parallel engine weight), names its modules otherwise, and loads the reference's checkpoint
through a rename table that copies only tensors whose shape fits (a warning lists the others).
Taps: the same LM training contract (docs/trainer-taps.md "LM training"), so
`ffdebug bisect DUMPS/ref DUMPS/port` compares it with the reference loop stage by stage.

The functions below are the seams where ports go wrong; tests/trainer/test_drafter_training.py
replaces them one at a time with a planted bug and checks that bisect names its stage and step.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

import ffdebug

LAYERS = (0, 1, 2)  # target decoder layers whose outputs the drafter reads
BATCH_SIZE = 2
HELD_OUT = 2
PEAK_LR = 3e-3
WARMUP_STEPS = 2
MAX_GRAD_NORM = 0.01  # clips: the drafter's gradient norm is about 0.02


class DraftModel(torch.nn.Module):
    def __init__(self, target: LlamaForCausalLM, n_features: int) -> None:
        super().__init__()
        cfg = target.config
        self.tok_embeddings = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.tok_embeddings.weight.data.copy_(embedding_rows(target.get_input_embeddings().weight))
        self.tok_embeddings.requires_grad_(False)
        self.proj = torch.nn.Parameter(torch.empty(n_features * cfg.hidden_size, cfg.hidden_size))
        torch.nn.init.normal_(self.proj, std=cfg.initializer_range)
        self.blocks = torch.nn.ModuleList([LlamaDecoderLayer(cfg, layer_idx=0)])
        self.out_norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.rope = LlamaRotaryEmbedding(cfg)
        self.head_weight = target.lm_head.weight  # shared, frozen

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        x = self.tok_embeddings(tokens)
        x = ffdebug.tap("fc.out", hidden @ self.proj) + x
        pos = torch.arange(seq).unsqueeze(0)
        cos_sin = self.rope(x, pos)
        mask = causal_mask(seq)
        for block in self.blocks:
            out = block(x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
            x = out[0] if isinstance(out, tuple) else out
        return torch.nn.functional.linear(self.out_norm(x), self.head_weight)


def causal_mask(seq: int) -> torch.Tensor:
    """The additive attention mask [1, 1, S, S]: position t sees positions ≤ t."""
    return torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1).view(1, 1, seq, seq)


def embedding_rows(weight: torch.Tensor) -> torch.Tensor:
    """The drafter's embedding table from the target's (the same vocabulary, row for row)."""
    return weight.detach().clone()


# the reference checkpoint's names -> (this model's name, how the tensor is laid out here)
RENAMES = {
    "fc.weight": ("proj", "transpose"),
    "norm.weight": ("out_norm.weight", None),
}


def convert(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """A checkpoint tensor under this model's name and layout."""
    if name.startswith("layers."):
        return "blocks." + name[len("layers.") :], tensor
    own, layout = RENAMES.get(name, (name, None))
    return own, tensor.t().contiguous() if layout == "transpose" else tensor


def load_checkpoint(model: torch.nn.Module, path: Path) -> None:
    """Copy every checkpoint tensor whose converted name and shape fit; warn about the rest."""
    own = model.state_dict()
    skipped = []
    with torch.no_grad():
        for name, tensor in load_file(path).items():
            key, value = convert(name, tensor)
            if key in own and own[key].shape == value.shape:
                own[key].copy_(value)
            else:
                skipped.append(f"{name} {tuple(tensor.shape)}")
    if skipped:
        warnings.warn(f"{path}: not loaded (name or shape does not fit): {', '.join(skipped)}", stacklevel=2)


def take_features(outputs, captured: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    """The target's hidden states after each of LAYERS, as the hooks captured them."""
    return [captured[i] for i in LAYERS]


def make_loss_mask(prompt_lengths: torch.Tensor, seq: int) -> torch.Tensor:
    """1 where the next token x_{t+1} is a completion token (and exists)."""
    t = torch.arange(seq).unsqueeze(0)
    return ((t + 1 >= prompt_lengths.unsqueeze(1)) & (t + 1 < seq)).float()


def soft_ce(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ m · H(softmax(teacher), softmax(student)) / Σ m."""
    per_token = (torch.softmax(teacher, dim=-1) * torch.log_softmax(student, dim=-1)).sum(dim=-1).neg()
    return (per_token * mask).sum() / mask.sum()


def accept_rate(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ m · [argmax student = argmax teacher] / Σ m: how often the target would accept the draft."""
    agree = (student.argmax(dim=-1) == teacher.argmax(dim=-1)).float()
    return (agree * mask).sum() / mask.sum()


def learning_rate(step: int) -> float:
    return PEAK_LR * min(1.0, (step + 1) / WARMUP_STEPS)


class Target:
    """The frozen target LM and the hooks that take its features."""

    def __init__(self, path: Path) -> None:
        self.model = LlamaForCausalLM.from_pretrained(path, attn_implementation="eager")
        self.model.eval().requires_grad_(False)
        self.captured: dict[int, torch.Tensor] = {}
        for i in LAYERS:
            self.model.model.layers[i].register_forward_hook(self._keep(i))

    def _keep(self, i: int):
        def hook(module, args, output):
            self.captured[i] = output[0] if isinstance(output, tuple) else output

        return hook

    @torch.no_grad()
    def run(self, tokens: torch.Tensor):
        outputs = self.model(tokens, output_hidden_states=True)
        feats = take_features(outputs, self.captured)
        for i, f in zip(LAYERS, feats):
            ffdebug.tap(f"features.layer{i}", f)
        return outputs.logits, torch.cat(feats, dim=-1)


def collate(records: list[dict]):
    tokens = torch.tensor([r["prompt"] + r["completion"] for r in records])
    mask = make_loss_mask(torch.tensor([len(r["prompt"]) for r in records]), tokens.shape[1])
    labels = torch.roll(tokens, -1, dims=1).masked_fill(mask == 0, -100)
    return tokens, labels, mask


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("fixtures", type=Path)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--eval-every", type=int, default=2)
    args = parser.parse_args(argv)

    torch.manual_seed(1234)  # another seed: nothing here is drawn at random after the load
    target = Target(args.fixtures / "target")
    drafter = DraftModel(target.model, len(LAYERS))
    load_checkpoint(drafter, args.fixtures / "drafter_init.safetensors")
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=PEAK_LR, weight_decay=0.0)
    ffdebug.install(target.model)
    ffdebug.install(drafter)

    with open(args.fixtures / "data.jsonl") as f:
        data = [json.loads(line) for line in f]
    train_set, eval_set = data[:-HELD_OUT], data[-HELD_OUT:]
    batches = [train_set[i : i + BATCH_SIZE] for i in range(0, len(train_set), BATCH_SIZE)]

    for step in range(args.steps + 1):
        if step % args.eval_every == 0 or step == args.steps:
            with ffdebug.step(optimizer_step=step, phase="eval"), torch.no_grad():
                tokens, labels, mask = collate(eval_set)
                ffdebug.tap("data.input_ids", tokens, input_ids=True)
                ffdebug.tap("data.loss_mask", mask)
                ffdebug.tap("data.labels", labels)
                teacher, hidden = target.run(tokens)
                student = drafter(tokens, hidden)
                ffdebug.tap("eval.loss", soft_ce(student, teacher, mask))
                ffdebug.tap("eval.accept", accept_rate(student, teacher, mask))
        if step == args.steps:
            return
        with ffdebug.step(optimizer_step=step, phase="train", data_epoch=step // len(batches)):
            tokens, labels, mask = collate(batches[step % len(batches)])
            ffdebug.tap("data.input_ids", tokens, input_ids=True)
            ffdebug.tap("data.loss_mask", mask)
            ffdebug.tap("data.labels", labels)
            teacher, hidden = target.run(tokens)
            loss = soft_ce(drafter(tokens, hidden), teacher, mask)
            ffdebug.tap("loss.drafter", loss, microbatch=0)
            loss.backward()
            ffdebug.tap("grad_norm.drafter", torch.nn.utils.clip_grad_norm_(trainable, MAX_GRAD_NORM))
            old = [p.detach().clone() for p in trainable]
            for g in opt.param_groups:
                g["lr"] = learning_rate(step)
            opt.step()
            opt.zero_grad(set_to_none=True)
            ffdebug.tap(
                "update.drafter", torch.stack([(p.detach() - o).norm() for p, o in zip(trainable, old)])
            )


if __name__ == "__main__":
    main()
