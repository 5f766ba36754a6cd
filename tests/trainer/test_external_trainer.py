"""A from-scratch trainer compared with the reference through the tap contract (docs/trainer-taps.md).

``examples/external_trainer/flow_grpo.py`` imports nothing from ``reference_trainer``; it has its own
RNG (prompts, noise, sample order) and its own stage names (``taps.txt`` maps them). The reference
takes the target's inputs with ``--inputs-from``, so the two runs compare ``ok`` stage by stage, also
with a harmless numerical difference (prompts CLIP-encoded as one batch). Each injected bug is then
located at the optimizer step and stage where it first acts, by one ``bisect``:

* advantages normalised over the batch instead of per group: ``advantage`` of step 0 (rollout);
* the log-prob's std without √(−Δt): ``rollout.log_prob`` of step 0 (the samples are unchanged);
* the KL term under ``no_grad`` at β = 0.01: nothing differs at step 0 (policy = reference, the KL
  gradient is zero), and at step 1 the policy gradient is the first stage that differs: a sampled
  ``grad.policy.<group>`` of step 1 (the runs tap sampled gradients, FFDEBUG_FWD_DUMP_GRAD_SAMPLE);
  with batched prompt encoding every stage differs a little, and one bisect with a noise run (the
  reference with its prompts encoded in one batch) still names the gradient of step 1, while the correct trainer with
  batched encoding passes with that noise run;
* the reference aliased to the policy (never frozen): ``grad_norm.reference`` of step 0 (a role the
  reference trainer holds no gradient for takes one), named as the gradient of ``update.reference``.
"""

from __future__ import annotations

import fnmatch
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import REPO, load_script

import ffdebug
from ffdebug.verdict import Severity

pytestmark = pytest.mark.integration

EXAMPLE = REPO / "examples/external_trainer"
TAPS = str(EXAMPLE / "taps.txt")


def _example():
    return load_script(EXAMPLE / "flow_grpo.py", "external_flow_grpo")


GRAD_SAMPLE = 16  # sampled gradient elements per parameter tensor (grad.<role>.<group>)


def _target(dumps: Path, side: str, *args: str, example=None) -> None:
    with ffdebug.capture(dir=str(dumps), side=side, grad_sample=GRAD_SAMPLE):
        (example or _example()).main(list(args))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """D/target (3 steps), D/ref (the reference, --inputs-from D/target), D/batched (3 steps, the
    prompts encoded in one batch), D/noise (the reference again with its new prompts encoded in one
    batch, data.encode_prompts_together: a noise run)."""
    from reference_trainer.config import load_config
    from reference_trainer.run import train

    root = tmp_path_factory.mktemp("external")
    dumps = root / "dumps"
    _target(dumps, "target")
    for side, overrides in (("ref", ()), ("noise", ("data.encode_prompts_together=true",))):
        with ffdebug.capture(dir=str(dumps), side=side, grad_sample=GRAD_SAMPLE):
            train(
                load_config(EXAMPLE / "reference.yaml", overrides=overrides),
                root / f"{side}_run",
                inputs_from=dumps / "target",
                inputs_map_file=TAPS,
            )
    _target(dumps, "batched", "--batched-prompts")
    return root


@pytest.mark.numeric
def test_own_rng_and_names_compare_ok_for_three_steps_with_inputs_from(runs):
    import json

    dumps = runs / "dumps"
    taken = json.loads((runs / "ref_run" / "inputs_from.json").read_text())
    inputs = ("rollout.prompt_ids", "rollout.noise", "rollout.sde_noise", "train.order")
    assert taken["taken"] == {key: [0, 1, 2] for key in inputs} and taken["not_taken"] == {}
    # the σ schedule is the configuration's: recomputed, and the gate found the target's equal
    assert taken["recomputed"] == {"rollout.timesteps": [0, 1, 2]}

    result = ffdebug.compare(dumps / "ref", dumps / "target", alias_file=TAPS)
    assert result.exit_code() == 0 and result.verdict is Severity.OK, result.first_divergence
    keys = {e.key for e in result.stages}
    assert {"train.log_prob", "train.kl", "loss.policy", "grad_norm.policy", "update.reference"} <= keys
    steps = {e.step["optimizer_step"] for e in result.stages if e.key == "update.policy"}
    assert steps == {0, 1, 2}
    grads = [e for e in result.stages if e.key.startswith("grad.policy.")]  # sampled, same indices
    assert {e.key for e in grads} >= {"grad.policy.transformer_blocks.0", "grad.policy.proj_out"}
    assert {e.step["optimizer_step"] for e in grads} == {0, 1, 2} and all(e.bit_equal == 1.0 for e in grads)
    assert any(e.key == "grad_norm.policy.transformer_blocks.0" for e in result.stages)


@pytest.mark.numeric
def test_batched_prompt_encoding_is_a_harmless_difference(runs):
    dumps = runs / "dumps"
    result = ffdebug.compare(dumps / "ref", dumps / "batched", alias_file=TAPS)
    assert result.exit_code() == 0 and result.verdict is Severity.OK, result.first_divergence
    assert any(not e.bit_equal for e in result.stages), (
        "batched encoding changed no bit: no difference tested"
    )
    losses = [e for e in result.stages if e.key == "loss.policy" and e.step["optimizer_step"] == 0]
    assert losses and all(abs(e.max_abs or 0.0) < 1e-6 for e in losses)


def test_different_prompts_and_noise_stop_at_the_inputs_gate(runs, tmp_path):
    """Without --inputs-from the reference draws its own prompts and noise: exit 3 names the input."""
    from ffdebug.errors import InputIdsMismatch

    _target(tmp_path, "other_seed", "--steps", "1", "--seed", "11")
    with pytest.raises(InputIdsMismatch) as raised:
        ffdebug.compare(runs / "dumps" / "ref", tmp_path / "other_seed", alias_file=TAPS, allow_partial=True)
    assert raised.value.exit_code == 3
    message = str(raised.value)
    # the gate checks the inputs in the tap contract's order, prompts first (inputs_gate.TRAINER_INPUTS),
    # and the seeds already draw other prompts at step 0 (seed 7: prompts 3 and 2; seed 11: 1 and 0)
    assert message.startswith("rollout.prompt_ids (prompts) differs at ") and "optimizer_step=0" in message, (
        f"the prompts differ first (seed 11 draws other prompts than seed 7 at step 0): {message}"
    )
    assert "feed both runs the same prompts / noise" in message


def _per_batch(r, group, eps):
    """The bug: one mean and std over the whole batch instead of each group of K."""
    r = r.double()
    return ((r - r.mean()) / (r.std(unbiased=False) + eps)).float()


def _bugs(example):
    log_prob, kl_term = example.log_prob, example.kl_term

    def no_sqrt_dt(x_next, mean, sig, dt):
        return log_prob(x_next, mean, sig, -torch.ones_like(dt))  # √(−Δt) → 1: std = σ_t

    def kl_no_grad(*args):
        with torch.no_grad():
            return kl_term(*args)

    class Policy:  # "reference = policy": no copy, and its requires_grad_(False) freezes nothing
        def __init__(self, module):
            self.module = module

        def requires_grad_(self, flag):
            return self.module

    aliased = types.SimpleNamespace(deepcopy=Policy)
    return {
        "advantages_per_batch": ("advantages", _per_batch, "advantage", 0),
        "log_prob_missing_sqrt_dt": ("log_prob", no_sqrt_dt, "rollout.log_prob", 0),
        "kl_under_no_grad": ("kl_term", kl_no_grad, "grad.policy.*", 1),
        "unfrozen_reference": ("copy", aliased, "grad_norm.reference", 0),
    }


@pytest.mark.parametrize(
    "bug", ["advantages_per_batch", "log_prob_missing_sqrt_dt", "kl_under_no_grad", "unfrozen_reference"]
)
def test_injected_bug_is_located_at_its_optimizer_step_and_stage(runs, tmp_path, monkeypatch, bug):
    example = _example()
    name, replacement, stage, step = _bugs(example)[bug]
    monkeypatch.setattr(example, name, replacement)
    _target(tmp_path, "buggy", "--steps", str(step + 1), example=example)  # up to the step it acts at

    result = ffdebug.bisect(runs / "dumps" / "ref", tmp_path / "buggy", alias_file=TAPS, allow_partial=True)
    first = result.first_divergence
    assert fnmatch.fnmatchcase(first.key, stage) and first.step["optimizer_step"] == step, result.notes
    assert result.exit_code() == 1 and result.judgement.rank >= Severity.BUG.rank
    sentence = next(n for n in result.notes if n.startswith("training order:"))
    assert f"optimizer_step {step}, {first.key}" in sentence
    if stage == "grad_norm.reference":
        assert "the gradient of update.reference" in sentence
        assert "reference: grad_norm.reference at optimizer_step 0" in sentence
        from ffdebug.store.reader import open_side

        frozen = [r.load() for r in open_side(runs / "dumps" / "ref").records if r.key == "update.reference"]
        assert frozen and all(int(np.count_nonzero(u)) == 0 for u in frozen)


GROUP_GRADS = ("grad.policy.*", "grad_norm.policy.*")  # the sampled taps, for a run without them


@pytest.mark.numeric
def test_batched_encoding_passes_bisect_with_a_noise_run(runs):
    """Without a noise run, the first stage that is not bit-equal after bit-equal ones is a bug
    signal; with one (the reference with its prompts encoded in one batch: the same kind of harmless
    change), every stage's error is within the noise run's and bisect passes."""
    dumps = runs / "dumps"
    noise = ffdebug.compare(dumps / "ref", dumps / "noise", alias_file=TAPS)
    assert any(not e.bit_equal for e in noise.stages), "the noise run equals the reference: no scale"

    alone = ffdebug.bisect(dumps / "ref", dumps / "batched", alias_file=TAPS)
    assert alone.exit_code() == 1 and alone.signal is not None  # the exact-prefix signal

    result = ffdebug.bisect(dumps / "ref", dumps / "batched", alias_file=TAPS, noise=dumps / "noise")
    assert result.exit_code() == 0 and result.judgement is Severity.OK, result.notes
    assert result.first_divergence is None and not any(e.beyond_noise for e in result.stages)


@pytest.mark.numeric
def test_kl_under_no_grad_with_batched_encoding_is_located_beyond_noise(runs, tmp_path, monkeypatch):
    """The KL bug and the harmless batched encoding together: every stage differs from the
    reference, but only the gradient of step 1 by far more than the noise run does."""
    example = _example()
    name, replacement, _, _ = _bugs(example)["kl_under_no_grad"]
    monkeypatch.setattr(example, name, replacement)
    _target(tmp_path, "buggy", "--steps", "2", "--batched-prompts", example=example)
    dumps = runs / "dumps"
    opts = dict(alias_file=TAPS, allow_partial=True, noise=dumps / "noise")

    result = ffdebug.bisect(dumps / "ref", tmp_path / "buggy", **opts)
    first = result.first_divergence
    assert first.key.startswith("grad.policy.") and first.step["optimizer_step"] == 1, result.notes
    assert first.beyond_noise and result.exit_code() == 1 and result.judgement.rank >= Severity.BUG.rank
    before = [
        e for e in result.stages if e.step["optimizer_step"] == 0 or e.key.startswith(("rollout", "L0"))
    ]
    assert not any(e.beyond_noise for e in before)  # the forwards differ, but no more than the noise

    # Without the sampled gradients the scalar path lands at step 1 on the gradient's norm or on
    # the update it makes: the missing KL term moves the norm by ~3e-4 relative, beyond the noise
    # where the noise run's norm differs from the reference at all, but inside the ok band where
    # that norm comes out bit-identical (so the noise gives no scale there: on AVX-512 at
    # ATEN_CPU_CAPABILITY=default); the update then differs by ~3e-3, beyond the noise either way.
    scalar = ffdebug.bisect(dumps / "ref", tmp_path / "buggy", exclude=GROUP_GRADS, **opts)
    first = scalar.first_divergence
    assert first.key in ("grad_norm.policy", "update.policy"), scalar.notes
    assert first.step["optimizer_step"] == 1 and first.beyond_noise, scalar.notes


def test_another_schedule_shift_stops_at_the_gate_naming_the_schedule(tmp_path):
    """A target whose σ schedule uses shift 1 (the reference's config: 3): --inputs-from takes its
    noise but recomputes the schedule, and compare exits 3 naming it and where it comes from."""
    from ffdebug.errors import InputIdsMismatch
    from reference_trainer.config import load_config
    from reference_trainer.run import train

    dumps = tmp_path / "dumps"
    _target(dumps, "target", "--steps", "1", "--shift", "1.0")
    with ffdebug.capture(dir=str(dumps), side="ref"):
        overrides = ("max_steps=1",)
        train(
            load_config(EXAMPLE / "reference.yaml", overrides=overrides),
            tmp_path / "ref_run",
            inputs_from=dumps / "target",
            inputs_map_file=TAPS,
        )
    with pytest.raises(InputIdsMismatch) as raised:
        ffdebug.compare(dumps / "ref", dumps / "target", alias_file=TAPS)
    assert raised.value.exit_code == 3
    message = str(raised.value)
    assert message.startswith("rollout.timesteps (σ schedule) differ at "), message
    assert "first at index [1]" in message  # σ_0 = 1 under any shift
    assert "computes them from train.num_inference_steps=4 and the scheduler of model.fixture_dir" in message
    assert "shift=3.0" in message


@pytest.mark.numeric
def test_kl_under_no_grad_is_named_at_step_1_though_step_2_drifts(runs, tmp_path, monkeypatch):
    """The whole 3-step run, no sampled gradients: the gradient norm of step 1 is the first stage that
    is not bit-equal after bit-equal ones; later steps drift further, and must not hide it."""
    example = _example()
    name, replacement, _, _ = _bugs(example)["kl_under_no_grad"]
    monkeypatch.setattr(example, name, replacement)
    with ffdebug.capture(dir=str(tmp_path), side="buggy"):
        example.main([])
    result = ffdebug.bisect(
        runs / "dumps" / "ref", tmp_path / "buggy", alias_file=TAPS, allow_partial=True, exclude=GROUP_GRADS
    )
    first = result.first_divergence
    assert (first.key, first.step["optimizer_step"]) == ("grad_norm.policy", 1), result.notes
    assert result.exit_code() == 1 and result.judgement.rank >= Severity.BUG.rank
    compared = ffdebug.compare(
        runs / "dumps" / "ref", tmp_path / "buggy", alias_file=TAPS, allow_partial=True, exclude=GROUP_GRADS
    )
    later = [e for e in compared.stages if e.step.get("optimizer_step") == 2 and not e.ok]
    assert later, "step 2 is within the ok band: nothing tests that a later drift does not hide step 1"
