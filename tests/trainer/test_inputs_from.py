"""``--inputs-from`` reads a target's inputs by (stage, rollout_iteration); bad stores are one-line errors."""

from __future__ import annotations

import pytest
import torch

import ffdebug
from reference_trainer.errors import ConfigError
from reference_trainer.inputs_from import InputsFrom

PROMPTS = ["a cat", "a dog", "a tree"]


def _ids(prompts):
    """A stand-in tokenizer: prompt i of PROMPTS -> [i + 2, 1, 1] (unknown prompts -> [9, 9, 9])."""
    return torch.tensor([[PROMPTS.index(p) + 2, 1, 1] if p in PROMPTS else [9, 9, 9] for p in prompts])


def _store(tmp_path, rows, *, renamed=False):
    key = "my.tokens" if renamed else "rollout.prompt_ids"
    with ffdebug.capture(dir=str(tmp_path), side="target"):
        with ffdebug.step(optimizer_step=0, rollout_iteration=0, data_epoch=0, phase="rollout"):
            ffdebug.tap(key, torch.tensor(rows))
        with ffdebug.step(optimizer_step=0, rollout_iteration=0, data_epoch=0, phase="train"):
            ffdebug.tap("train.order", torch.tensor([3, 1, 0, 2]))
    return tmp_path / "target"


def test_prompts_and_order_are_taken_and_the_rest_reported_not_taken(tmp_path):
    store = _store(tmp_path, [[4, 1, 1], [4, 1, 1], [2, 1, 1], [2, 1, 1]], renamed=True)
    forced = InputsFrom(store, maps=[r"^my\.tokens$=rollout.prompt_ids"])
    assert forced.prompts(0, 2, PROMPTS, _ids) == ["a tree", "a cat"]
    assert forced.order(0, 4).tolist() == [3, 1, 0, 2]
    assert forced.sampling(0, noise_level=0.7) is None  # no noise in the store: drawn by the reference
    report = forced.report()
    assert report["taken"] == {"rollout.prompt_ids": [0], "train.order": [0]}
    assert report["not_taken"] == {"rollout.noise": [0], "rollout.sde_noise": [0], "rollout.timesteps": [0]}


def test_unknown_prompt_mixed_group_and_empty_store_are_config_errors(tmp_path):
    unknown = InputsFrom(_store(tmp_path / "a", [[2, 1, 1], [7, 7, 7]]))
    with pytest.raises(ConfigError, match=r"row 1, is no prompt of data.prompts"):
        unknown.prompts(0, 2, PROMPTS, _ids)
    mixed = InputsFrom(_store(tmp_path / "b", [[2, 1, 1], [3, 1, 1]]))
    with pytest.raises(ConfigError, match=r"group 0 \(rows 0-1\) mixes prompts"):
        mixed.prompts(0, 2, PROMPTS, _ids)
    with ffdebug.capture(dir=str(tmp_path / "c"), side="target"):
        ffdebug.tap("reward", torch.ones(2))
    with pytest.raises(ConfigError, match=r"--inputs-from: .* holds none of rollout.prompt_ids"):
        InputsFrom(tmp_path / "c" / "target")
