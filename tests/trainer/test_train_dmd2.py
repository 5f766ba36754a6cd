"""DMD2 on tiny SD3: phase order, the fake score learns the generator's distribution, frozen teacher,
and both trainable roles move (exact resume: test_resume.py)."""

import pytest
import torch
from helpers.trainer.trainer_utils import (
    assert_bit_identical,
    assert_every_parameter_changed,
    frozen_state,
    make_trainer,
    metrics,
    variant_state,
)

from reference_trainer.flow_matching import interpolate, predicted_x0
from reference_trainer.losses.dmd2 import fake_score_loss

pytestmark = pytest.mark.integration  # every test here spawns a process, runs a trainer or kills one

EVAL_PROMPTS = ["a red cat", "a blue dog", "a green tree", "a yellow sun"] * 2


@torch.no_grad()
def fake_score_error(trainer, fake_parameters) -> float:
    """L_fake of the given fake-score weights on a fixed batch of the *current* generator's samples."""
    g = torch.Generator().manual_seed(99)
    condition = trainer.adapter.encode_prompt(EVAL_PROMPTS)
    n = len(EVAL_PROMPTS)
    z = torch.randn((n, *trainer.adapter.latent_shape), generator=g)
    ones = torch.ones(n)
    x = predicted_x0(
        z, trainer.adapter.forward(z, ones, condition, module=trainer.variants.variant("generator")), ones
    )
    sigma = 0.02 + 0.96 * torch.rand(n, generator=g)
    noise = torch.randn(x.shape, generator=g)
    x_t = interpolate(x, noise, sigma)
    fake = trainer.variants.variant("fake")
    v = trainer.adapter.forward(x_t, sigma, condition, module=fake, parameters=fake_parameters)
    return fake_score_loss(v, noise, x)[0].item()


def test_dmd2_trains_fake_then_generator(tmp_path):
    """24 steps = 8 rollout iterations of (fake, fake, generator). The fake score, trained on the
    generator's samples, fits the final generator's distribution better than its initial weights
    (= the teacher's) do; the teacher snapshot and the frozen components are bit-identical."""
    trainer = make_trainer("dmd2", tmp_path, 24)
    frozen, initial = frozen_state(trainer), variant_state(trainer)
    teacher = trainer.variants.snapshot("teacher")
    assert all(torch.equal(teacher[key], initial["generator"][key]) for key in teacher)
    trainer.start()
    records = metrics(tmp_path)
    assert [r["role"] for r in records] == ["fake", "fake", "generator"] * 8
    before = fake_score_error(trainer, initial["fake"])
    after = fake_score_error(trainer, None)
    fake_losses = [r["loss"] for r in records if r["role"] == "fake"]
    dm_losses = [r["loss"] for r in records if r["role"] == "generator"]
    print(
        f"DMD2 fake-score loss on the final generator's samples: initial weights {before:.4f} -> trained {after:.4f}"
    )
    print(f"DMD2 fake loss per step {[round(v, 3) for v in fake_losses]}")
    print(f"DMD2 generator DM pseudo-loss per step {[round(v, 4) for v in dm_losses]}")
    assert after < before
    assert all(v > 0 for v in dm_losses) and all(
        r["grad_norm.generator"] > 0 for r in records if r["role"] == "generator"
    )
    assert_bit_identical(frozen, frozen_state(trainer))
    for role in ("generator", "fake"):
        assert_every_parameter_changed(trainer, initial[role], trainer.variants.variant(role), role)


def test_dmd2_distils_a_multistep_teacher_into_one_step(tmp_path):
    """With a random-init teacher its one-step and multi-step samples nearly coincide, so there is
    nothing to distil. Here the teacher is first fitted to the tiny dataset by SFT (48 steps); DMD2
    (canonically) starts generator and fake score from it. Its one-step samples G(z) are then far from
    its 8-step ODE samples; 24 DMD2 steps must bring them closer: the evaluation's MMD² between the two
    sample sets (and the per-noise MSE) falls from the initial to the final generator."""
    import json
    import shutil

    sft = make_trainer(
        "sft",
        tmp_path / "sft",
        48,
        "train.max_epochs=1000",
        "train.gradient_accumulation_steps=1",
        "optimizers.0.lr=3e-3",
    )
    sft.start()
    teacher_dir = tmp_path / "teacher"
    shutil.copytree(sft.adapter.fixture_dir, teacher_dir)
    sft.variants.variant("policy").save_pretrained(teacher_dir / "transformer")
    overrides = (f"model.fixture_dir={teacher_dir}", "eval.every=24", "eval.samples_per_prompt=4")
    trainer = make_trainer("dmd2", tmp_path / "dmd2", 24, *overrides)
    trainer.start()
    start, end = (json.loads(line) for line in (tmp_path / "dmd2/eval.jsonl").read_text().splitlines())
    print(
        f"DMD2 one-step generator vs 8-step teacher: MMD² {start['eval.teacher_mmd']:.4f} -> "
        f"{end['eval.teacher_mmd']:.4f}, paired MSE {start['eval.teacher_paired_mse']:.4f} -> "
        f"{end['eval.teacher_paired_mse']:.4f}"
    )
    assert end["eval.teacher_mmd"] < 0.8 * start["eval.teacher_mmd"]
    assert end["eval.teacher_paired_mse"] < 0.9 * start["eval.teacher_paired_mse"]
