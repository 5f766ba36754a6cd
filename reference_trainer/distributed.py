"""Execution backends: one process (``single``), or data parallel over a torchrun launch (``ddp``,
``fsdp2`` in ``reference_trainer.fsdp``, ``deepspeed`` ZeRO-1/2 in ``reference_trainer.zero``).

Plan rules (``check_plan``) run before anything is loaded or hashed (``run.build_trainer`` step 2):

* ZeRO-3 is refused (with several trainable roles: DeepSpeed needs ZeRO-1 or 2), FSDP1 is refused
  (``config.BackendConfig``; an FSDP1 field such as ``use_orig_params`` is refused naming it);
* Muon is refused when ``torch.optim.Muon`` is absent, or with DeepSpeed;
* ``deepspeed`` needs an explicit ``zero_stage`` (``config.BackendConfig``), and the optional extra
  installed (checked by ``zero.DeepSpeedBackend`` without importing it when it is absent).

``build_backend`` applies the backend or fails: a backend that was asked for and not applied is an
error, never a fallback. ``ddp`` builds ``Accelerator(cpu=True)`` (gloo) on a machine without CUDA —
a plain ``Accelerator()`` under torchrun gives every rank ``DistributedType.NO`` — and requires
Accelerate's process count to equal torchrun's ``WORLD_SIZE``. ``single`` refuses a launch of several
processes (they would be independent copies writing into one output directory).

``Backend.prepare`` wraps every trainable variant in one ``accelerator.prepare`` call together with the
children of the one ``CompositeOptimizer`` root; the variant registry and the adapter's component
runtime then route forwards to the prepared modules (``roles.ComponentVariantRegistry.route``,
``adapters.base.BaseAdapter.route_component``). Frozen components (text encoder, VAE) and snapshots are
not prepared: DDP replicates, it does not shard, so there is nothing to gain from wrapping them.

Collectives used by the trainers (all no-ops at one process): ``barrier``, ``mean`` (metrics averaged
over ranks, in float64), ``sum``, ``any``, ``gather_rows`` / ``gather_objects`` (every rank's rows, in
rank order), ``local_part`` (this rank's equal share of a global index list).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from reference_trainer.config import RunConfig
from reference_trainer.errors import ConfigError

if TYPE_CHECKING:
    from reference_trainer.optim import CompositeOptimizer


def shutdown() -> None:
    """End of a launch of several processes, after its last run: every rank meets at a barrier, then
    the process group is destroyed. A gloo group left to interpreter teardown can abort a rank at exit
    (``terminate called without an active exception``, exit -6) after all its work succeeded. A no-op
    at one process; called only on success (a rank that failed would leave the others at the barrier).
    """
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def check_plan(config: RunConfig, roles: Sequence[str]) -> None:
    """The backend / optimizer rules of the module docstring; ``ConfigError`` naming the field."""
    backend = config.backend
    if backend.kind == "deepspeed" and backend.zero_stage == 3:
        why = (
            f"DeepSpeed with several trainable roles ({', '.join(roles)}) needs ZeRO-1 or 2"
            if len(roles) > 1
            else "ZeRO-3 is refused (it partitions the parameters that role ownership and snapshots read)"
        )
        raise ConfigError("backend.zero_stage", f"got 3: {why}")
    for index, role in enumerate(roles):
        entry = config.optimizer_for(role)
        if entry.optimizer != "muon":
            continue
        field = _optimizer_field(config, role, index)
        if not hasattr(torch.optim, "Muon"):
            raise ConfigError(
                field, f"muon needs torch.optim.Muon, which torch {torch.__version__} lacks; use adamw"
            )
        if backend.kind == "deepspeed":
            raise ConfigError(
                field, "muon is refused with backend.kind deepspeed (its optimizer wraps AdamW only)"
            )


def _optimizer_field(config: RunConfig, role: str, fallback: int) -> str:
    for index, entry in enumerate(config.optimizers or ()):
        if entry.role == role:
            return f"optimizers[{index}].optimizer"
    return f"optimizers[{fallback}].optimizer"


def launch_world_size() -> int:
    """torchrun's ``WORLD_SIZE`` (1 without torchrun)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ConfigError(
            "backend.kind", f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not an integer"
        ) from None


class Backend:
    """One process (the base class: every collective is the identity)."""

    kind = "single"
    rank = 0
    world_size = 1
    replaces_parameters = False
    """True when ``prepare`` replaces the variants' parameters (FSDP2's DTensors): the trainer then
    rebuilds its role registry and optimizer from the prepared modules (``BaseTrainer.prepare_backend``)."""

    def __init__(self, activation_checkpointing: str = "none"):
        self.activation_checkpointing = activation_checkpointing

    @property
    def is_main(self) -> bool:
        """Rank 0: the one rank that writes run.json, metrics, evaluations and checkpoints."""
        return self.rank == 0

    def barrier(self) -> None:
        """Wait until every rank reaches this point."""

    def mean(self, values: Mapping[str, float]) -> dict[str, float]:
        """Each value averaged over the ranks (every rank passes the same keys)."""
        return dict(values)

    def sum(self, value: int) -> int:
        """``value`` summed over the ranks."""
        return value

    def any(self, flag: bool) -> bool:
        """True when ``flag`` is true on some rank."""
        return flag

    def gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` (equal shapes), concatenated along dim 0 in rank order."""
        return tensor

    def gather_objects(self, items: Sequence[Any]) -> list[Any]:
        """Every rank's ``items``, concatenated in rank order."""
        return list(items)

    def local_part(self, index: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``index`` split into ``world_size`` equal parts (the length must divide)."""
        if len(index) % self.world_size:
            raise ValueError(f"{len(index)} rows do not split into {self.world_size} equal rank parts")
        return index.tensor_split(self.world_size)[self.rank]

    def prepare(
        self, modules: Mapping[str, nn.Module], optimizer: CompositeOptimizer
    ) -> dict[str, nn.Module]:
        """Apply activation checkpointing, then (DDP) wrap ``modules`` and the optimizer's children."""
        for name, module in modules.items():
            self._checkpointing(name, module)
        return dict(modules)

    def stepping_optimizer(self, optimizer: CompositeOptimizer) -> CompositeOptimizer:
        """The optimizer root the role phases step after ``prepare`` (``optimizer`` itself, except under
        DeepSpeed, whose engines own the step: ``zero.ZeroOptimizer``)."""
        return optimizer

    def _checkpointing(self, name: str, module: nn.Module) -> None:
        if self.activation_checkpointing == "none":
            return
        enable = getattr(module, "enable_gradient_checkpointing", None)
        if enable is None:
            raise ConfigError(
                "backend.activation_checkpointing",
                f"full, but variant {name!r} ({type(module).__name__}) has no gradient checkpointing",
            )
        enable()
        if not getattr(module, "is_gradient_checkpointing", False):
            raise ConfigError(
                "backend.activation_checkpointing", f"full was requested but not applied to variant {name!r}"
            )


class ProcessGroupBackend(Backend):
    """The collectives of a torchrun launch of several processes (gloo on CPU); subclasses apply the
    parallelism (``DDPBackend`` here, ``fsdp.FSDP2Backend``)."""

    def barrier(self) -> None:
        dist.barrier()

    def mean(self, values: Mapping[str, float]) -> dict[str, float]:
        keys = sorted(values)
        names = self.gather_objects([keys])
        if any(other != keys for other in names):
            raise RuntimeError(f"ranks logged different metrics: {names}")
        if not keys:
            return {}
        totals = torch.tensor([float(values[key]) for key in keys], dtype=torch.float64)
        dist.all_reduce(totals)
        return {key: float(total) / self.world_size for key, total in zip(keys, totals.tolist())}

    def sum(self, value: int) -> int:
        total = torch.tensor([int(value)], dtype=torch.int64)
        dist.all_reduce(total)
        return int(total)

    def any(self, flag: bool) -> bool:
        return self.sum(int(bool(flag))) > 0

    def gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts)

    def gather_objects(self, items: Sequence[Any]) -> list[Any]:
        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, list(items))
        return [item for part in parts for item in part]


def require_launch(kind: str) -> int:
    """torchrun's world size for backend ``kind``; ``ConfigError`` for a launch of one process, or on a
    machine with CUDA devices (the adapters place their tensors on the CPU)."""
    world = launch_world_size()
    if world < 2:
        raise ConfigError(
            "backend.kind",
            f"{kind} needs a launch of several processes: "
            "torchrun --nproc-per-node N -m reference_trainer train CONFIG (WORLD_SIZE is "
            f"{os.environ.get('WORLD_SIZE', 'unset')})",
        )
    if torch.cuda.is_available():
        raise ConfigError(
            "backend.kind",
            f"{kind} on CUDA devices is not implemented yet (the adapters place tensors on the CPU); "
            "hide the GPUs (CUDA_VISIBLE_DEVICES=) to train over gloo",
        )
    return world


TRAINER_EXTRA = "pip install 'ffdebug[trainer]'"


def require_accelerate() -> None:
    """``ConfigError`` naming the extra when Accelerate (the ``[trainer]`` extra) is not installed."""
    if importlib.util.find_spec("accelerate") is None:
        raise ConfigError(
            "backend.kind",
            f"ddp runs on accelerate, which is not installed; install the extra: {TRAINER_EXTRA}",
        )


class DDPBackend(ProcessGroupBackend):
    """Accelerate's DistributedDataParallel over a torchrun launch (gloo on CPU)."""

    kind = "ddp"

    def __init__(self, activation_checkpointing: str = "none"):
        super().__init__(activation_checkpointing)
        world = require_launch("ddp")
        require_accelerate()
        from accelerate import Accelerator
        from accelerate.utils import DistributedDataParallelKwargs, DistributedType

        # buffers are loaded from the same fixture on every rank and never change: no broadcast, so
        # that a forward without gradients (rollouts, evaluation) runs no collective
        handlers = [DistributedDataParallelKwargs(broadcast_buffers=False)]
        self.accelerator = Accelerator(cpu=True, kwargs_handlers=handlers)
        state = self.accelerator.state
        if state.distributed_type != DistributedType.MULTI_CPU or self.accelerator.num_processes != world:
            raise ConfigError(
                "backend.kind",
                f"ddp was requested but Accelerate started {state.distributed_type} with "
                f"{self.accelerator.num_processes} process(es) for WORLD_SIZE={world}",
            )
        self.rank, self.world_size = self.accelerator.process_index, world

    def prepare(
        self, modules: Mapping[str, nn.Module], optimizer: CompositeOptimizer
    ) -> dict[str, nn.Module]:
        super().prepare(modules, optimizer)
        names = list(modules)
        prepared = self.accelerator.prepare(*modules.values(), *optimizer.children)
        prepared = prepared if isinstance(prepared, tuple | list) else (prepared,)
        wrapped = dict(zip(names, prepared[: len(names)]))
        for name, module in wrapped.items():
            if (
                not isinstance(module, nn.parallel.DistributedDataParallel)
                or module.module is not modules[name]
            ):
                raise RuntimeError(
                    f"ddp was requested but variant {name!r} was not wrapped ({type(module).__name__})"
                )
        optimizer.children = list(prepared[len(names) :])
        return wrapped


def build_backend(config: RunConfig) -> Backend:
    """The backend of ``config.backend``, applied (module docstring); ``ConfigError`` when it cannot be."""
    kind = config.backend.kind
    checkpointing = config.backend.activation_checkpointing
    if kind == "ddp":
        return DDPBackend(checkpointing)
    if kind == "fsdp2":
        from reference_trainer.fsdp import FSDP2Backend

        return FSDP2Backend(checkpointing)
    if kind == "deepspeed":
        from reference_trainer.zero import DeepSpeedBackend

        return DeepSpeedBackend(config.backend, config.train.max_grad_norm)
    world = launch_world_size()
    if world > 1:
        raise ConfigError(
            "backend.kind",
            f"single, but this process is one of {world} torchrun processes: set backend.kind ddp "
            "(--set backend.kind=ddp) or launch one process",
        )
    return Backend(checkpointing)
