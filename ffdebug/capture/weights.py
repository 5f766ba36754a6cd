"""`maybe_dump_weights_and_exit(model)`: dump parameters and buffers per rank, then exit.

Env: FFDEBUG_WEIGHT_DUMP_DIR (enables; store goes to DIR/weights/), FFDEBUG_WEIGHT_DUMP_LAYERS
(layer selection; tensors outside blocks are always dumped), FFDEBUG_WEIGHT_DUMP_EXIT (default 1:
barrier, then exit 0). Aliases ATOM_WEIGHT_DUMP_*.
"""

from __future__ import annotations

import os
import sys

from ffdebug._env import read_weight_dump_config
from ffdebug.logs import get_logger


def dump_weights(model, directory: str, layers=None, overwrite: bool = True) -> str:
    """Write every parameter and buffer of `model` as a store under `directory/weights/`."""
    from ffdebug.capture.session import _dist_coords
    from ffdebug.models.blocks import find_blocks
    from ffdebug.store.writer import StoreWriter

    rank, world = _dist_coords()
    side_dir = os.path.join(directory, "weights")
    writer = StoreWriter(
        side_dir,
        side="weights",
        rank=rank,
        world_size=world,
        overwrite=overwrite,
        overwrite_variable="FFDEBUG_WEIGHT_DUMP_DIR (a fresh directory)",
    )
    blocks = find_blocks(model)
    owner = {}
    for b in blocks:
        for name, _ in b.module.named_parameters(recurse=True):
            owner[f"{b.path}.{name}"] = b
        for name, _ in b.module.named_buffers(recurse=True):
            owner[f"{b.path}.{name}"] = b
    num_layers = max((b.layer for b in blocks), default=-1) + 1
    # buffers registered with persistent=False live in named_buffers() but never in a checkpoint
    transient = {
        f"{path}.{buf}" if path else buf
        for path, module in model.named_modules()
        for buf in getattr(module, "_non_persistent_buffers_set", ())
    }
    try:
        items = list(model.named_parameters()) + list(model.named_buffers())
        for name, t in items:
            b = owner.get(name)
            if b is not None and layers is not None and not layers.contains(b.layer, num_layers):
                continue
            meta = {
                "io": "weight",
                "module_path": name.rsplit(".", 1)[0] if "." in name else "",
                "layer": b.layer if b else None,
                "layer_class": b.layer_class if b else None,
                "persistent": name not in transient,
            }
            writer.write(name, t.detach().clone(), meta)
    finally:
        writer.close()
    return side_dir


def maybe_dump_weights_and_exit(model) -> str | None:
    """Env-gated weight dump; returns None (and does nothing) when FFDEBUG_WEIGHT_DUMP_DIR is unset."""
    config = read_weight_dump_config()
    if config is None:
        return None
    side_dir = dump_weights(model, config.dir, config.layers)
    if config.exit:
        torch = sys.modules.get("torch")
        if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
        # a warning, not info: the process ends here, and the default level must show why
        get_logger("capture").warning("weights dumped to %s; exiting (FFDEBUG_WEIGHT_DUMP_EXIT=1)", side_dir)
        sys.exit(0)
    return side_dir
