"""The periodic boundaries between cycles, and the checkpoints a run writes and resumes from.

``PeriodicBoundaries`` is the part of ``BaseTrainer`` that runs after each cycle: the evaluation
boundary (every ``eval.every`` optimizer steps, also before the first step and at the end;
``evaluate()`` -> ``eval.jsonl``), then the checkpoint boundary (every ``checkpoint.every``); and the
checkpoint itself: ``trainer_state``, ``save`` (checked when written) and ``resume`` (the run identity
first, then weights, optimizer, RNG and counters). The cycle-start rules are the
``reference_trainer.trainers.base`` docstring's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

import ffdebug
from reference_trainer import checkpoint as ckpt
from reference_trainer.jsonl import truncate_jsonl
from reference_trainer.sharding import full_state, full_tensors
from reference_trainer.trainers.run_files import EVAL_FILE, METRICS_FILE

if TYPE_CHECKING:  # types only
    from reference_trainer.config import RunConfig
    from reference_trainer.distributed import Backend
    from reference_trainer.optim import RoleOptimizer
    from reference_trainer.roles import ComponentVariantRegistry


class PeriodicBoundaries:
    """The boundaries and checkpoints of ``BaseTrainer`` (module docstring)."""

    registry_name: ClassVar[str]
    config: RunConfig
    backend: Backend
    output_dir: Path
    identity: dict[str, Any]
    variants: ComponentVariantRegistry
    optim: RoleOptimizer
    optimizer_step: int
    rollout_iteration: int
    data_epoch: int
    batches_in_epoch: int
    cycle_step: int
    _cycle_start: dict[str, torch.Tensor] | None
    _last_saved_step: int
    _last_eval_step: int
    _resumed: bool

    def _checkpoint_boundary(self) -> None:
        every = self.config.checkpoint.every
        if every and self.optimizer_step // every > max(self._last_saved_step, 0) // every:
            self.save()

    def _eval_boundary(self, *, force: bool = False) -> None:
        """Evaluate when a multiple of ``eval.every`` was crossed (or ``force``), once per step."""
        every = self.config.eval.every
        if not every or self.optimizer_step == self._last_eval_step:
            return
        if not force and self.optimizer_step // every <= max(self._last_eval_step, 0) // every:
            return
        with torch.no_grad(), ffdebug.step(**self.step_tags("eval")):
            metrics = self.evaluate()
        record = {
            "optimizer_step": self.optimizer_step,
            "rollout_iteration": self.rollout_iteration,
            "data_epoch": self.data_epoch,
            **{f"eval.{key}": value for key, value in metrics.items()},
        }
        if self.backend.is_main:  # every rank evaluated the same weights on the same inputs
            with open(self.output_dir / EVAL_FILE, "a") as stream:
                stream.write(json.dumps(record) + "\n")
        self._last_eval_step = self.optimizer_step

    # ---------------------------------------------------------------- checkpoints
    def trainer_state(self) -> dict[str, Any]:
        """The checkpoint's ``trainer_state.json``: counters, sampler position, trainer name, run identity
        and its hash.

        Returns:
            The JSON-serialisable state.
        """
        return {
            "optimizer_step": self.optimizer_step,
            "rollout_iteration": self.rollout_iteration,
            "data_epoch": self.data_epoch,
            "sampler": {"data_epoch": self.data_epoch, "batches_in_epoch": self.batches_in_epoch},
            "cycle": {"steps_done": self.cycle_step},
            "trainer": self.registry_name,
            "identity": self.identity,
            "identity_hash": ckpt.identity_hash(self.identity),
        }

    def save(self) -> Path:
        """Write (and atomically publish) a checkpoint of the current state.

        A checkpoint inside a cycle (``cycle_step > 0``) must carry the cycle's start weights, or it
        could not be resumed; that is checked here, when the run writes it, not when it is resumed.

        Returns:
            The published checkpoint directory.
        """
        if self.cycle_step and self._cycle_start is None:
            raise RuntimeError(
                f"{type(self).__name__}: checkpoint at optimizer_step={self.optimizer_step} is inside a cycle "
                f"({self.cycle_step} of its steps done) but the cycle's start weights were not kept; a cycle "
                "that can be cut must run its steps through cycle_steps()"
            )
        # rank 0 publishes (after the gather every rank holds the same full state; under FSDP2 every
        # rank joins it, and the layout is that of every backend); the others wait, so that no rank
        # runs ahead of a checkpoint or touches its temp directory
        self.backend.barrier()
        variant_tensors = full_tensors(self.variants.state_tensors())
        optimizer_state = full_state(self.optim.optimizer.state_dict())
        cycle_start = full_tensors(self._cycle_start) if self.cycle_step else None  # type: ignore[arg-type]
        path = ckpt.checkpoint_path(self.output_dir, self.optimizer_step)
        if self.backend.is_main:
            path = ckpt.save_checkpoint(
                self.output_dir,
                trainer_state=self.trainer_state(),
                variants=self.variants.variants,
                variant_tensors=variant_tensors,
                optimizer_state=optimizer_state,
                cycle_start=cycle_start,
                keep_last=self.config.checkpoint.keep_last,
            )
        self.backend.barrier()
        self._last_saved_step = self.optimizer_step
        return path

    def resume(self, checkpoint: str | Path) -> None:
        """Validate the run identity, then restore weights, snapshots, optimizer, RNG and counters."""
        checkpoint = Path(checkpoint)
        state = ckpt.read_trainer_state(checkpoint)
        ckpt.require_same_identity(checkpoint, state["identity"], self.identity)  # nothing touched yet
        variant_tensors, optimizer_state, rng = ckpt.read_tensor_state(checkpoint)
        self.variants.load_state_tensors(variant_tensors)
        try:
            self.optim.optimizer.load_state_dict(optimizer_state)
        except (KeyError, ValueError, RuntimeError) as error:
            raise ckpt.DamagedCheckpointError(
                checkpoint, ckpt.OPTIMIZER_FILES[0], f"does not load into this run's optimizer ({error})"
            ) from None
        ckpt.set_rng_state(rng)
        self.optimizer_step = state["optimizer_step"]
        self.rollout_iteration = state["rollout_iteration"]
        self.data_epoch = state["sampler"]["data_epoch"]
        self.batches_in_epoch = state["sampler"]["batches_in_epoch"]
        self.cycle_step = state["cycle"]["steps_done"]
        self._cycle_start = ckpt.read_cycle_start(checkpoint) if self.cycle_step else None
        self._last_saved_step = self.optimizer_step
        self._last_eval_step = self.optimizer_step  # evaluated when the checkpointed run ended
        self._resumed = True
        # records past the resumed step were written after the checkpoint (a killed run, or a newer
        # checkpoint that --resume latest skipped as damaged): the resumed run writes them again
        if self.backend.is_main:
            for name in (METRICS_FILE, EVAL_FILE):
                truncate_jsonl(self.output_dir / name, self.optimizer_step)
        self.backend.barrier()
