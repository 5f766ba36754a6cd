"""Tensor-parallel weight dumps for the weights-diff tests: Megatron-style shards of a state dict,
written as a per-rank ffdebug weight store."""

from __future__ import annotations

from ffdebug.store.writer import StoreWriter

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")  # split dim 0
ROW = ("o_proj", "down_proj")  # split dim 1


def tp_split(state: dict, world: int = 2) -> list[dict]:
    """Megatron-style shards: column-parallel on dim 0, row-parallel on dim 1, norms replicated."""
    ranks: list[dict] = [{} for _ in range(world)]
    for name, t in state.items():
        dim = 0 if any(c in name for c in COLUMN) else 1 if any(r in name for r in ROW) else None
        for r in range(world):
            ranks[r][name] = t.clone() if dim is None else t.chunk(world, dim)[r].clone()
    return ranks


def write_dump(side_dir, shards: list[dict], with_meta: bool = False) -> None:
    world = len(shards)
    for rank, shard in enumerate(shards):
        w = StoreWriter(str(side_dir), side="weights", rank=rank, world_size=world, overwrite=True)
        for name, t in shard.items():
            meta = {"io": "weight"}
            if with_meta and t.shape[0] != 0:
                dim = 0 if any(c in name for c in COLUMN) else 1 if any(r in name for r in ROW) else None
                if dim is not None:
                    meta["shard"] = {"dim": dim, "index": rank, "count": world}
            w.write(name, t, meta)
        w.close()
