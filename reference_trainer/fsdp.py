"""``backend.kind: fsdp2``: per-parameter sharding with ``torch.distributed.fsdp.fully_shard`` over torchrun.

On CPU this is our own prepare step, not Accelerate's: Accelerate's FSDP2 plugin with ``cpu=True``
silently gives DDP (the parameters stay plain ``Parameter``\\ s), and a module sharded with
``fully_shard`` and then passed to ``accelerator.prepare`` fails (DDP's broadcast has no DTensor
sharding strategy). Accelerate's plugin is for CUDA only, where the adapters do not run yet (refused).

``FSDP2Backend.prepare``, per trainable variant (torchtitan's ``parallelize`` order):

1. activation checkpointing (``backend.activation_checkpointing: full``): applied here, per block, with
   ``torch.distributed._composable.checkpoint`` before sharding; a variant on which the adapter or
   diffusers already turned gradient checkpointing on is refused (never both);
2. ``fully_shard`` on every block (each child of the module's ``ModuleList``\\ s), then on the root, on a
   one-dimensional gloo mesh of all ranks: every parameter becomes a ``DTensor`` sharded on dim 0;
3. an unsharded, parameter-less template of the variant is kept for functional calls with snapshot
   parameters (``sharding.ShardedModule``).

The parameters are *replaced*, so the pre-shard optimizer is stale: ``replaces_parameters`` tells
``BaseTrainer.prepare_backend`` to rebuild the role registry and the one optimizer root from the sharded
parameters, and to check that every optimizer parameter is a ``DTensor`` of a prepared variant.

Snapshots (reference, EMA, teacher) are not sharded: they are frozen full copies on every rank, as
under DDP, updated from the gathered parameters. Checkpoints gather the full state to rank 0 (see
docs/trainer-backends.md for why not DCP shards).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch import nn

from reference_trainer.distributed import ProcessGroupBackend, require_launch
from reference_trainer.errors import ConfigError
from reference_trainer.sharding import ShardedModule, meta_template

if TYPE_CHECKING:
    from reference_trainer.optim import CompositeOptimizer


def blocks(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks of ``module``: the children of its ``ModuleList``\\ s, outermost lists only
    (a list inside a block belongs to that block's shard), in module order."""
    found: list[nn.Module] = []
    inside: set[int] = set()
    for submodule in module.modules():
        if id(submodule) in inside:
            continue
        if isinstance(submodule, nn.ModuleList):
            for child in submodule:
                found.append(child)
                inside.update(id(m) for m in child.modules())
    return found


def checkpoint_blocks(name: str, module: nn.Module, found: list[nn.Module], mode: str) -> None:
    """Activation checkpointing of variant ``name`` per block (``mode`` ``full``; ``none``: nothing),
    refused when gradient checkpointing is already on (the adapter's or diffusers': never both)."""
    if getattr(module, "is_gradient_checkpointing", False):
        raise ConfigError(
            "backend.activation_checkpointing",
            f"variant {name!r} already has gradient checkpointing on; under fsdp2 the backend applies "
            "it per block (set backend.activation_checkpointing: full, and do not enable it in the adapter)",
        )
    if mode == "none":
        return
    if mode != "full":
        raise ConfigError("backend.activation_checkpointing", f"must be none or full, got {mode!r}")
    from torch.distributed._composable import checkpoint

    for block in found:
        checkpoint(block)


class FSDP2Backend(ProcessGroupBackend):
    """``fully_shard`` per block, then the root, on a gloo device mesh (module docstring)."""

    kind = "fsdp2"
    replaces_parameters = True

    def __init__(self, activation_checkpointing: str = "none"):
        super().__init__(activation_checkpointing)
        world = require_launch("fsdp2")
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        if dist.get_world_size() != world:
            raise ConfigError(
                "backend.kind",
                f"fsdp2: the process group has {dist.get_world_size()} ranks for WORLD_SIZE={world}",
            )
        self.rank, self.world_size = dist.get_rank(), world
        self.mesh = init_device_mesh("cpu", (world,))

    def prepare(
        self, modules: Mapping[str, nn.Module], optimizer: CompositeOptimizer
    ) -> dict[str, nn.Module]:
        """Shard every variant in place; the optimizer is left alone (it is rebuilt by the trainer)."""
        from torch.distributed.fsdp import fully_shard

        prepared: dict[str, nn.Module] = {}
        for name, module in modules.items():
            found = blocks(module)
            if not found:
                raise ConfigError(
                    "backend.kind",
                    f"fsdp2 shards per block, but variant {name!r} ({type(module).__name__}) has no "
                    "ModuleList of blocks",
                )
            template = meta_template(module)
            checkpoint_blocks(name, module, found, self.activation_checkpointing)
            for block in found:
                fully_shard(block, mesh=self.mesh)
            fully_shard(module, mesh=self.mesh)
            prepared[name] = ShardedModule(module, template)
        return prepared
