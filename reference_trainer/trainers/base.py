"""``BaseTrainer``: owns the loop, the counters, the periodic boundaries, checkpoints and resume.

No loss maths and no per-algorithm branches live here (code-style rule 1). A trainer subclass
declares its ``execution_contract`` (equal to its TrainingArguments'), its trainable ``roles``, and:

* ``setup_roles()`` -> ``{role: variant}``: declare variants / snapshots in ``self.variants``;
* generation acquisition: ``optimize(samples)`` after its own ``sample()``; every optimizer step is a
  ``with self.optim.phase(role) as phase: ... phase.backward(loss, metrics)`` block, one per item of
  ``for item in self.cycle_steps(items)`` (which stops at ``max_steps`` and skips the steps done
  before a mid-cycle resume);
* dataset acquisition: ``optimize_batch(batch) -> (loss, metrics)`` for one microbatch; the base
  back-propagates ``loss / gradient_accumulation_steps`` inside the ``dataset_role`` phase and steps
  when the window closes.

``start()`` (Flow-Factory Draft ``trainers/abc.py`` + ``execution.py``):

1. install ffdebug block hooks (env-gated; nothing when dumps are off) and SIGINT/SIGTERM handlers;
2. loop over *cycles* until ``optimizer_step >= max_steps`` (or the epoch budget, or a signal):
   generation — one rollout iteration (``sample`` -> ``optimize``), then ``rollout_iteration += 1``;
   dataset — one accumulation window (one optimizer step); ``data_epoch += 1`` only after the
   loader is cleanly exhausted;
3. after each cycle, the periodic boundaries: evaluation (every ``eval.every`` optimizer steps, also
   before the first step and at the end; ``evaluate()`` -> ``DIR/eval.jsonl``), then checkpoint
   (every ``checkpoint.every`` optimizer steps);
4. always a final checkpoint when the loop ends (max steps, epochs, or a signal).

``max_steps`` is exact: a run stops after exactly ``max_steps`` optimizer steps, even inside a
rollout iteration of several steps (DMD2's fake/generator phases, several GRPO minibatches). Such a
*cut* cycle leaves ``rollout_iteration`` unadvanced, and its checkpoint records ``cycle.steps_done``
plus the variants' weights at the cycle's start (``state/cycle_start.safetensors``, kept in memory
only for a cycle that ``cycle_steps`` sees will be cut). Resuming replays ``sample()`` from those
weights (it is a pure function of weights and counters), restores the current weights, and
``cycle_steps`` skips the steps already done: the trajectory equals the uninterrupted one bit for
bit. Signals stop at cycle boundaries.

A dataset cycle (one accumulation window) is never cut, since ``max_steps`` and signals are checked
between windows: it always ends with ``cycle.steps_done`` back at 0, and a dataset run resumes from
the sampler position ``(data_epoch, batches_in_epoch)`` alone, inside an epoch or at its end. Every
checkpoint is checked when written: one inside a cycle must carry the cycle's start weights.

The three counters are independent. Each finished optimizer step appends one record to
``metrics.jsonl`` (``optimizer_step`` counts steps done, so the first record has 1). Everything a cycle
draws at random comes from ``self.generator(...)``, seeded by ``(seed, counters, purpose)``, so a run
resumed at a cycle boundary continues bit for bit.

The parts of ``BaseTrainer``, one module each: this one has the loop (``start()``, the cycles, the
counters, ``cycle_steps``, signals) and the subclass hooks; ``role_setup`` the roles' optimizer and
backend; ``boundaries`` the evaluation and checkpoint boundaries, ``save`` and ``resume``;
``progress`` the per-step records; ``run_files`` ``run.json`` and the logs; ``identity`` the
config part of the run identity (``config_identity``, re-exported here).
"""

from __future__ import annotations

import hashlib
import json
import signal
import sys
import threading
from abc import ABC
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch

import ffdebug
from reference_trainer import evaluation
from reference_trainer.adapters.base import BaseAdapter
from reference_trainer.config import DatasetTrainingArguments, RunConfig
from reference_trainer.contracts import ExecutionContract
from reference_trainer.data import ConditionCache, DatasetAcquisition, PromptSource
from reference_trainer.distributed import Backend
from reference_trainer.roles import ComponentVariantRegistry
from reference_trainer.steplog import StepLog
from reference_trainer.trainers.boundaries import PeriodicBoundaries
from reference_trainer.trainers.identity import config_identity as config_identity
from reference_trainer.trainers.inputs import RunInputs
from reference_trainer.trainers.progress import StepProgress
from reference_trainer.trainers.role_setup import RoleSetup
from reference_trainer.trainers.run_files import EVAL_FILE as EVAL_FILE
from reference_trainer.trainers.run_files import METRICS_FILE as METRICS_FILE
from reference_trainer.trainers.run_files import RunFiles

T = TypeVar("T")
PHASES = ("rollout", "train", "eval")
"""The ``phase`` tag's values (docs/trainer-taps.md "Step tags")."""


class BaseTrainer(PeriodicBoundaries, StepProgress, RunFiles, RoleSetup, RunInputs, ABC):
    """The thin, contract-owning base of every trainer (see the module docstring)."""

    registry_name: ClassVar[str] = ""
    execution_contract: ClassVar[ExecutionContract]
    roles: ClassVar[tuple[str, ...]] = ("policy",)
    """Trainable roles, each optimising one variant; one ``optimizers:`` entry each."""
    dataset_role: ClassVar[str] = "policy"
    """The role stepped by dataset acquisition."""
    supervision: ClassVar[str | None] = None
    """Dataset trainers: ``demonstration`` or ``preference`` records."""

    def __init__(
        self,
        config: RunConfig,
        adapter: BaseAdapter,
        output_dir: str | Path,
        *,
        prompts: PromptSource | None = None,
        dataset: DatasetAcquisition | None = None,
        heldout: list[dict[str, Any]] | None = None,
        identity: Mapping[str, Any] | None = None,
        backend: Backend | None = None,
    ):
        self._validate_subclass(config.train)
        self.backend = backend if backend is not None else Backend()
        """Ranks and collectives (``reference_trainer.distributed``); every rank runs the same loop."""
        self.config, self.args = config, config.train
        self.adapter = adapter
        self.output_dir = Path(output_dir)
        self.prompts, self.dataset = prompts, dataset
        self.heldout = heldout
        """Dataset trainers with evaluation: the held-out records (``load_records(..., "heldout")``)."""
        self.conditions = ConditionCache(adapter, together=config.data.encode_prompts_together)
        # counters: independent; only the base advances them
        self.optimizer_step = 0
        self.rollout_iteration = 0
        self.data_epoch = 0
        self.batches_in_epoch = 0
        self.cycle_step = 0
        """Optimizer steps done in the current cycle (non-zero between cycles only for a cut cycle)."""
        self._cycle_start: dict[str, torch.Tensor] | None = None
        self._cycle_cut = False
        self.cycle_metrics: dict[str, float] = {}
        # roles: variants (live, trainable) vs snapshots (frozen), disjoint and exhaustive ownership
        self.variants = ComponentVariantRegistry(adapter.trainable_module(), adapter.trainable_component)
        self.role_variants = dict(self.setup_roles())
        self.optim = self._build_optimizer()
        self.identity = {**(identity or {}), "schema": self._schema()}
        self._stop_signal: int | None = None
        self._epoch_batches: Iterator[dict[str, Any]] | None = None
        self._last_saved_step = -1
        self._last_eval_step = -1
        self._resumed = False
        self._progress = None
        self._step_log: StepLog | None = None

    # ---------------------------------------------------------------- subclass hooks
    def setup_roles(self) -> Mapping[str, str]:
        """Declare variants/snapshots; return ``{role: variant}``. Default: one ``policy`` variant.

        Returns:
            ``{role: variant name}``.
        """
        self.variants.declare_variant("policy")
        return {"policy": "policy"}

    def optimize(self, samples: Any) -> None:
        """Generation trainers: one rollout iteration's optimizer steps (override).

        Args:
            samples: what ``sample`` returned.
        """
        raise NotImplementedError

    def sample(self) -> Any:
        """Generation trainers: acquire this rollout iteration's samples (override).

        Returns:
            The samples ``optimize`` consumes.
        """
        raise NotImplementedError

    def optimize_batch(self, batch: Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        """Dataset trainers: the loss of one microbatch and its metrics (override).

        Args:
            batch: one microbatch of the dataset.

        Returns:
            The microbatch loss (the base divides it by the accumulation steps) and its metrics.
        """
        raise NotImplementedError

    def cycle_steps(self, items: Sequence[T]) -> Iterator[T]:
        """The items of this cycle's optimizer steps, in order, each to be exactly one optimizer step.

        Skips the items whose steps were done before a mid-cycle resume, and stops once ``max_steps``
        is reached (the cycle is then *cut*; module docstring). Before the first step of a cycle that
        will be cut, the variants' weights are kept so that the cut cycle's ``sample()`` can be
        replayed on resume.

        Args:
            items: one item per optimizer step of the cycle.

        Returns:
            An iterator over the items still to step.
        """
        items = list(items)
        if self.cycle_step == 0 and self.optimizer_step + len(items) > self.config.max_steps:
            self._cycle_start = {key: t.clone() for key, t in self.variants.state_tensors().items()}
        for index, item in enumerate(items):
            if index < self.cycle_step:
                continue  # done before the resume
            if self.optimizer_step >= self.config.max_steps:
                self._cycle_cut = True
                return
            before = self.optimizer_step
            yield item
            if self.optimizer_step != before + 1:
                raise RuntimeError(
                    f"{type(self).__name__}.optimize: item {index} of cycle_steps() made "
                    f"{self.optimizer_step - before} optimizer steps; each item must make exactly one"
                )

    def evaluate(self) -> dict[str, float]:
        """Metrics of one evaluation (``reference_trainer.evaluation``), run under ``no_grad``.

        Default: the evaluation rewards of the first role's ODE samples from the fixed evaluation
        noise. Dataset trainers add a held-out loss; DMD2 evaluates its one-step generator.

        Returns:
            ``{metric: value}``, written to ``eval.jsonl``.
        """
        eval_config = self.config.eval
        prompts, group_ids = evaluation.eval_prompts(eval_config)
        trajectory = self.adapter.inference(
            self.conditions.get(prompts),
            num_steps=eval_config.num_inference_steps,
            noise_level=0.0,
            generator=evaluation.eval_generator(eval_config),
            module=self.variants.variant(self.role_variants[self.roles[0]]),
        )
        return evaluation.reward_metrics(self.adapter, eval_config, trajectory.final, prompts, group_ids)

    def _validate_subclass(self, args: Any) -> None:
        """Generation trainers must override ``sample`` and ``optimize``; dataset trainers ``optimize_batch``
        and take ``DatasetTrainingArguments`` (the loop reads their accumulation and epoch budget)."""
        cls = type(self)
        if cls.execution_contract.acquisition == "dataset" and not isinstance(args, DatasetTrainingArguments):
            raise TypeError(
                f"{cls.__name__} is a dataset trainer: its arguments must subclass DatasetTrainingArguments, "
                f"got {type(args).__name__}"
            )
        needed = (
            ("sample", "optimize")
            if cls.execution_contract.acquisition == "generation"
            else ("optimize_batch",)
        )
        missing = [name for name in needed if getattr(cls, name) is getattr(BaseTrainer, name)]
        if missing:
            raise TypeError(f"{cls.__name__} ({cls.execution_contract.describe()}) must implement {missing}")

    # ---------------------------------------------------------------- helpers for subclasses
    def sample_generators(self, *keys: int | str, count: int) -> list[torch.Generator]:
        """One generator per sample of this rank's ``count`` samples, seeded by ``(seed, *keys, global
        sample index)``: rank r holds global samples ``r·count .. (r + 1)·count − 1``, so every sample's
        draws are the same whatever the rank layout (docs/cli.md "Several processes")."""
        first = self.backend.rank * count
        return [self.generator(*keys, first + i) for i in range(count)]

    def generator(self, *keys: int | str) -> torch.Generator:
        """A CPU generator seeded by ``(seed, *keys)``: randomness as a pure function of the counters.

        Args:
            *keys: the counters and names that identify this randomness.

        Returns:
            A freshly seeded ``torch.Generator``.
        """
        text = json.dumps([self.config.seed, *keys])
        seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & (2**63 - 1)
        return torch.Generator().manual_seed(seed)

    def step_tags(self, phase: str, *, role: str | None = None) -> dict[str, Any]:
        """ffdebug tags for captures of the current cycle (docs/trainer-taps.md "Step tags").

        Args:
            phase: ``rollout``, ``train`` or ``eval``.
            role: the role a ``train`` block steps, for trainers that step several roles (``role`` tag).

        Returns:
            The tags (phase, counters) for ``ffdebug.step``.
        """
        if phase not in PHASES:
            raise ValueError(f"phase {phase!r} is not one of {PHASES} (docs/trainer-taps.md)")
        tags: dict[str, Any] = {
            "optimizer_step": self.optimizer_step,
            "rollout_iteration": self.rollout_iteration,
            "data_epoch": self.data_epoch,
            "phase": phase,
        }
        if role is not None:
            tags["role"] = role
        return tags

    # ---------------------------------------------------------------- the loop
    def start(self) -> None:
        """Run until ``max_steps`` (or the epoch budget, or SIGINT/SIGTERM); always checkpoint at the end."""
        if not self._resumed:
            self._replace_earlier_logs()
        self._write_run_json()
        handle = ffdebug.install(self.variants.variants[next(iter(self.variants.variants))])
        try:
            with self._signals(), self._progress_bar():
                if self._last_eval_step < 0:  # a fresh run: evaluate the initial weights
                    self._eval_boundary(force=True)
                while not self._should_stop():
                    if self.execution_contract.acquisition == "generation":
                        self._generation_cycle()
                    else:
                        self._dataset_cycle()
                    self._eval_boundary()
                    self._checkpoint_boundary()
                self._eval_boundary(force=True)
                self.save()
        finally:
            if handle is not None:
                handle.remove()
        reason = f"signal {self._stop_signal}" if self._stop_signal is not None else "done"
        print(
            f"stopped ({reason}) at optimizer_step={self.optimizer_step}; output in {self.output_dir}",
            file=sys.stderr,
        )

    def _should_stop(self) -> bool:
        # a signal may reach the ranks at different moments: all of them stop at the same boundary
        if self.backend.any(self._stop_signal is not None) or self.optimizer_step >= self.config.max_steps:
            return True
        if self.execution_contract.acquisition == "dataset":
            return self.data_epoch >= self.args.max_epochs  # type: ignore[attr-defined]
        return False

    def _generation_cycle(self) -> None:
        """One rollout iteration: sample (+ feedback inside ``sample``), then optimize."""
        self.cycle_metrics = {}
        self._cycle_cut = False
        with self._weights_at_cycle_start(), ffdebug.step(**self.step_tags("rollout")):
            samples = self.sample()
        self.optimize(samples)
        if self.optimizer_step > self.config.max_steps:
            raise RuntimeError(
                f"{type(self).__name__}.optimize stepped past max_steps: its optimizer steps must run "
                "inside `for item in self.cycle_steps(items)`"
            )
        if self._cycle_cut:  # stopped at max_steps inside the cycle; resume finishes it
            return
        self.rollout_iteration += 1
        self._end_cycle()

    def _end_cycle(self) -> None:
        """A cycle ran to completion: no step of it is pending, so its start weights are dropped."""
        self.cycle_step = 0
        self._cycle_start = None

    @contextmanager
    def _weights_at_cycle_start(self) -> Iterator[None]:
        """Resumed inside a cut cycle: run the cycle's ``sample()`` on the weights it started from."""
        if self.cycle_step == 0:
            yield
            return
        assert self._cycle_start is not None
        current = {key: t.clone() for key, t in self.variants.state_tensors().items()}
        self.variants.load_state_tensors(self._cycle_start)
        try:
            yield
        finally:
            self.variants.load_state_tensors(current)

    def _dataset_cycle(self) -> None:
        """One accumulation window = one optimizer step; the epoch advances on clean exhaustion.

        The window always completes (``max_steps`` and signals are checked between windows), so it
        ends with ``cycle_step`` back at 0: the resume position of a dataset run is the sampler's
        ``(data_epoch, batches_in_epoch)`` alone, and its checkpoints never need cycle-start weights.
        """
        assert self.dataset is not None
        accumulation = self.args.gradient_accumulation_steps  # type: ignore[attr-defined]
        if self._epoch_batches is None:
            self._epoch_batches = self.dataset.epoch(self.data_epoch, self.batches_in_epoch)
        self.cycle_metrics = {}
        # the whole window is one train block: its losses, gradient norm and updates are tagged too
        with ffdebug.step(**self.step_tags("train")), self.optim.phase(self.dataset_role) as phase:
            for _ in range(accumulation):  # check_accumulation guarantees the window closes
                with ffdebug.step(microbatch=phase.backward_calls):
                    batch = self.take_batch(next(self._epoch_batches))
                    loss, metrics = self.optimize_batch(batch)
                    phase.backward(loss / accumulation, metrics)
                self.batches_in_epoch += 1
        if self.batches_in_epoch == self.dataset.batches_per_epoch:
            if next(self._epoch_batches, None) is not None:
                raise RuntimeError("the loader yielded more batches than batches_per_epoch")
            self.data_epoch += 1
            self.batches_in_epoch = 0
            self._epoch_batches = None
        self._end_cycle()

    # ---------------------------------------------------------------- signals
    @contextmanager
    def _signals(self) -> Iterator[None]:
        """SIGINT/SIGTERM request a stop at the next boundary (then the final checkpoint); a second
        signal gets the default behaviour."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def request_stop(signum: int, frame: object) -> None:
            self._stop_signal = signum
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

        previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
