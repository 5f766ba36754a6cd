"""A from-scratch offline Diffusion-DPO trainer compared with the reference through ``--inputs-from``.

``examples/external_trainer/offline_dpo.py`` imports nothing from ``reference_trainer``: its records
are read from the dataset files, its record order, σ and ε come from its own generator. The reference
takes them (``batch.sample_ids``, ``train.sigma``, ``train.noise``) and recomputes everything else,
so the two runs are bit-equal at every stage. Each planted bug is then named by one ``bisect`` at the
stage and optimizer step where it first acts:

* the rejected arm noised with its own ε (the pair must share one): the policy forward's input
  ``embed.latents``, step 0 (stages in capture order: before the velocity tapped after the forward);
* the velocity target x_0 − ε instead of ε − x_0: ``train.dpo_errors``, step 0;
* β instead of β/2 in the logit: ``grad_norm.policy``, step 0 (at θ = ref the loss is log 2 whatever
  β; only its gradient doubles);
* the microbatch loss not divided by the accumulation steps: ``loss.policy``, step 0;
* chosen and rejected swapped: ``batch.x0_chosen``, step 0;
* the reference the policy itself (no copy): ``grad_norm.reference``, step 0, the gradient of
  ``update.reference`` (policy and reference agree in value at step 0; only gradients show it);
* AdamW weight decay 0.01 instead of 0: ``update.policy``, step 0 (the gradient is equal).

Prompts CLIP-encoded as one batch are a harmless difference: bisect passes with the reference's
noise run (``data.encode_prompts_together=true``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from helpers import REPO, load_script

import ffdebug
from ffdebug.verdict import Severity

pytestmark = pytest.mark.integration

EXAMPLE = REPO / "examples/external_trainer"
CONFIG = EXAMPLE / "offline_dpo.yaml"


def _example():
    return load_script(EXAMPLE / "offline_dpo.py", "external_offline_dpo")


def _target(dumps: Path, side: str, *args: str, example=None) -> None:
    with ffdebug.capture(dir=str(dumps), side=side):
        (example or _example()).main(list(args))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """D/target (3 steps), D/ref (--inputs-from D/target), D/batched (prompts encoded in one batch),
    D/noise (the reference with its prompts encoded in one batch, fed the same inputs)."""
    from reference_trainer.config import load_config
    from reference_trainer.run import train

    root = tmp_path_factory.mktemp("external_dpo")
    dumps = root / "dumps"
    _target(dumps, "target")
    for side, overrides in (("ref", ()), ("noise", ("data.encode_prompts_together=true",))):
        with ffdebug.capture(dir=str(dumps), side=side):
            train(
                load_config(CONFIG, overrides=overrides), root / f"{side}_run", inputs_from=dumps / "target"
            )
    _target(dumps, "batched", "--batched-prompts")
    return root


@pytest.mark.numeric
def test_own_rng_and_code_compare_bit_exact_with_inputs_from(runs):
    import json

    taken = json.loads((runs / "ref_run" / "inputs_from.json").read_text())
    assert set(taken["taken"]) == {"batch.sample_ids", "train.sigma", "train.noise"}
    assert taken["not_taken"] == {}
    result = ffdebug.compare(runs / "dumps" / "ref", runs / "dumps" / "target")
    assert result.exit_code() == 0 and result.verdict is Severity.OK, result.first_divergence
    assert all(e.bit_equal == 1.0 for e in result.stages)  # the same maths in another codebase
    keys = {e.key for e in result.stages}
    assert {
        "batch.x0_chosen",
        "train.dpo_errors",
        "loss.policy",
        "grad_norm.reference",
        "update.policy",
    } <= keys
    assert {e.step["optimizer_step"] for e in result.stages if e.key == "update.policy"} == {0, 1, 2}
    assert {e.step["data_epoch"] for e in result.stages if e.key == "loss.policy"} == {0, 1}


def test_the_reference_without_inputs_from_stops_at_the_gate(runs, tmp_path):
    """The reference's own record order is another input: exit 3 at batch.sample_ids, not a bug."""
    from ffdebug.errors import InputIdsMismatch
    from reference_trainer.config import load_config
    from reference_trainer.run import train

    with ffdebug.capture(dir=str(tmp_path), side="own"):
        train(load_config(CONFIG, overrides=("max_steps=1",)), tmp_path / "own_run")
    with pytest.raises(InputIdsMismatch) as raised:
        ffdebug.compare(tmp_path / "own", runs / "dumps" / "target", allow_partial=True)
    message = str(raised.value)
    assert (
        message.startswith("batch.sample_ids (dataset sample ids) differs at ")
        and "optimizer_step=0" in message
    )


@pytest.mark.numeric
def test_batched_prompt_encoding_passes_bisect_with_the_noise_run(runs):
    dumps = runs / "dumps"
    result = ffdebug.bisect(dumps / "ref", dumps / "batched", noise=dumps / "noise")
    assert result.exit_code() == 0 and result.judgement is Severity.OK, result.notes


def _bugs(example):
    def own_noise(eps, rng):
        return torch.randn(eps.shape, generator=torch.Generator().manual_seed(1))  # not the run's draws

    def wrong_target(x0, eps):
        return x0 - eps

    dpo_loss, chosen_rejected = example.dpo_loss, example.chosen_rejected  # the correct ones

    def beta_not_halved(e_w, e_l, e_ref_w, e_ref_l, beta):
        return dpo_loss(e_w, e_l, e_ref_w, e_ref_l, 2.0 * beta)

    def swapped(images, pairs):
        chosen, rejected = chosen_rejected(images, pairs)
        return rejected, chosen

    @dataclasses.dataclass(frozen=True)
    class Decayed(example.Settings):
        weight_decay: float = 0.01

    return {
        "rejected_own_noise": ("rejected_noise", own_noise, "embed.latents"),
        "target_sign": ("velocity_target", wrong_target, "train.dpo_errors"),
        "beta_not_halved": ("dpo_loss", beta_not_halved, "grad_norm.policy"),
        "no_accumulation_divisor": ("accumulation_divisor", lambda s: 1, "loss.policy"),
        "chosen_rejected_swapped": ("chosen_rejected", swapped, "batch.x0_chosen"),
        "reference_is_policy": ("copy_reference", lambda policy: policy, "grad_norm.reference"),
        "weight_decay": ("Settings", Decayed, "update.policy"),
    }


BUGS = [
    "rejected_own_noise",
    "target_sign",
    "beta_not_halved",
    "no_accumulation_divisor",
    "chosen_rejected_swapped",
    "reference_is_policy",
    "weight_decay",
]


@pytest.mark.parametrize("bug", BUGS)
def test_planted_bug_is_named_at_its_stage_and_step(runs, tmp_path, monkeypatch, bug):
    example = _example()
    name, replacement, stage = _bugs(example)[bug]
    monkeypatch.setattr(example, name, replacement)
    _target(tmp_path, "buggy", "--steps", "1", example=example)

    result = ffdebug.bisect(runs / "dumps" / "ref", tmp_path / "buggy", allow_partial=True)
    first = result.first_divergence
    assert (first.key, first.step["optimizer_step"]) == (stage, 0), result.notes
    assert result.exit_code() == 1 and result.judgement.rank >= Severity.BUG.rank
    sentence = next(n for n in result.notes if n.startswith("training order:"))
    assert f"optimizer_step 0, {stage}" in sentence
    if stage == "grad_norm.reference":
        assert "the gradient of update.reference" in sentence
