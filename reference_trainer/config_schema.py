"""The run configuration's schema: the frozen dataclasses of every section, and their field checks.

Each dataclass checks its own fields in ``__post_init__`` (a ``ConfigError`` naming the field relative
to the dataclass; ``config_parse.parse_dataclass`` prefixes the dotted path). The file format these
sections are read from is described in ``reference_trainer.config``; reading and converting YAML is
``config_load`` / ``config_parse``. This module imports neither torch nor YAML.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

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


def _to_plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: _to_plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_to_plain(item) for item in value]
    return value
