"""Build a run from a validated config, in the order that fails cheapest first.

0. ``--output-dir`` must be (or be creatable as) a directory;
1. resolve the trainer and its TrainingArguments from the registries and check that their
   ``ExecutionContract`` values are equal — before any model loads;
2. check the ``optimizers:`` roles against the trainer's roles, and that no ``data.*`` field of the
   other acquisition is set (``config.misplaced_data_fields``); the backend plan rules
   (``distributed.check_plan``: ZeRO-3, FSDP1, Muon), then apply the backend (``build_backend``: the
   process group of a ``ddp`` launch) — before any file of the model is opened;
3. the adapter's fixture directory and the machine limits (``resources``: threads within the cores,
   one rollout within half the memory); pin threads and determinism, seed the global RNGs;
4. acquisition inputs: prompts (generation), or the dataset plus the accumulation-window check
   and, with evaluation, the held-out records (dataset) — still before any model loads;
5. the run identity's config part (``config_identity``: config, fixture weights, and the content
   hashes of the input files, ``input_digest``); on resume, validate the checkpoint (content hashes
   and layout; ``--resume latest`` falls back past damaged ones, ``checkpoint.resolve_resume``),
   compare the identities and check the JSONL logs (``jsonl.read_jsonl``) — before loading; a fresh
   start into a directory holding an earlier run's checkpoints is refused (``checkpoint.check_fresh_start``;
   an earlier run's logs without a checkpoint are replaced when the run starts);
6. load the adapter's pipeline from its fixture, build the trainer (roles, optimizer) and prepare
   its variants with the optimizer on the backend (``BaseTrainer.prepare_backend``);
7. on resume, check the full identity (incl. parameter / optimizer layout) and restore the state.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from reference_trainer import checkpoint as ckpt
from reference_trainer.config import RunConfig, misplaced_data_fields
from reference_trainer.contracts import check_contracts
from reference_trainer.data import (
    DatasetAcquisition,
    PromptSource,
    dataset_directory,
    dataset_files,
    default_prompts,
    default_prompts_file,
    load_records,
)
from reference_trainer.distributed import build_backend, check_plan
from reference_trainer.errors import ConfigError
from reference_trainer.jsonl import read_jsonl
from reference_trainer.registry import resolve_adapter, resolve_trainer
from reference_trainer.resources import check_resources
from reference_trainer.trainers.base import EVAL_FILE, METRICS_FILE, BaseTrainer, config_identity


def apply_runtime(config: RunConfig) -> None:
    """Threads, determinism and global seeds (the thread count changes results bitwise)."""
    torch.set_num_threads(config.runtime.threads)
    torch.use_deterministic_algorithms(config.runtime.deterministic)
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    np.random.seed(config.seed % 2**32)


def build_trainer(config: RunConfig, output_dir: str | Path, *, resume: str | None = None) -> BaseTrainer:
    """A ready-to-``start()`` trainer for ``config`` (see the module docstring for the order)."""
    output_dir = Path(output_dir)
    check_output_dir(output_dir)
    # 1-2. contracts, roles and data fields, before any model loads
    trainer_cls, arguments_cls = resolve_trainer(config.trainer)
    check_contracts(config.trainer, trainer_cls.execution_contract, arguments_cls.execution_contract)
    if not isinstance(config.train, arguments_cls):
        raise ConfigError(
            "train",
            f"was parsed as {type(config.train).__name__}, trainer {config.trainer!r} needs {arguments_cls.__name__}",
        )
    for index, entry in enumerate(config.optimizers or ()):
        if entry.role not in trainer_cls.roles:
            raise ConfigError(
                f"optimizers[{index}].role",
                f"{entry.role!r} is not a role of {config.trainer!r}; roles: {list(trainer_cls.roles)}",
            )
    check_data_fields(config, trainer_cls)
    check_plan(config, trainer_cls.roles)
    backend = build_backend(config)
    # 3. fixture, machine limits, runtime
    adapter = resolve_adapter(config.model.adapter)(config.model.fixture_dir)
    adapter.check_fixture()
    latent_shape = adapter.fixture_latent_shape()
    check_resources(
        config,
        math.prod(latent_shape) if latent_shape is not None else None,
        len(config.eval.prompts or default_prompts()),
    )
    apply_runtime(config)
    rank, world_size = backend.rank, backend.world_size
    # 4. acquisition inputs
    prompts, dataset, heldout = _acquisition_inputs(config, trainer_cls, rank, world_size)
    # 5. resume pre-check on the config part of the identity
    identity = config_identity(
        config,
        ckpt.file_digest(adapter.fixture_files(), adapter.fixture_dir),
        world_size,
        inputs=input_digest(config, trainer_cls),
    )
    checkpoint = ckpt.resolve_resume(resume, output_dir) if resume else None
    if checkpoint is None:
        ckpt.check_fresh_start(output_dir)  # an earlier run's checkpoints: refused, never mixed
    if checkpoint is not None:
        stored = ckpt.read_trainer_state(checkpoint)["identity"]
        if stored.get("world_size") != world_size:
            raise ckpt.CheckpointError(
                f"refusing to resume from {checkpoint}: it was written by a run of world size "
                f"{stored.get('world_size')}, this launch has world size {world_size}; resume with "
                f"torchrun --nproc-per-node {stored.get('world_size')} (a world-size change moves every "
                "sample to another rank)"
            )
        stored_config = {key: value for key, value in stored.items() if key != "schema"}
        ckpt.require_same_identity(checkpoint, stored_config, identity)
        for name in (METRICS_FILE, EVAL_FILE):
            read_jsonl(output_dir / name, quiet=True)  # a bad line before the last: refused now
    # 6. models, roles, optimizer
    load_pipeline(adapter)
    trainer = trainer_cls(
        config,
        adapter,
        output_dir,
        prompts=prompts,
        dataset=dataset,
        heldout=heldout,
        identity=identity,
        backend=backend,
    )
    trainer.prepare_backend()
    # 7. full identity check, then state
    if checkpoint is not None:
        trainer.resume(checkpoint)
    return trainer


def check_output_dir(output_dir: Path) -> None:
    """``ConfigError`` unless ``output_dir`` is a directory or can be created as one."""
    for path in (output_dir, *output_dir.parents):
        if path.exists():
            if not path.is_dir():
                which = "is" if path == output_dir else f"is inside {path}, which is"
                raise ConfigError(
                    "--output-dir", f"{output_dir} {which} a file, not a directory; choose a directory"
                )
            return


def check_data_fields(config: RunConfig, trainer_cls: type[BaseTrainer]) -> None:
    """``ConfigError`` for a ``data.*`` field that this trainer's acquisition never reads."""
    acquisition = trainer_cls.execution_contract.acquisition
    misplaced = misplaced_data_fields(config.data, acquisition)
    if misplaced:
        raise ConfigError(
            misplaced[0],
            f"is not read by trainer {config.trainer!r} ({trainer_cls.execution_contract.describe()}: "
            f"{acquisition} acquisition); remove it",
        )


def load_pipeline(adapter: Any) -> None:
    """``adapter.load_pipeline()``, a fixture that does not load being a ``ConfigError`` on the fixture."""
    try:
        adapter.load_pipeline()
    except (
        OSError,
        ValueError,
    ) as error:  # diffusers / transformers loaders; HFValidationError is a ValueError
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError("model.fixture_dir", f"{adapter.fixture_dir} does not load: {first}") from None


def input_digest(config: RunConfig, trainer_cls: type[BaseTrainer]) -> dict[str, dict[str, str]]:
    """``{"dataset" | "prompts": {file name: sha256}}``: the contents of the files the config points at.

    A dataset trainer hashes its dataset's records (training, and held-out when present) and images;
    the packaged prompt list is hashed whenever a prompt list defaults to it (a generation trainer's
    ``data.prompts`` or ``eval.prompts`` left empty). Files are hashed whether or not this segment of
    the run reads them (``eval.every`` is operational and may change on resume).
    """
    inputs: dict[str, dict[str, str]] = {}
    generation = trainer_cls.execution_contract.acquisition == "generation"
    if (generation and not config.data.prompts) or not config.eval.prompts:
        prompts_file = default_prompts_file()
        inputs["prompts"] = ckpt.file_digest([prompts_file], prompts_file.parent)
    if not generation:
        files = dataset_files(config.data, trainer_cls.supervision)  # type: ignore[arg-type]
        inputs["dataset"] = ckpt.file_digest(files, dataset_directory(config.data))
    return inputs


def _acquisition_inputs(
    config: RunConfig, trainer_cls: type[BaseTrainer], rank: int, world_size: int
) -> tuple[PromptSource | None, DatasetAcquisition | None, list[dict[str, Any]] | None]:
    """(prompts, dataset, held-out records): prompts for generation trainers; for dataset trainers the
    rank-sharded dataset, whose accumulation windows must close, and, with evaluation, the held-out records."""
    if trainer_cls.execution_contract.acquisition == "generation":
        prompts = PromptSource(
            config.data.prompts or default_prompts(), config.seed, rank=rank, world_size=world_size
        )
        return prompts, None, None
    records = load_records(config.data, trainer_cls.supervision)
    dataset = DatasetAcquisition(
        records,
        batch_size=config.data.batch_size,
        seed=config.seed,
        shuffle=config.data.shuffle,
        rank=rank,
        world_size=world_size,
        source=str(dataset_directory(config.data)),
    )
    dataset.check_accumulation(config.train.gradient_accumulation_steps)  # type: ignore[attr-defined]
    heldout = load_records(config.data, trainer_cls.supervision, "heldout") if config.eval.every else None
    return None, dataset, heldout


def train(
    config: RunConfig,
    output_dir: str | Path,
    *,
    resume: str | None = None,
    inputs_from: str | Path | None = None,
    inputs_map: Sequence[str] = (),
    inputs_map_file: str | Path | None = None,
) -> BaseTrainer:
    """Build and run; returns the finished trainer.

    ``inputs_from``: a target's ffdebug store whose prompts, noise, schedule and sample order the
    rollouts take (``reference_trainer.inputs_from``); ``inputs_map`` / ``inputs_map_file``: renames of its
    stages (``OLD=NEW`` rules, an alias file).
    """
    trainer = build_trainer(config, output_dir, resume=resume)
    if inputs_from is not None:
        from reference_trainer.inputs_from import InputsFrom
        from reference_trainer.registry import resolve_trainer, trainer_names

        if not type(trainer).takes_inputs:
            able = [name for name in trainer_names() if resolve_trainer(name)[0].takes_inputs]
            raise ConfigError(
                "--inputs-from",
                f"trainer {config.trainer!r} does not take a target's inputs yet (these do: {', '.join(able)})",
            )

        trainer.inputs_from = InputsFrom(
            inputs_from, rank=trainer.backend.rank, maps=inputs_map, map_file=inputs_map_file
        )
    trainer.start()
    if trainer.inputs_from is not None:
        trainer.inputs_from.finish(trainer.output_dir)
    return trainer
