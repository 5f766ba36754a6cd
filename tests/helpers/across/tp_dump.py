"""A tiny tensor-parallel activation dump for the compare-across-nodes tests: a single-rank
reference and an N-rank target whose attention / logits stages are column shards (declared in
the manifest) and whose hidden states are replicated, split between per-"node" roots."""

from __future__ import annotations

import os
import shutil

import torch

from ffdebug.store.writer import StoreWriter

LAYERS = 2
TOKENS, HIDDEN, VOCAB = 3, 16, 32


def _tensors(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {"embed.input_ids": torch.arange(TOKENS).reshape(1, TOKENS)}
    for i in range(LAYERS):
        out[f"L{i}.attn_out"] = torch.randn(1, TOKENS, HIDDEN, generator=g)
        out[f"L{i}.hidden_out"] = torch.randn(1, TOKENS, HIDDEN, generator=g)
    out["final.logits"] = torch.randn(1, TOKENS, VOCAB, generator=g)
    return out


def _meta(key: str) -> dict:
    layer = int(key[1 : key.index(".")]) if key.startswith("L") else None
    return {"call": 0, "layer": layer, "layer_class": "Block" if layer is not None else None}


def write(root: str, world: int = 8, bug_rank: int | None = None, bug_key: str = "L1.attn_out") -> None:
    """`root/ref` (rank 0) and `root/target` (`world` ranks); with `bug_rank`, that rank's shard of
    `bug_key` is scaled by 1.5 (a bug on one rank)."""
    x = _tensors()
    w = StoreWriter(os.path.join(root, "ref"), side="ref", rank=0, world_size=1, overwrite=True)
    for key, t in x.items():
        w.write(key, t.clone(), _meta(key))
    w.close()
    for rank in range(world):
        w = StoreWriter(
            os.path.join(root, "target"), side="target", rank=rank, world_size=world, overwrite=rank == 0
        )
        for key, t in x.items():
            meta = _meta(key)
            if key.endswith(("attn_out", "logits")):
                t = t.chunk(world, -1)[rank].clone()
                meta["shard"] = {"dim": -1, "index": rank, "count": world}
                if rank == bug_rank and key == bug_key:
                    t = t * 1.5
            w.write(key, t.clone(), meta)
        w.close()


def split(root: str, nodes: list[list[int]], into: str) -> list[str]:
    """Copies of `root`'s target rank directories split over per-node roots `into/node<i>` (node 0
    also holds the reference); returns the roots."""
    roots = []
    for i, ranks in enumerate(nodes):
        node = os.path.join(into, f"node{i}")
        os.makedirs(os.path.join(node, "target"), exist_ok=True)
        for r in ranks:
            name = (
                f"rank{r:03d}" if os.path.isdir(os.path.join(root, "target", f"rank{r:03d}")) else f"rank{r}"
            )
            shutil.copytree(os.path.join(root, "target", name), os.path.join(node, "target", name))
        if i == 0:
            shutil.copytree(os.path.join(root, "ref"), os.path.join(node, "ref"))
        roots.append(node)
    return roots
