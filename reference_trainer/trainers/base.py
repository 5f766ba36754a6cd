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
"""

from __future__ import annotations

import hashlib
import json
import signal
import sys
import threading
import time
from abc import ABC
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch

# rich is imported here, not lazily in start(): importing rich.style draws from the global python RNG,
# whose checkpointed state must not depend on whether this process has trained before
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import ffdebug
from reference_trainer import checkpoint as ckpt
from reference_trainer import evaluation
from reference_trainer.adapters.base import BaseAdapter
from reference_trainer.config import DatasetTrainingArguments, RunConfig
from reference_trainer.contracts import ExecutionContract
from reference_trainer.data import ConditionCache, DatasetAcquisition, PromptSource
from reference_trainer.distributed import Backend
from reference_trainer.errors import warn
from reference_trainer.jsonl import truncate_jsonl, write_jsonl_atomic
from reference_trainer.optim import RoleOptimizer, StepResult, build_optimizer
from reference_trainer.roles import (
    ComponentVariantRegistry,
    check_ownership,
    role_parameter_names,
    role_parameters,
)
from reference_trainer.sharding import check_sharded_optimizer, full_state, full_tensors
from reference_trainer.steplog import StepLog
from reference_trainer.taps import UpdateTaps
from reference_trainer.trainers.inputs import RunInputs

T = TypeVar("T")
EVAL_FILE = "eval.jsonl"
PHASES = ("rollout", "train", "eval")
"""The ``phase`` tag's values (docs/trainer-taps.md "Step tags")."""
METRICS_FILE = "metrics.jsonl"


class BaseTrainer(RunInputs, ABC):
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

    def _build_optimizer(self) -> RoleOptimizer:
        """The one optimizer root over the declared roles, once their ownership is checked."""
        if set(self.role_variants) != set(self.roles):
            raise RuntimeError(
                f"{type(self).__name__}.setup_roles() returned roles {list(self.role_variants)}, declared {list(self.roles)}"
            )
        role_params = role_parameters(self.variants, self.role_variants)
        check_ownership(role_params, self._all_modules())
        optimizer = build_optimizer(
            role_params, {role: self.config.optimizer_for(role) for role in self.roles}
        )
        return RoleOptimizer(
            optimizer,
            role_params,
            max_grad_norm=self.args.max_grad_norm,
            next_step=lambda: self.optimizer_step + 1,
            on_step=self._record_step,
            update_taps=UpdateTaps(self._watched_weights),
            param_names=role_parameter_names(self.variants, self.role_variants),
        )

    def _watched_weights(self, role: str) -> dict[str, list[torch.Tensor]]:
        """The weights whose update a step of ``role`` taps: its parameters and every snapshot's
        (``update.<name>``, ``reference_trainer.taps``)."""
        watched = {role: list(self.optim.roles[role])}
        watched.update({name: list(snap.values()) for name, snap in self.variants.snapshots.items()})
        return watched

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

    def prepare_backend(self) -> None:
        """Prepare every trainable variant with the one optimizer root (``Backend.prepare``) and route
        forwards to the prepared modules: ``variants.variant(name)`` and the adapter's
        ``get_component(trainable_component)`` return them from now on (the base variant is the
        adapter's component). Called once, by ``run.build_trainer``, before any resume."""
        prepared = self.backend.prepare(self.variants.variants, self.optim.optimizer)
        self.optim.optimizer = self.backend.stepping_optimizer(self.optim.optimizer)
        self.variants.route(prepared)
        base = next(iter(self.variants.variants))
        self.adapter.route_component(self.adapter.trainable_component, prepared[base])
        if self.backend.replaces_parameters:  # FSDP2: roles and optimizer from the sharded parameters
            self.optim = self._build_optimizer()
            check_sharded_optimizer(self.optim.optimizer, self.variants.variants.values())

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

    def _all_modules(self) -> list[torch.nn.Module]:
        components = [self.adapter.get_component(name) for name in self.adapter.component_names()]
        modules = [c for c in components if isinstance(c, torch.nn.Module)]
        return modules + list(self.variants.variants.values())

    def _schema(self) -> dict[str, Any]:
        """Parameter and optimizer layout (part of the run identity)."""
        return {
            "variants": {
                name: [[key, list(p.shape)] for key, p in module.named_parameters()]
                for name, module in self.variants.variants.items()
            },
            "snapshots": sorted(self.variants.snapshots),
            "roles": self.role_variants,
            "optimizer": self.optim.optimizer.describe(),
        }

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

    # ---------------------------------------------------------------- metrics
    def _record_step(self, result: StepResult) -> None:
        """Called by ``RoleOptimizer`` after each optimizer step: count it and log one record.

        Rank 0 writes the record, of global values: the loss and the phase metrics averaged over the
        ranks (each rank's loss is the mean over its equal share of the step's samples), the gradient
        norm of the all-reduced gradient (the same on every rank), and the cycle metrics, which the
        trainers compute over every rank's samples (``feedback.RewardFeedback``)."""
        self.optimizer_step += 1
        self.cycle_step += 1
        averaged = self.backend.mean({"loss": result.loss, **result.metrics})
        result = StepResult(
            role=result.role,
            loss=averaged.pop("loss"),
            grad_norm=result.grad_norm,
            lr=result.lr,
            metrics={key: averaged[key] for key in result.metrics},
        )
        if not self.backend.is_main:
            return
        record: dict[str, Any] = {
            "optimizer_step": self.optimizer_step,
            "role": result.role,
            "rollout_iteration": self.rollout_iteration,
            "data_epoch": self.data_epoch,
            "loss": result.loss,
            f"loss.{result.role}": result.loss,
            f"grad_norm.{result.role}": result.grad_norm,
            f"lr.{result.role}": result.lr,
        }
        for key, value in {**self.cycle_metrics, **result.metrics}.items():
            record.setdefault(key, value)  # the run-identity keys above are never overridden
        with open(self.output_dir / METRICS_FILE, "a") as stream:
            stream.write(json.dumps(record) + "\n")
        if self._step_log is not None:
            self._step_log.step(record)
        if self._progress is not None:
            progress, task = self._progress
            progress.update(
                task, completed=self.optimizer_step, description=f"{result.role} loss {result.loss:+.4g}"
            )

    @contextmanager
    def _progress_bar(self) -> Iterator[None]:
        """Rank 0: a bar on a terminal, else a line per ``log.every`` steps (``steplog``)."""
        console = Console(stderr=True)
        if not self.backend.is_main:
            yield
            return
        if not console.is_terminal:
            self._step_log = StepLog(
                self.registry_name, self.config.log.every, self.config.max_steps, self.optimizer_step
            )
            try:
                yield
            finally:
                self._step_log = None
            return
        columns = (TextColumn(f"[bold]{self.registry_name}[/]"), BarColumn(), MofNCompleteColumn())
        with Progress(
            *columns, TextColumn("{task.description}"), TimeElapsedColumn(), console=console
        ) as progress:
            task = progress.add_task("", total=self.config.max_steps, completed=self.optimizer_step)
            self._progress = (progress, task)
            try:
                yield
            finally:
                self._progress = None

    def _replace_earlier_logs(self) -> None:
        """A fresh run starts its logs empty: rows left by an earlier run in this directory that
        published no checkpoint (``run.build_trainer`` refused one that did) are replaced, never
        appended to."""
        if not self.backend.is_main:
            return
        for name in (METRICS_FILE, EVAL_FILE):
            path = self.output_dir / name
            if path.is_file():
                warn(
                    f"{path}: replaced by this fresh run (it held the logs of an earlier run with no checkpoint)"
                )
                write_jsonl_atomic(path, [])

    def _write_run_json(self) -> None:
        import diffusers
        import transformers

        self.output_dir.mkdir(parents=True, exist_ok=True)
        if not self.backend.is_main:
            return
        run = {
            "config": self.config.to_dict(),
            "identity": self.identity,
            "identity_hash": ckpt.identity_hash(self.identity),
            "versions": {
                "torch": torch.__version__,
                "diffusers": diffusers.__version__,
                "transformers": transformers.__version__,
            },
            "threads": torch.get_num_threads(),
            "backend": {"kind": self.backend.kind, "world_size": self.backend.world_size},
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "argv": sys.argv,
            "resumed_at_step": self.optimizer_step,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (self.output_dir / "run.json").write_text(json.dumps(run, indent=2, default=str))

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


def config_identity(
    config: RunConfig,
    fixture_digest: Mapping[str, str],
    world_size: int,
    *,
    inputs: Mapping[str, Mapping[str, str]],
) -> dict[str, Any]:
    """The config/environment part of the run identity (operational fields excluded: ``max_steps``,
    checkpoint and evaluation cadence, output location).

    ``fixture_digest`` hashes the init weights; ``inputs`` the contents of the input files
    (``run.input_digest``: dataset records and images, the packaged prompt list), so a dataset
    changed in place at the same path is a different run.
    """
    import diffusers
    import transformers

    return {
        "trainer": config.trainer,
        "seed": config.seed,
        "model": asdict(config.model),
        "train": _plain(asdict(config.train)),
        "data": _plain(asdict(config.data)),
        "eval": {key: value for key, value in _plain(asdict(config.eval)).items() if key != "every"},
        "optimizers": {role: _plain(asdict(config.optimizer_for(role))) for role in _roles_of(config)},
        "runtime": {
            **asdict(config.runtime),
            "deterministic_enabled": torch.are_deterministic_algorithms_enabled(),
            "num_threads": torch.get_num_threads(),
        },
        "world_size": world_size,
        "backend": asdict(config.backend),
        "fixtures": dict(fixture_digest),
        "inputs": {kind: dict(files) for kind, files in inputs.items()},
        "versions": {
            "torch": torch.__version__,
            "diffusers": diffusers.__version__,
            "transformers": transformers.__version__,
        },
    }


def _plain(value: Any) -> Any:
    """JSON-normal form (tuples as lists), as stored in a checkpoint's identity."""
    return json.loads(json.dumps(value, default=list))


def _roles_of(config: RunConfig) -> tuple[str, ...]:
    from reference_trainer.registry import resolve_trainer

    trainer_cls, _ = resolve_trainer(config.trainer)
    return trainer_cls.roles
