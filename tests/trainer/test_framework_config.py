"""Contracts, registries and config validation: errors name the field; mismatches fail before loading."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
from helpers import REPO
from helpers.trainer.trainer_utils import GRPO_CONFIG, load


def test_validation_errors_name_the_field():
    from reference_trainer.errors import ConfigError

    cases = {
        "train.group_size=1": r"^train\.group_size: must be >= 2",
        "train.rewards.0.batch_size=0": r"^train\.rewards\[0\]\.batch_size: must be >= 1",
        "optimizers.0.lr=-1": r"^optimizers\[0\]\.lr: must be > 0",
        "optimizers.0.optimizer=sgd": r"^optimizers\[0\]\.optimizer: must be one of \['adamw', 'muon'\]",
        "train.kl_std=whatever": r"^train\.kl_std: must be one of",
        "train.group_sise=4": r"^train\.group_sise: unknown field",
        "runtime.threads=two": r"^runtime\.threads: must be an integer",
        "model.adapter=null": r"^model\.adapter: must be a string",
        "train.gradient_steps_per_iteration=3": r"^train\.gradient_steps_per_iteration: must divide the 8 samples",
        "checkpoint=3": r"^checkpoint: must be a mapping",
    }
    for override, pattern in cases.items():
        with pytest.raises(ConfigError, match=pattern):
            load(GRPO_CONFIG, override)
    with pytest.raises(ConfigError, match=r"^max_steps: must be >= 1"):
        load(GRPO_CONFIG, max_steps=0)


def test_sde_rollouts_need_two_steps_and_sigma_ranges_are_checked_at_load():
    """A one-step Flow-SDE rollout has no σ_1 to stand in at σ = 1: a config error, not a failure at step 1."""
    from reference_trainer.errors import ConfigError

    online_dpo = REPO / "examples/online_dpo/full/sd3_tiny/default.yaml"
    with pytest.raises(ConfigError, match=r"^train\.num_inference_steps: must be >= 2 with noise_level=0\.7"):
        load(online_dpo, "train.num_inference_steps=1")
    assert load(online_dpo, "train.num_inference_steps=1", "train.noise_level=0").train.noise_level == 0
    with pytest.raises(ConfigError, match=r"^train\.sigma_scheme: must be one of"):
        load(online_dpo, "train.sigma_scheme=cosine")
    sft = REPO / "examples/sft/full/sd3_tiny/default.yaml"
    with pytest.raises(ConfigError, match=r"^train\.sigma_min: need 0 <= sigma_min < sigma_max <= 1"):
        load(sft, "train.sigma_min=0.9", "train.sigma_max=0.5")


def test_yaml_numbers_and_overrides():
    """``1e-3`` (a string to PyYAML) is a float for float fields; ``--set`` reaches list entries."""
    config = load(GRPO_CONFIG, "optimizers.0.lr=1e-3", "train.rewards.0.kwargs={target: 0.5}")
    assert config.optimizers[0].lr == 1e-3
    assert config.train.rewards[0].kwargs == {"target": 0.5}
    assert config.optimizer_for("policy").optimizer == "adamw"


def test_trainer_list_is_derived_from_both_registries(monkeypatch):
    from reference_trainer import registry
    from reference_trainer.config import TrainingArguments
    from reference_trainer.contracts import GENERATION_REWARD

    # Independent of the registries: every algorithm ships its example config (README), so the
    # example folders name the trainers, and the list is sorted.
    examples = sorted(p.parent.parent.parent.name for p in REPO.glob("examples/*/full/sd3_tiny/default.yaml"))
    assert len(examples) >= 14 and "grpo" in examples
    assert registry.trainer_names() == examples

    @dataclass(frozen=True, kw_only=True)
    class OrphanArguments(TrainingArguments):
        execution_contract: ClassVar = GENERATION_REWARD

    monkeypatch.setitem(registry.ARGUMENTS, "orphan", OrphanArguments)
    assert "orphan" not in registry.trainer_names()
    with pytest.raises(registry.RegistryError, match="no registered trainer class"):
        registry.resolve_trainer("orphan")


# every registered trainer: (name, the contract both of its classes declare, dataset supervision)
CONTRACTS = [
    ("awm", "generation+runtime_reward", None),
    ("crd", "generation+runtime_reward", None),
    ("dgpo", "generation+runtime_reward", None),
    ("diffusion_opd", "generation+none", None),
    ("dmd2", "generation+none", None),
    ("dppo", "generation+runtime_reward", None),
    ("grpo", "generation+runtime_reward", None),
    ("grpo_guard", "generation+runtime_reward", None),
    ("nft", "generation+runtime_reward", None),
    ("offline_dpo", "dataset+none", "preference"),
    ("online_dpo", "generation+runtime_reward", None),
    ("sft", "dataset+none", "demonstration"),
    ("tdm", "generation+none", None),
    ("tdm_r1", "generation+runtime_reward", None),
]


@pytest.mark.parametrize(("name", "contract", "supervision"), CONTRACTS)
def test_each_trainer_and_its_arguments_declare_the_same_contract(name, contract, supervision):
    from reference_trainer import registry

    trainer_cls, arguments_cls = registry.resolve_trainer(name)
    assert trainer_cls.execution_contract == arguments_cls.execution_contract
    assert trainer_cls.execution_contract.describe() == contract
    assert trainer_cls.supervision == supervision


def test_the_contract_table_lists_every_registered_trainer():
    from reference_trainer import registry

    assert [row[0] for row in CONTRACTS] == registry.trainer_names()


def test_contract_mismatch_fails_before_any_model_loads(monkeypatch, tmp_path):
    """A trainer whose TrainingArguments declare another ExecutionContract is refused before loading."""
    from reference_trainer import registry
    from reference_trainer.adapters.sd3 import SD3TinyAdapter
    from reference_trainer.contracts import GENERATION_NO_FEEDBACK, ContractError
    from reference_trainer.run import build_trainer
    from reference_trainer.trainers.grpo import GRPOArguments, GRPOTrainer

    @dataclass(frozen=True, kw_only=True)
    class MismatchedArguments(GRPOArguments):
        execution_contract: ClassVar = GENERATION_NO_FEEDBACK

    monkeypatch.setitem(registry.TRAINERS, "mismatched", GRPOTrainer)
    monkeypatch.setitem(registry.ARGUMENTS, "mismatched", MismatchedArguments)

    def no_loading(self):
        raise AssertionError("a model loaded before the contract check")

    monkeypatch.setattr(SD3TinyAdapter, "load_pipeline", no_loading)
    config = load(GRPO_CONFIG, "trainer=mismatched")
    with pytest.raises(
        ContractError, match="generation\\+runtime_reward != arguments contract generation\\+none"
    ):
        build_trainer(config, tmp_path)


def test_invalid_contracts_are_rejected():
    from reference_trainer.contracts import ContractError, ExecutionContract

    with pytest.raises(ContractError, match="dataset trainer cannot consume a runtime reward"):
        ExecutionContract(acquisition="dataset", feedback="runtime_reward")
    with pytest.raises(ContractError, match="acquisition must be one of"):
        ExecutionContract(acquisition="rollout", feedback="none")


def test_dataset_trainer_needs_dataset_arguments():
    """The loop reads ``gradient_accumulation_steps`` and ``max_epochs``: a dataset trainer whose arguments
    lack them is refused when it is built, not when its first epoch ends."""
    from types import SimpleNamespace

    from reference_trainer.config import TrainingArguments
    from reference_trainer.trainers.sft import SFTTrainer

    class PlainArgumentsSFT(SFTTrainer):
        pass

    with pytest.raises(TypeError, match="must subclass DatasetTrainingArguments, got TrainingArguments"):
        PlainArgumentsSFT(SimpleNamespace(train=TrainingArguments()), adapter=None, output_dir="unused")


def test_libyaml_and_pyyaml_read_every_example_config_the_same():
    """Configs are parsed with libyaml's parser when PyYAML has it, and a refused document is re-read
    by PyYAML's own for the message (reference_trainer/config_load.py ``parse_yaml``): both give the same
    values for every example config, and the same error for a duplicate key."""
    import yaml

    from reference_trainer.config import ConfigError
    from reference_trainer.config_load import _FastStrictLoader, _StrictLoader, parse_yaml

    configs = sorted((REPO / "examples").rglob("*.yaml"))
    assert len(configs) >= 10
    for path in configs:
        text = path.read_text()
        assert yaml.load(text, Loader=_FastStrictLoader) == yaml.load(text, Loader=_StrictLoader), path
    with pytest.raises(ConfigError) as raised:
        parse_yaml("seed: 1\nseed: 2\n", "cfg.yaml")
    assert "cfg.yaml:2:1: while constructing a mapping; key 'seed' is given twice" in str(raised.value)
