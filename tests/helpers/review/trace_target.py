"""A tiny training step for the `ffdebug trace` tests (imported by path, not collected by pytest)."""

from __future__ import annotations

import torch
from torch import nn

import ffdebug


class Block(nn.Module):
    """Linear + GELU."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, W] -> [B, T, W]."""
        return self.act(self.proj(x))


class TinyLM(nn.Module):
    """Embedding, two blocks, a head."""

    def __init__(self, vocab: int = 32, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList([Block(width), Block(width)])
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T] ids -> [B, T, vocab] logits."""
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def one_step() -> dict:
    """A reference forward under no_grad, then one training forward with a masked loss."""
    torch.manual_seed(0)
    model = TinyLM()
    ids = torch.randint(0, 32, (2, 10))
    loss_mask = torch.zeros(2, 10, dtype=torch.bool)
    loss_mask[0, 3:] = True
    loss_mask[1, 5:] = True
    with torch.no_grad(), ffdebug.step(phase="reference"):
        model(ids)
    logits = model(ids, attention_mask=torch.ones(2, 10, dtype=torch.long))
    ffdebug.tap("loss_mask", loss_mask)
    per_token = nn.functional.cross_entropy(logits.transpose(1, 2), ids, reduction="none")
    loss = (per_token * loss_mask).sum() / loss_mask.sum()
    ffdebug.tap("loss", loss)
    loss.backward()
    return {"loss": loss.detach(), "nan_probe": torch.tensor([1.0, float("nan")])}


def fails() -> None:
    """Runs one module, then raises."""
    TinyLM()(torch.zeros(1, 3, dtype=torch.long))
    raise RuntimeError("boom after the forward")


def installed_step() -> None:
    """The traced code installs ffdebug's hooks itself and taps under a step tag."""
    torch.manual_seed(0)
    model = TinyLM()
    ffdebug.install(model, classes="Block")
    with ffdebug.step(phase="train", optimizer_step=1):
        logits = model(torch.randint(0, 32, (2, 10)))
        ffdebug.tap("probs", logits.softmax(-1), phase="sample")
