"""TDM: the re-noise, importance weight, SNR cap and both losses against hand values and the reference's
DDPM-form lines; the arguments are validated with the field named; on the tiny SD3 model it distils an
SFT-fitted teacher (MMD² and paired MSE to the teacher's samples fall), the teacher and frozen
components stay bit-identical, both trainable roles change, the first steps match the golden and two
identical dumped runs compare ``ok`` with every stage tapped (exact resume: test_resume.py)."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from helpers.trainer.golden_utils import GOLDEN_OVERRIDES, check_golden
from helpers.trainer.trainer_utils import (
    REPO,
    assert_bit_identical,
    assert_every_parameter_changed,
    frozen_state,
    load,
    make_trainer,
    metrics,
    variant_state,
)

from reference_trainer.errors import ConfigError
from reference_trainer.losses.tdm import (
    capped_snr,
    conditional_renoise,
    importance_weights,
    tdm_fake_loss,
    tdm_generator_loss,
)

CONFIG = "examples/tdm/full/sd3_tiny/default.yaml"

# --- the losses ------------------------------------------------------------------------------------


def test_conditional_renoise_hand_values():
    """x̂_0 = 1, ε̂ = 2, σ_m = 0.5, σ_t = 0.75, n = 1: α_m = 0.5, α_t = 0.25; x_m = 0.5 + 1 = 1.5;
    carried = 0.25·0.5/0.5 = 0.25, β² = 0.5625 − 0.0625 = 0.5; x_t = 0.5·1.5 + √0.5 = 0.75 + √0.5;
    ε_mix = (0.25·2 + √0.5)/0.75. At σ_t = σ_m, x_t = x_m and ε_mix = ε̂ (β = 0); from σ_m = 0, x_t = α_t x̂_0 + σ_t n."""
    one = torch.ones(1, 1)
    r = conditional_renoise(one, 2 * one, torch.tensor([0.5]), torch.tensor([0.75]), one)
    assert r.x_t.item() == pytest.approx(0.75 + math.sqrt(0.5))
    assert r.mixed_noise.item() == pytest.approx((0.5 + math.sqrt(0.5)) / 0.75)
    same = conditional_renoise(one, 2 * one, torch.tensor([0.5]), torch.tensor([0.5]), one)
    assert same.x_t.item() == pytest.approx(1.5) and same.mixed_noise.item() == pytest.approx(2.0)
    last = conditional_renoise(one, 2 * one, torch.tensor([0.0]), torch.tensor([0.3]), one)
    assert last.x_t.item() == pytest.approx(0.7 + 0.3) and last.mixed_noise.item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="sigma_mid <= sigma_t"):
        conditional_renoise(one, one, torch.tensor([0.5]), torch.tensor([0.4]), one)


def test_conditional_renoise_keeps_the_marginal_variance():
    """x̂_0 = 0 and ε̂, n ~ N(0, I) independent: x_t has variance σ_t² (the forward marginal)."""
    g = torch.Generator().manual_seed(0)
    eps_hat, noise = torch.randn(2, 50_000, generator=g), torch.randn(2, 50_000, generator=g)
    r = conditional_renoise(
        torch.zeros(2, 50_000), eps_hat, torch.tensor([0.3, 0.6]), torch.tensor([0.5, 0.9]), noise
    )
    torch.testing.assert_close(r.x_t.var(dim=1), torch.tensor([0.25, 0.81]), rtol=3e-2, atol=0)
    torch.testing.assert_close(r.mixed_noise.var(dim=1), torch.ones(2), rtol=3e-2, atol=0)


def test_importance_weight_snr_cap_and_fake_loss_hand_values():
    """w = exp(−½·mean ε_mix² + ½·mean n²): ε_mix = 1, n = 0 → e^{−½}; ε_mix = 0, n = 3 → e^{4.5} = 90,
    clipped to 20. SNR at σ = 0.5 is 1, at σ = 0.1 is 81 → 5. L_fake of one sample, x̂_0^fake = [1, 3],
    x̂_0 = [0, 1]: mean((1, 2)²) = 2.5, × SNR weight 2 × w 0.5 = 2.5; ∂L/∂x̂_0^fake = 2·(1, 2)/2·1 = (1, 2)."""
    w = importance_weights(
        torch.tensor([[1.0, 1.0], [0.0, 0.0]]), torch.tensor([[0.0, 0.0], [3.0, 3.0]]), 20.0
    )
    torch.testing.assert_close(w, torch.tensor([math.exp(-0.5), 20.0]))
    torch.testing.assert_close(capped_snr(torch.tensor([0.5, 0.1]), 5.0), torch.tensor([1.0, 5.0]))
    x0_fake = torch.tensor([[1.0, 3.0]], requires_grad=True)
    loss, info = tdm_fake_loss(x0_fake, torch.tensor([[0.0, 1.0]]), torch.tensor([2.0]), torch.tensor([0.5]))
    loss.backward()
    assert loss.item() == pytest.approx(2.5) and info["importance_mean"] == pytest.approx(0.5)
    torch.testing.assert_close(x0_fake.grad, torch.tensor([[1.0, 2.0]]))


def test_generator_loss_hand_values():
    """x̂_0 = [0, 0], x̂_0^real = [1, 1], x̂_0^fake = [0.5, 0]. Squared error, s = 1: x̃_0 = (0.5, 1),
    λ = mean|0 − 1| = 1, L = (0.25 + 1)/2 = 0.625, ∂L/∂x̂_0 = 2(x̂_0 − x̃_0)/(2λ) = (−0.5, −1).
    s = 3, x̂_0^uncond = [0, 1]: guidance 2·(1, 0) → x̃_0 = (2.5, 1), anchor (3, 1), λ = 2,
    L = (6.25 + 1)/2/2 = 1.8125. Pseudo-Huber c = 1e-3, s = 1: L = mean(√(d² + c²) − c)/λ."""
    real, fake, uncond = torch.tensor([[1.0, 1.0]]), torch.tensor([[0.5, 0.0]]), torch.tensor([[0.0, 1.0]])
    x0 = torch.zeros(1, 2, requires_grad=True)
    loss, info = tdm_generator_loss(x0, real, fake, huber_c=None)
    loss.backward()
    assert loss.item() == pytest.approx(0.625) and info["normaliser_mean"] == pytest.approx(1.0)
    torch.testing.assert_close(x0.grad, torch.tensor([[-0.5, -1.0]]))
    guided, info = tdm_generator_loss(torch.zeros(1, 2), real, fake, uncond, guidance_scale=3.0, huber_c=None)
    assert guided.item() == pytest.approx(1.8125) and info["normaliser_mean"] == pytest.approx(2.0)
    huber, _ = tdm_generator_loss(torch.zeros(1, 2), real, fake, huber_c=1e-3)
    c = 1e-3
    assert huber.item() == pytest.approx(((math.sqrt(0.25 + c * c) - c) + (math.sqrt(1 + c * c) - c)) / 2)
    with pytest.raises(ValueError, match="needs x0_uncond"):
        tdm_generator_loss(torch.zeros(1, 2), real, fake, guidance_scale=2.0)


# --- transcription of Luo-Yihong/TDM train_tdm_demo.py @ 2f938bf (DDPM form: x_t = α x_0 + σ ε) -------


def reference_add_noise(samples, noise, alpha1, sigma1, alpha2, sigma2):
    """``Predictor.add_noise`` lines 1036-1045: rescale to the new α, add the missing variance."""
    rescaled = samples / alpha1 * alpha2
    beta = (sigma2**2 - (alpha2 / alpha1 * sigma1) ** 2) ** 0.5
    return rescaled + beta * noise


def reference_mixed_noise(model_noise, noise, alpha1, sigma1, alpha2, sigma2):
    """``Predictor.obtain_mixed_noise`` lines 1047-1057."""
    beta = (sigma2**2 - (alpha2 / alpha1 * sigma1) ** 2) ** 0.5
    return (model_noise / alpha1 * alpha2 * sigma1 + beta * noise) / sigma2


def reference_fake_loss(fake_latents, model_latents, snr, mixed, rand_noise):
    """Lines 1130-1134: the per-sample x̂_0 MSE × min(SNR, 5) × the importance ratio (no clip)."""
    bsz = fake_latents.shape[0]
    is_weight = torch.exp(-0.5 * (mixed**2).view(bsz, -1).mean(dim=1)) / torch.exp(
        -0.5 * (rand_noise**2).view(bsz, -1).mean(dim=1)
    )
    per = torch.nn.functional.mse_loss(fake_latents, model_latents, reduction="none")
    snr = torch.stack([snr, 5 * torch.ones_like(snr)], dim=1).min(dim=1)[0]
    return (per.mean(dim=list(range(1, per.ndim))) * snr * is_weight).mean()


def reference_generator_loss(model_latents, sd_latents, sd_uncond, fake_latents, cfg, huber_c):
    """Lines 1170-1186: the cooperative sample and the pseudo-Huber loss over the weighting factor."""
    coop = model_latents.detach() + (sd_latents - fake_latents) + (cfg - 1) * (sd_latents - sd_uncond)
    sd_cfg = sd_latents + (cfg - 1) * (sd_latents - sd_uncond)
    weighting = torch.abs(model_latents.double() - sd_cfg.double()).mean(dim=[1, 2, 3], keepdim=True).detach()
    return torch.mean(
        (torch.sqrt((model_latents.float() - coop.float()) ** 2 + huber_c**2) - huber_c) / weighting
    )


def test_transcription_of_the_tdm_reference():
    """Flow matching is the DDPM form with α = 1 − σ: the re-noise, mixed noise, fake loss and
    generator loss (value and gradient) equal the reference lines on random inputs."""
    g = torch.Generator().manual_seed(3)
    shape = (4, 2, 3, 3)
    x0, eps_hat, noise = (torch.randn(shape, generator=g) for _ in range(3))
    sigma_mid = torch.tensor([0.0, 0.2, 0.45, 0.7])
    sigma_t = sigma_mid + torch.tensor([0.1, 0.25, 0.05, 0.2])
    ours = conditional_renoise(x0, eps_hat, sigma_mid, sigma_t, noise)
    b = lambda v: v.reshape(-1, 1, 1, 1)  # noqa: E731
    a1, s1, a2, s2 = b(1 - sigma_mid), b(sigma_mid), b(1 - sigma_t), b(sigma_t)
    x_mid = a1 * x0 + s1 * eps_hat  # noise_scheduler.add_noise(model_latents, model_eps, t_mid)
    torch.testing.assert_close(ours.x_t, reference_add_noise(x_mid, noise, a1, s1, a2, s2))
    torch.testing.assert_close(ours.mixed_noise, reference_mixed_noise(eps_hat, noise, a1, s1, a2, s2))

    fake = torch.randn(shape, generator=g)
    snr = ((1 - sigma_t) / sigma_t) ** 2
    weights = importance_weights(ours.mixed_noise, noise, clip=1e9)
    loss, _ = tdm_fake_loss(fake, x0, capped_snr(sigma_t, 5.0), weights)
    torch.testing.assert_close(loss, reference_fake_loss(fake, x0, snr, ours.mixed_noise, noise))

    real, uncond, fake_x0 = (torch.randn(shape, generator=g) for _ in range(3))
    ours_x0 = x0.clone().requires_grad_(True)
    ref_x0 = x0.clone().requires_grad_(True)
    loss, _ = tdm_generator_loss(ours_x0, real, fake_x0, uncond, guidance_scale=4.5, huber_c=1e-3)
    expected = reference_generator_loss(ref_x0, real, uncond, fake_x0, 4.5, 1e-3)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(loss, expected.float())
    torch.testing.assert_close(ours_x0.grad, ref_x0.grad)


def test_tdm_arguments_are_validated_with_the_field_named():
    assert load(REPO / CONFIG).train.num_generator_steps == 4
    for override, message in [
        ("train.num_generator_steps=0", r"train\.num_generator_steps: must be >= 1"),
        ("train.snr_cap=0", r"train\.snr_cap: must be > 0"),
        ("train.importance_clip=-1", r"train\.importance_clip: must be > 0"),
        ("train.huber_c=-1", r"train\.huber_c: must be >= 0"),
        ("train.real_guidance_scale=0.5", r"train\.real_guidance_scale: must be >= 1"),
        ("train.fake_updates_per_generator_update=0", r"train\.fake_updates_per_generator_update"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load(REPO / CONFIG, override)


# --- the trainer -----------------------------------------------------------------------------------


@pytest.mark.numeric
@pytest.mark.integration
def test_tdm_trains_fake_then_generator_and_keeps_the_teacher(tmp_path):
    """12 steps = 6 rollout iterations of (fake, generator): the phase order, a frozen teacher and
    frozen components, every parameter of both trainable roles changed, the golden's first steps."""
    overrides = GOLDEN_OVERRIDES.get("tdm", [])
    trainer = make_trainer("tdm", tmp_path, 12, *overrides)
    frozen, initial = frozen_state(trainer), variant_state(trainer)
    teacher = trainer.variants.snapshot("teacher")
    assert all(torch.equal(teacher[key], initial["generator"][key]) for key in teacher)
    trainer.start()
    records = metrics(tmp_path)
    assert [r["role"] for r in records] == ["fake", "generator"] * 6
    assert all(r["grad_norm.generator"] > 0 for r in records if r["role"] == "generator")
    assert all(0 < r["importance_mean"] <= 20 for r in records if r["role"] == "fake")
    assert_bit_identical(frozen, frozen_state(trainer))
    for role in ("generator", "fake"):
        assert_every_parameter_changed(trainer, initial[role], trainer.variants.variant(role), role)
    check_golden("tdm", records, config=CONFIG, overrides=overrides)


@pytest.mark.integration
def test_tdm_distils_a_multistep_teacher_into_few_steps(tmp_path):
    """As DMD2's test: the teacher is first fitted to the tiny dataset by SFT (48 steps) so that its
    few-step and 8-step samples differ; 24 TDM steps of a 2-step generator must bring its samples
    closer to the teacher's 8-step samples from the same noise (MMD² and per-noise MSE fall)."""
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
    overrides = (
        f"model.fixture_dir={teacher_dir}",
        "train.num_generator_steps=2",
        "eval.every=24",
        "eval.samples_per_prompt=4",
    )
    make_trainer("tdm", tmp_path / "tdm", 24, *overrides).start()
    start, end = (json.loads(line) for line in (tmp_path / "tdm/eval.jsonl").read_text().splitlines())
    print(
        f"TDM 2-step generator vs 8-step teacher: MMD² {start['eval.teacher_mmd']:.4f} -> "
        f"{end['eval.teacher_mmd']:.4f}, paired MSE {start['eval.teacher_paired_mse']:.4f} -> "
        f"{end['eval.teacher_paired_mse']:.4f}"
    )
    assert end["eval.teacher_mmd"] < 0.8 * start["eval.teacher_mmd"]
    assert end["eval.teacher_paired_mse"] < 0.9 * start["eval.teacher_paired_mse"]


@pytest.mark.integration
def test_two_identical_dumped_runs_compare_ok_with_every_stage_tapped(tmp_path):
    from helpers.trainer.dump_utils import dumped_runs_compare

    result = dumped_runs_compare(tmp_path, REPO / CONFIG, "eval.every=0")
    keys = {stage["key"] for stage in result["stages"]}
    assert result["verdict"] == "ok" and result["first_divergence"] is None
    expected = {
        "rollout.latents",
        "train.x0",
        "train.x_t",
        "train.importance",
        "train.x0_real",
        "train.x0_fake",
        "loss.fake",
        "loss.generator",
        "grad_norm.fake",
        "grad_norm.generator",
    }
    assert expected <= keys, sorted(expected - keys)
