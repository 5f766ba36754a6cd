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
    backend:     {kind: single}   # or ddp under torchrun (docs/cli.md "Several processes")
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

The parts: ``config_schema`` (the dataclasses and their field checks), ``config_parse`` (values ->
dataclasses, naming the field), ``config_load`` (YAML, overrides, ``load_config``). This module
re-exports their public names: ``reference_trainer.config`` stays the import path of the whole
configuration.
"""

from __future__ import annotations

from reference_trainer.config_load import (
    apply_overrides,
    load_config,
    parse_run_config,
    parse_yaml,
    read_yaml,
)
from reference_trainer.config_parse import check_rewards, parse_dataclass, parse_value
from reference_trainer.config_schema import (
    BACKEND_KINDS,
    FSDP1_ONLY_FIELDS,
    BackendConfig,
    CheckpointConfig,
    DataConfig,
    DatasetTrainingArguments,
    EvalConfig,
    LogConfig,
    ModelConfig,
    OptimizerConfig,
    RewardSpec,
    RolloutSize,
    RunConfig,
    RuntimeConfig,
    TrainingArguments,
    misplaced_data_fields,
    require_unique_rewards,
)
from reference_trainer.errors import ConfigError, require

__all__ = [
    "BACKEND_KINDS",
    "FSDP1_ONLY_FIELDS",
    "BackendConfig",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "DatasetTrainingArguments",
    "EvalConfig",
    "LogConfig",
    "ModelConfig",
    "OptimizerConfig",
    "RewardSpec",
    "RolloutSize",
    "RunConfig",
    "RuntimeConfig",
    "TrainingArguments",
    "apply_overrides",
    "check_rewards",
    "load_config",
    "misplaced_data_fields",
    "parse_dataclass",
    "parse_run_config",
    "parse_value",
    "parse_yaml",
    "read_yaml",
    "require",
    "require_unique_rewards",
]
