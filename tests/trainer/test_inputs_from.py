"""``--inputs-from`` reads a target's inputs by (stage, rollout_iteration), a draw by (stage, step tags,
occurrence); the σ schedule is recomputed, never taken; bad stores are one-line errors; every registered
trainer takes every draw (a run with another seed fed a run's store is bit-equal to it)."""

from __future__ import annotations

import pytest
import torch

import ffdebug
from reference_trainer.errors import ConfigError
from reference_trainer.inputs_from import InputsFrom
from reference_trainer.registry import trainer_names

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
    # no noise in the store: drawn by the reference; the schedule is the reference's own, never taken
    assert forced.sampling(0, noise_level=0.7, sigmas=torch.linspace(1, 0, 5)) is None
    report = forced.report()
    assert report["taken"] == {"rollout.prompt_ids": [0], "train.order": [0]}
    assert report["recomputed"] == {"rollout.timesteps": [0]}
    assert report["not_taken"] == {"rollout.noise": [0], "rollout.sde_noise": [0]}


def test_a_draw_is_taken_by_its_step_tags_and_occurrence(tmp_path):
    """The k-th draw of a stage under some tags takes the target's k-th capture under the same tags
    (tag order and the phase included); one the target lacks is the reference's own, listed."""
    train = dict(optimizer_step=1, rollout_iteration=1, data_epoch=0, phase="train")
    with ffdebug.capture(dir=str(tmp_path), side="target"):
        with ffdebug.step(**train, microbatch=0):
            ffdebug.tap("train.noise", torch.full((2, 3), 1.0))
            ffdebug.tap("train.noise", torch.full((2, 3), 2.0))
        with ffdebug.step(**train, microbatch=1):
            ffdebug.tap("train.noise", torch.full((2, 3), 3.0))
    forced = InputsFrom(tmp_path / "target")
    own = torch.zeros(2, 3)
    tags = {"microbatch": 0, **train}  # another tag order
    assert float(forced.take("train.noise", tags, own)[0, 0]) == 1.0
    assert float(forced.take("train.noise", tags, own)[0, 0]) == 2.0
    assert forced.take("train.noise", tags, own) is own  # a third draw: the target made two
    assert float(forced.take("train.noise", {**train, "microbatch": 1}, own)[0, 0]) == 3.0
    rollout = {**train, "phase": "rollout", "microbatch": 1}
    assert forced.take("train.noise", rollout, own) is own  # another phase: not the same draw
    assert forced.report()["taken"] == {"train.noise": [1]}
    with pytest.raises(ConfigError, match=r"train.noise at .* has shape \[2, 3\], the reference draws \[4\]"):
        InputsFrom(tmp_path / "target").take("train.noise", {**train, "microbatch": 1}, torch.zeros(4))
    # an index draw outside its range (a target with other step counts) is an error, not a wrapped index
    with pytest.raises(ConfigError, match=r"train.noise at .* is \[\[3.0, 3.0, 3.0\], .* outside 0 \.\. 2"):
        InputsFrom(tmp_path / "target").take("train.noise", {**train, "microbatch": 1}, own, within=(0, 3))


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


@pytest.mark.integration
@pytest.mark.parametrize("name", trainer_names())
def test_another_seed_fed_a_runs_inputs_is_bit_equal_to_it(name, tmp_path):
    """Every registered trainer takes every draw with ``--inputs-from``: a run with another seed, fed
    the first run's store, is bit-equal to it at every stage (the seed only picks the draws), and its
    ``inputs_from.json`` lists nothing the store lacked."""
    import json

    from helpers import REPO
    from helpers.trainer.golden_utils import GOLDEN_OVERRIDES
    from helpers.trainer.trainer_utils import load

    import ffdebug
    from reference_trainer.run import train

    config = REPO / f"examples/{name}/full/sd3_tiny/default.yaml"
    overrides = GOLDEN_OVERRIDES.get(name, [])
    with ffdebug.capture(dir=str(tmp_path / "dumps"), side="ref"):
        train(load(config, *overrides, max_steps=2), tmp_path / "a")
    with ffdebug.capture(dir=str(tmp_path / "dumps"), side="target"):
        train(
            load(config, *overrides, "seed=1", max_steps=2),
            tmp_path / "b",
            inputs_from=tmp_path / "dumps" / "ref",
        )
    report = json.loads((tmp_path / "b" / "inputs_from.json").read_text())
    assert report["taken"] and report["not_taken"] == {}, report
    result = ffdebug.compare(tmp_path / "dumps" / "ref", tmp_path / "dumps" / "target")
    assert result.exit_code() == 0, result.first_divergence
    unequal = [(e.key, e.step) for e in result.stages if e.bit_equal != 1.0]
    assert not unequal, f"{name}: stages not bit-equal though every draw was taken: {unequal[:3]}"
