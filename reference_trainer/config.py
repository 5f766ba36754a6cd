"""Run configuration: YAML -> frozen dataclasses, validated field by field.

A config file has these top-level keys (example: ``examples/grpo/full/sd3_tiny/default.yaml``)::

    seed: 0                 # seeds everything (weights come from fixtures; sampling, data order, noise)
    trainer: grpo           # a registered trainer; ``train:`` is parsed with its TrainingArguments class
    max_steps: 8            # optimizer steps (``--max-steps`` overrides)
    model:       {adapter: sd3-tiny, finetune_type: full}
    data:        {prompts: [...], dataset: tiny, batch_size: 2}
    train:       {...}      # algorithm-specific TrainingArguments
    optimizers:  [{role: policy, optimizer: adamw, lr: 1.0e-3}]
    checkpoint:  {every: 4, keep_last: 0}
    eval:        {every: 4, prompts: [...], rewards: [{name: brightness}]}
    runtime:     {threads: 1, deterministic: true}
    backend:     {kind: single}   # or ddp under torchrun (README "Several processes")
    log:         {every: 1}       # a line per optimizer step on stderr when it is not a terminal

Every error is a ``ConfigError`` (``reference_trainer.errors``) naming the offending field by its
dotted path (``train.group_size: must be >= 2, got 1``), or the file and line of a YAML error
(``cfg.yaml:3:5: found character '\\t' ...``); unknown keys and keys given twice are errors (a typo
must not silently fall back to a default). The file is read with ``yaml.SafeLoader``: a tag such as
``!!python/object`` is refused, never executed; a file that is not UTF-8 text is refused with the
byte offset. ``--set dotted.key=value`` overrides are applied to the raw mapping before validation;
values are parsed as YAML scalars/lists, with the same errors naming the override.

Numbers are bounded where an out-of-range value would only fail later, or never: every float field
must be finite (``lr: .inf``, ``max_grad_norm: .nan`` are refused at load), seeds fit in 63 bits.
Limits that depend on the machine (threads, rollout memory) are checked by ``run.check_resources``,
still before any model loads.

PyYAML reads ``1e-3`` (no dot) as a *string* (YAML 1.1); float fields accept such numeric strings, and
only those — any other string for a float field is an error.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml

from reference_trainer.contracts import DATASET, ExecutionContract
from reference_trainer.errors import ConfigError, require

# --------------------------------------------------------------------------------------------------
# Sections shared by every trainer
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Which adapter builds the model, and from which fixture weights."""

    adapter: str
    """A registered adapter name (``reference-trainer list``), e.g. ``sd3-tiny`` or ``flux-tiny``."""
    finetune_type: Literal["full"] = "full"
    """Only full finetuning of the transformer is implemented (no LoRA)."""
    fixture_dir: str | None = None
    """Directory with the seeded init weights; default: the adapter's packaged fixture."""


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Prompts for generation trainers; the supervision dataset for dataset trainers.

    Each field's ``metadata["acquisition"]`` names the acquisition that reads it; a field set (to a
    value other than its default) for a trainer of the other acquisition is refused before any model
    loads (``misplaced_data_fields``), since it would be silently ignored.
    """

    prompts: tuple[str, ...] = field(default=(), metadata={"acquisition": "generation"})
    """Generation prompts; empty = the packaged tiny prompt list (``fixtures/prompts.txt``)."""
    encode_prompts_together: bool = False
    """Encode each rollout's (or dataset batch's) prompts in one text-encoder batch instead of one
    prompt at a time: a harmless numerical difference, for a noise run of ``ffdebug bisect --noise``
    (docs/trainer-taps.md "A harmless difference: the noise side"). Off by default: a condition's
    bits then depend on the batch it was encoded in."""
    dataset: str | None = field(default=None, metadata={"acquisition": "dataset"})
    """Dataset directory (``records.jsonl`` + ``images.safetensors``); ``tiny`` = the packaged one."""
    batch_size: int = field(default=2, metadata={"acquisition": "dataset"})
    """Rank-local batch size for dataset acquisition."""
    shuffle: bool = field(default=True, metadata={"acquisition": "dataset"})
    """Shuffle in ``DistributedSampler`` (order depends only on ``seed`` and ``data_epoch``)."""

    def __post_init__(self) -> None:
        require(self.batch_size >= 1, "batch_size", f"must be >= 1, got {self.batch_size}")
        for index, prompt in enumerate(self.prompts):
            require(bool(prompt.strip()), f"prompts[{index}]", "must be a non-empty string")


def misplaced_data_fields(data: DataConfig, acquisition: str) -> list[str]:
    """The ``data.*`` fields set to a non-default value that a trainer of ``acquisition`` never reads."""
    return [
        f"data.{spec.name}"
        for spec in dataclasses.fields(data)
        if spec.metadata.get("acquisition", acquisition) != acquisition
        and getattr(data, spec.name) != (spec.default if spec.default is not dataclasses.MISSING else None)
    ]


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """The optimizer of one trainable role (Flow-Factory Draft ``optimizers:`` list entry)."""

    role: str
    """The trainable role this entry configures (e.g. ``policy``, ``generator``, ``fake``)."""
    optimizer: Literal["adamw", "muon"] = "adamw"
    """``adamw``; or ``muon``: ``torch.optim.Muon`` for 2-D weights plus AdamW for the remainder."""
    lr: float = 1e-4
    """Learning rate (Muon uses ``adjust_lr_fn='match_rms_adamw'`` so one lr serves both parts)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas (also for the AdamW remainder of a Muon role)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 1e-4
    """Decoupled weight decay (AdamW and Muon)."""
    momentum: float = 0.95
    """Muon momentum (Nesterov)."""

    def __post_init__(self) -> None:
        require(bool(self.role), "role", "must be a non-empty role name")
        require(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        for index, beta in enumerate(self.betas):
            require(0.0 <= beta < 1.0, f"betas[{index}]", f"must be in [0, 1), got {beta}")
        require(self.eps > 0, "eps", f"must be > 0, got {self.eps}")
        require(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        require(0.0 <= self.momentum < 1.0, "momentum", f"must be in [0, 1), got {self.momentum}")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Checkpoint cadence. A checkpoint is also always written when a run ends."""

    every: int = 0
    """Write a checkpoint at the first cycle boundary at or past every multiple of this many optimizer
    steps; 0 = only at the end of the run."""
    keep_last: int = 0
    """Delete older checkpoints beyond the newest ``keep_last``; 0 keeps all."""

    def __post_init__(self) -> None:
        require(self.every >= 0, "every", f"must be >= 0, got {self.every}")
        require(self.keep_last >= 0, "keep_last", f"must be >= 0, got {self.keep_last}")


@dataclass(frozen=True, kw_only=True)
class RewardSpec:
    """One configured reward for ``rewards.RewardProcessor``: registered name, chunk size, kwargs."""

    name: str
    """Registered reward name (``reference-trainer list``)."""
    batch_size: int = 8
    """Chunk size for pointwise rewards (the last chunk may be smaller)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Constructor arguments of the reward."""

    def __post_init__(self) -> None:
        require(bool(self.name), "name", "must be a registered reward name")
        require(self.batch_size >= 1, "batch_size", f"must be >= 1, got {self.batch_size}")


def require_unique_rewards(rewards: tuple[RewardSpec, ...], field_name: str = "rewards") -> None:
    """``ConfigError`` naming the list when one reward name is configured twice."""
    names = [spec.name for spec in rewards]
    twice = sorted({name for name in names if names.count(name) > 1})
    require(not twice, field_name, f"rewards listed more than once: {twice}")


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Periodic evaluation on fixed prompts and fixed noise (``reference_trainer.evaluation``).

    It never changes the training trajectory (no RNG, weight or counter is touched); its records go
    to ``DIR/eval.jsonl``. Everything but ``every`` is part of the run identity (a resumed run replays
    the same evaluation).
    """

    every: int = 0
    """0 = no evaluation; else evaluate before the first step, at the first cycle boundary at or past
    every multiple of this many optimizer steps, and when the run ends."""
    prompts: tuple[str, ...] = ()
    """Evaluation prompts; empty = the packaged tiny prompt list."""
    samples_per_prompt: int = 2
    """Samples per prompt (one fixed noise each; a groupwise reward sees them as one group)."""
    num_inference_steps: int = 8
    """ODE steps of a multi-step policy's samples (DMD2: of its teacher's samples)."""
    seed: int = 0
    """Seeds the fixed evaluation noise and the held-out loss draws (independent of ``seed``)."""
    heldout_draws: int = 4
    """Dataset trainers: (σ, ε) draws per held-out record for the held-out loss."""
    rewards: tuple[RewardSpec, ...] = (RewardSpec(name="brightness"),)
    """Evaluation rewards, configured independently of any training reward."""

    def rollout_size(self, prompt_count: int) -> RolloutSize:
        """The size of one evaluation's ODE samples, for ``prompt_count`` evaluation prompts."""
        prompts = ("eval.prompts" if self.prompts else "", prompt_count)
        samples = ("eval.samples_per_prompt", self.samples_per_prompt)
        return RolloutSize((prompts, samples), ("eval.num_inference_steps", self.num_inference_steps))

    def __post_init__(self) -> None:
        require(self.every >= 0, "every", f"must be >= 0, got {self.every}")
        require(
            self.samples_per_prompt >= 1,
            "samples_per_prompt",
            f"must be >= 1, got {self.samples_per_prompt}",
        )
        require(
            self.num_inference_steps >= 1,
            "num_inference_steps",
            f"must be >= 1, got {self.num_inference_steps}",
        )
        require(self.heldout_draws >= 1, "heldout_draws", f"must be >= 1, got {self.heldout_draws}")
        require(len(self.rewards) >= 1, "rewards", "needs at least one reward")
        require_unique_rewards(self.rewards)
        require(0 <= self.seed < 2**63, "seed", f"must be in [0, 2**63), got {self.seed}")
        for index, prompt in enumerate(self.prompts):
            require(bool(prompt.strip()), f"prompts[{index}]", "must be a non-empty string")


@dataclass(frozen=True, kw_only=True)
class LogConfig:
    """Per-step lines on stderr when it is not a terminal (``reference_trainer.steplog``; a terminal
    shows the progress bar). Operational: not part of the run identity."""

    every: int = 1
    """One line every this many optimizer steps, on rank 0: step, loss, reward, lr, grad norm, step
    time; 0 = none."""

    def __post_init__(self) -> None:
        require(self.every >= 0, "every", f"must be >= 0, got {self.every}")


@dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
    """Process-level numerics settings; part of the run identity (they change the bits)."""

    threads: int = 1
    """``torch.set_num_threads`` (the thread count changes results bitwise); at most the machine's
    cores (``run.check_resources``)."""
    deterministic: bool = True
    """``torch.use_deterministic_algorithms``."""

    def __post_init__(self) -> None:
        require(self.threads >= 1, "threads", f"must be >= 1, got {self.threads}")


BACKEND_KINDS = ("single", "ddp", "fsdp2", "deepspeed")


@dataclass(frozen=True, kw_only=True)
class BackendConfig:
    """How the run is executed: one process, or data parallel over the processes of a torchrun launch.

    ``single``: one process (a torchrun launch of several is refused). ``ddp``: Accelerate's
    DistributedDataParallel, gloo on CPU, launched as ``torchrun --nproc-per-node N -m reference_trainer
    train CONFIG``; a launch without torchrun is refused (a requested backend that is not applied is an
    error, never a fallback). ``fsdp2``: ``fully_shard`` per block then the root, over the same torchrun
    launch (``reference_trainer.fsdp``). ``deepspeed``: ZeRO-1/2, one engine per trainable role, over the
    same launch (``reference_trainer.zero``; the optional ``[deepspeed]`` extra). Part of the run identity.
    """

    kind: str = "single"
    """``single``, ``ddp``, ``fsdp2`` or ``deepspeed`` (FSDP1 is refused: use ``fsdp2``)."""
    zero_stage: int | None = None
    """DeepSpeed only: the ZeRO stage, 1 or 2 (ZeRO-3 is refused)."""
    activation_checkpointing: Literal["none", "full"] = "none"
    """``full``: gradient checkpointing of every trainable variant (recompute activations in backward);
    under ``fsdp2`` applied by the backend per block, before sharding."""

    def __post_init__(self) -> None:
        if self.kind in ("fsdp", "fsdp1"):
            raise ConfigError("kind", f"FSDP1 ({self.kind!r}) is refused; use fsdp2 (per-parameter sharding)")
        require(
            self.kind in BACKEND_KINDS, "kind", f"must be one of {list(BACKEND_KINDS)}, got {self.kind!r}"
        )
        if self.zero_stage is not None:
            require(
                self.kind == "deepspeed",
                "zero_stage",
                f"is read by kind deepspeed only; remove it for kind {self.kind!r}",
            )
            require(
                self.zero_stage in (1, 2, 3),
                "zero_stage",
                f"must be 1 or 2, got {self.zero_stage}",
            )
        else:
            require(
                self.kind != "deepspeed", "zero_stage", "kind deepspeed needs an explicit zero_stage: 1 or 2"
            )


FSDP1_ONLY_FIELDS = ("use_orig_params",)
"""FSDP1 options: a ``backend:`` section that sets one is refused naming it (FSDP1 is refused)."""


@dataclass(frozen=True)
class RolloutSize:
    """What one rollout keeps in memory: ``samples`` latents at each of ``steps + 1`` noise levels.

    ``factors`` and ``steps`` are ``(dotted field, value)`` pairs, so that a refusal can name the fields
    (``run.check_resources``): samples = the product of the factors' values.
    """

    factors: tuple[tuple[str, int], ...]
    steps: tuple[str, int]

    @property
    def samples(self) -> int:
        """The number of samples: the product of the factors' values."""
        return math.prod(value for _, value in self.factors)

    def nbytes(self, latent_elements: int) -> int:
        """samples × latent elements × (steps + 1) × 4 bytes (fp32 latents)."""
        return self.samples * latent_elements * (self.steps[1] + 1) * 4

    def fields(self) -> list[str]:
        """The dotted fields that set the size (named by a refusal)."""
        return [name for name, _ in (*self.factors, self.steps) if name]


@dataclass(frozen=True, kw_only=True)
class TrainingArguments:
    """Base of every algorithm's arguments (``train:`` section). Subclasses declare the contract."""

    execution_contract: ClassVar[ExecutionContract]
    max_grad_norm: float = 1.0
    """Clip each role's gradient to this global L2 norm; 0 disables clipping (the pre-clip norm is
    always logged as ``grad_norm.<role>``). Finite, like every float field."""

    def __post_init__(self) -> None:
        require(self.max_grad_norm >= 0, "max_grad_norm", f"must be >= 0, got {self.max_grad_norm}")

    def rollout_size(self) -> RolloutSize | None:
        """Generation trainers: the size of one rollout iteration's samples (``None``: no rollout)."""
        return None


@dataclass(frozen=True, kw_only=True)
class DatasetTrainingArguments(TrainingArguments):
    """Arguments shared by dataset trainers (SFT, offline DPO)."""

    execution_contract: ClassVar[ExecutionContract] = DATASET
    gradient_accumulation_steps: int = 1
    """Batches per optimizer step. Every rank-local epoch must close every window: the number of
    batches per epoch must be a multiple of it (checked before training; no implicit flush)."""
    max_epochs: int = 1
    """Data epochs to train (``max_steps`` also stops the run)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            self.gradient_accumulation_steps >= 1,
            "gradient_accumulation_steps",
            f"must be an explicit integer >= 1, got {self.gradient_accumulation_steps}",
        )
        require(self.max_epochs >= 1, "max_epochs", f"must be >= 1, got {self.max_epochs}")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """The whole resolved run configuration (written to ``run.json``)."""

    seed: int
    """Seeds everything: sampling noise, data order, timestep draws."""
    trainer: str
    """A registered trainer name."""
    max_steps: int
    """Stop after exactly this many optimizer steps (inside a rollout iteration if need be)."""
    model: ModelConfig
    train: TrainingArguments
    data: DataConfig = field(default_factory=DataConfig)
    optimizers: tuple[OptimizerConfig, ...] | None = None
    """One entry per trainable role; roles left out get the ``OptimizerConfig`` defaults (AdamW). Left
    out (or ``null``): every role gets the defaults; an empty list is refused (it configures nothing)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        require(self.max_steps >= 1, "max_steps", f"must be >= 1, got {self.max_steps}")
        require(0 <= self.seed < 2**63, "seed", f"must be in [0, 2**63), got {self.seed}")
        require(
            self.optimizers is None or len(self.optimizers) >= 1,
            "optimizers",
            "is an empty list: list one entry per trainable role, or leave the key out for the defaults",
        )
        roles = [entry.role for entry in self.optimizers or ()]
        duplicates = sorted({role for role in roles if roles.count(role) > 1})
        require(not duplicates, "optimizers", f"roles listed more than once: {duplicates}")

    def optimizer_for(self, role: str) -> OptimizerConfig:
        """The optimizer entry of ``role`` (defaults when the config does not list it)."""
        for entry in self.optimizers or ():
            if entry.role == role:
                return entry
        return OptimizerConfig(role=role)

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form (tuples as lists), as written to ``run.json``."""
        return _to_plain(dataclasses.asdict(self))


# --------------------------------------------------------------------------------------------------
# Generic parsing
# --------------------------------------------------------------------------------------------------


def _to_plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: _to_plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_to_plain(item) for item in value]
    return value


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def parse_value(annotation: Any, value: Any, path: str) -> Any:
    """Convert a YAML value to ``annotation`` (a dataclass, Literal, Optional, tuple, scalar)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if dataclasses.is_dataclass(annotation):
        return parse_dataclass(annotation, value, path)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [arg for arg in args if arg is not type(None)]
        if len(options) != 1:
            raise ConfigError(path, f"unsupported union type {annotation}")
        return parse_value(options[0], value, path)
    if origin is Literal:
        if value not in args:
            raise ConfigError(path, f"must be one of {list(args)}, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(path, f"must be a list, got {_describe(value)}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(parse_value(args[0], item, f"{path}[{i}]") for i, item in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(path, f"must be a list of {len(args)} values, got {len(value)}")
        return tuple(parse_value(arg, item, f"{path}[{i}]") for i, (arg, item) in enumerate(zip(args, value)))
    if origin is dict or annotation is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(path, f"must be a mapping, got {_describe(value)}")
        return dict(value)
    return _parse_scalar(annotation, value, path)


def _parse_scalar(annotation: Any, value: Any, path: str) -> Any:
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"must be true or false, got {_describe(value)}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"must be an integer, got {_describe(value)}")
        return value
    if annotation is float:
        number = _parse_float(value, path)
        if not math.isfinite(number):
            raise ConfigError(path, f"must be a finite number, got {value!r}")
        return number
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"must be a string, got {_describe(value)}")
        return value
    if annotation is Any:
        return value
    raise ConfigError(path, f"unsupported field type {annotation}")


def _parse_float(value: Any, path: str) -> float:
    if isinstance(value, str):  # PyYAML reads 1e-3 as a string (see the module docstring)
        try:
            return float(value)
        except ValueError:
            raise ConfigError(path, f"must be a number, got {_describe(value)}") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(path, f"must be a number, got {_describe(value)}")
    try:
        return float(value)
    except OverflowError:  # an integer beyond the float range
        raise ConfigError(path, f"must be a finite number, got {value!r}") from None


def parse_dataclass(cls: type, data: Any, path: str = "") -> Any:
    """Build the frozen dataclass ``cls`` from a mapping, naming the field of every error."""
    if not isinstance(data, Mapping):
        raise ConfigError(path, f"must be a mapping, got {_describe(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields), key=str)  # YAML keys need not be strings
    if unknown:
        raise ConfigError(
            _join(path, str(unknown[0])), f"unknown field; valid fields: {', '.join(sorted(fields))}"
        )
    kwargs = {}
    for name, spec in fields.items():
        if name in data:
            kwargs[name] = parse_value(hints[name], data[name], _join(path, name))
        elif spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
            raise ConfigError(_join(path, name), "required field is missing")
    try:
        return cls(**kwargs)
    except ConfigError as error:  # __post_init__ names the field relative to ``cls``
        raise ConfigError(_join(path, error.field), error.message) from None


def _reward_specs(value: Any, path: str) -> typing.Iterator[tuple[str, RewardSpec]]:
    """Every ``RewardSpec`` inside a parsed config, with its dotted path (``train.rewards[0]``)."""
    if isinstance(value, RewardSpec):
        yield path, value
    elif dataclasses.is_dataclass(value):
        for spec in dataclasses.fields(value):
            yield from _reward_specs(getattr(value, spec.name), _join(path, spec.name))
    elif isinstance(value, tuple):
        for index, item in enumerate(value):
            yield from _reward_specs(item, f"{path}[{index}]")


def check_rewards(config: RunConfig) -> None:
    """Build every configured reward once: an unknown name or bad kwargs is a ``ConfigError`` at load.

    (Here rather than in ``RewardSpec.__post_init__``: the reward registry imports torch, this module
    does not.)
    """
    from reference_trainer.rewards import check_reward

    for path, spec in _reward_specs(config, ""):
        try:
            check_reward(spec.name, spec.kwargs)
        except ConfigError as error:
            raise ConfigError(_join(path, error.field), error.message) from None


# --------------------------------------------------------------------------------------------------
# Loading: file -> overrides -> RunConfig
# --------------------------------------------------------------------------------------------------


class _NoDuplicateKeys:
    """A loader mixin that refuses a key given twice in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            if not isinstance(key, typing.Hashable):
                continue  # SafeLoader itself refuses an unhashable key
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"key {key!r} is given twice",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)  # type: ignore[misc]


class _StrictLoader(_NoDuplicateKeys, yaml.SafeLoader):
    """``yaml.SafeLoader`` without duplicate keys: PyYAML's own parser, whose error messages the
    config errors quote."""


class _FastStrictLoader(_NoDuplicateKeys, getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """The same loader on libyaml's parser when PyYAML has it (several times faster; the same
    safe constructor and resolver, so the same values); a document it refuses is re-read by
    ``_StrictLoader`` for the error message."""


def _yaml_problem(error: yaml.YAMLError) -> tuple[str, str]:
    """(``line:column`` or "", the problem in one line) of a PyYAML error."""
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    where = f"{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
    if isinstance(error, yaml.reader.ReaderError):
        where = f"byte {error.position}"
        problem = f"unacceptable character #x{error.character:04x}: {error.reason}"
    else:
        parts = [getattr(error, "context", None), getattr(error, "problem", None)]
        problem = "; ".join(part for part in parts if part) or str(error)
    return where, " ".join(problem.split())


def parse_yaml(text: str, where: str) -> Any:
    """``text`` as YAML (safe, no duplicate keys); a ``ConfigError`` naming ``where`` and the line."""
    try:
        return yaml.load(text, Loader=_FastStrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError:
        pass  # the message comes from PyYAML's own parser, the same with or without libyaml
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as error:
        position, problem = _yaml_problem(error)
        hint = " (YAML indents with spaces, never tabs)" if "'\\t'" in problem else ""
        raise ConfigError("", f"{where}{':' + position if position else ''}: {problem}{hint}") from None


def apply_overrides(raw: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Apply ``dotted.key=value`` overrides to a raw config mapping (returns a new mapping)."""
    result = copy.deepcopy(dict(raw))  # the caller's mapping is left as it was
    for override in overrides:
        key, sep, text = override.partition("=")
        if not sep or not key:
            raise ConfigError("--set", f"expected dotted.key=value, got {override!r}")
        value = parse_yaml(text, f"--set {key}")
        node: Any = result
        parts = key.split(".")
        for depth, part in enumerate(parts):
            last = depth == len(parts) - 1
            if isinstance(node, list):  # ``optimizers.0.lr=...`` indexes a list
                if not part.isdigit() or int(part) >= len(node):
                    where = ".".join(parts[: depth + 1])
                    raise ConfigError(where, f"is not an index of a list of {len(node)} entries")
                if last:
                    node[int(part)] = value
                else:
                    node = node[int(part)]
            elif isinstance(node, dict):
                if last:
                    node[part] = value
                else:
                    node = node.setdefault(part, {})
            else:
                where = ".".join(parts[:depth])
                raise ConfigError(where, "is not a mapping or a list; cannot set a key inside it")
    return result


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping from ``path`` (every failure is one ``ConfigError`` naming the file)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("", f"config file not found: {path}")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            "", f"{path}: not a UTF-8 text file (byte {error.start}); give a YAML config"
        ) from None
    parsed = parse_yaml(text, str(path))
    if not isinstance(parsed, dict):
        raise ConfigError(
            "", f"{path}: the top level must be a mapping of config fields, got {_describe(parsed)}"
        )
    return parsed


def parse_run_config(raw: Mapping[str, Any], arguments_cls: type) -> RunConfig:
    """Validate a raw mapping into a ``RunConfig``; ``train:`` is parsed with ``arguments_cls``."""
    if not isinstance(raw, Mapping):
        raise ConfigError("", "the config must be a mapping")
    data = dict(raw)
    backend = data.get("backend")
    if isinstance(backend, Mapping):
        for name in FSDP1_ONLY_FIELDS:
            if name in backend:
                raise ConfigError(
                    f"backend.{name}",
                    "is an FSDP1 option and FSDP1 is refused; fsdp2 shards per parameter and has no such field",
                )
    train = parse_dataclass(arguments_cls, data.pop("train", {}) or {}, "train")
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    unknown = sorted(set(data) - fields, key=str)
    if unknown:
        raise ConfigError(
            str(unknown[0]), f"unknown top-level field; valid fields: {', '.join(sorted(fields))}"
        )
    hints = typing.get_type_hints(RunConfig)
    kwargs: dict[str, Any] = {"train": train}
    for spec in dataclasses.fields(RunConfig):
        if spec.name == "train":
            continue
        if spec.name in data:
            kwargs[spec.name] = parse_value(hints[spec.name], data[spec.name], spec.name)
        elif spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
            raise ConfigError(spec.name, "required field is missing")
    try:
        return RunConfig(**kwargs)
    except ConfigError as error:
        raise ConfigError(error.field, error.message) from None


def load_config(
    path: str | Path | None = None,
    *,
    raw: Mapping[str, Any] | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    max_steps: int | None = None,
) -> RunConfig:
    """Load a config file (or a raw mapping), apply overrides, and validate it.

    The trainer name selects the TrainingArguments class from the registry; the contract equality
    between trainer and arguments is checked later, by ``build_run``, still before any model loads.
    """
    from reference_trainer.registry import resolve_trainer

    data = dict(raw) if raw is not None else read_yaml(path)  # type: ignore[arg-type]
    data = apply_overrides(data, overrides)
    if max_steps is not None:
        data["max_steps"] = max_steps
    trainer_name = data.get("trainer")
    if not isinstance(trainer_name, str):
        raise ConfigError("trainer", f"required string field is missing or invalid: {trainer_name!r}")
    try:
        _, arguments_cls = resolve_trainer(trainer_name)
    except KeyError as error:
        raise ConfigError("trainer", str(error)) from None
    config = parse_run_config(data, arguments_cls)
    check_rewards(config)
    return config
