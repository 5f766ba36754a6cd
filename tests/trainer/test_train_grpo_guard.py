"""GRPO-Guard: the normalised log-ratio and its loss against hand values and Flow-Factory's lines; it learns
on the tiny SD3 model, only the trainable role changes, its first steps match the goldens, and two
identical dumped runs compare ``ok``."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.trainer import trainer_utils
from helpers.trainer.golden_utils import check_golden
from helpers.trainer.trainer_utils import (
    REPO,
    assert_bit_identical,
    assert_every_parameter_changed,
    frozen_state,
    metrics,
)

from reference_trainer.losses.grpo_guard import (
    grpo_guard_loss,
    noise_form_log_ratio,
    normalised_log_ratio,
)
from reference_trainer.sde import LOG_SQRT_2PI, flow_sde_std_dev, flow_sde_step, gaussian_log_prob

# --- the loss --------------------------------------------------------------------------------------


def _hand_example(requires_grad: bool = False):
    """B = 2 samples of D = 2 elements, s = 0.5, μ_old = 0, μ_θ = [[0.1, −0.1], [0.2, 0]], z = [[1, 1], [1, −1]],
    x' = μ_old + s·z = [[0.5, 0.5], [0.5, −0.5]]."""
    s = torch.full((2, 1), 0.5)
    old_mean = torch.zeros(2, 2)
    mean = torch.tensor([[0.1, -0.1], [0.2, 0.0]], requires_grad=requires_grad)
    noise = torch.tensor([[1.0, 1.0], [1.0, -1.0]])
    sample = old_mean + s * noise
    return s, old_mean, mean, noise, sample


def test_normalised_log_ratio_hand_value_and_both_forms():
    """δ = μ_θ − μ_old. Sample 0: δ = [0.1, −0.1] ⟂ z: mean(δ·z) = 0, mse = 0.01,
    Δlogp = mean(δ·z)/s − mse/(2s²) = 0 − 0.01/0.5 = −0.02 (the raw ratio is left-shifted);
    log r̃ = Δlogp·s + mse/(2s) = −0.01 + 0.01 = 0. Sample 1: δ = [0.2, 0]: mean(δ·z) = 0.1, mse = 0.02,
    Δlogp = 0.1/0.5 − 0.02/0.5 = 0.16; log r̃ = 0.08 + 0.02 = 0.1 = mean(δ·z).
    The log-probs are the Flow-SDE's (mean over dims of the Gaussian log-density), so both the
    log-prob form and the noise form must give [0, 0.1]."""
    s, old_mean, mean, noise, sample = _hand_example()
    log_prob = gaussian_log_prob(sample, mean, s)
    old_log_prob = gaussian_log_prob(sample, old_mean, s)
    torch.testing.assert_close(log_prob - old_log_prob, torch.tensor([-0.02, 0.16]))
    expected = torch.tensor([0.0, 0.1])
    torch.testing.assert_close(normalised_log_ratio(log_prob, old_log_prob, mean, old_mean, s), expected)
    torch.testing.assert_close(noise_form_log_ratio(mean, old_mean, noise), expected)


def test_grpo_guard_loss_hand_value_and_gradient():
    """log r̃ = [0, 0.1] (above), A = [1, 1], ε = 0.05: r̃ = [1, e^0.1 = 1.10517]; sample 1 is past 1 + ε
    with A > 0, so max(−A·r̃, −A·clip(r̃)) = −1.05 (flat in θ); sample 0: −1. L = (−1 − 1.05)/2 = −1.025.
    Gradient w.r.t. μ_θ through the log-prob form: ∂ log r̃/∂μ_θ = s·(x' − μ_θ)/(s²·D) + δ/(s·D)
    = (x' − μ_old)/(s·D) = z/D, so ∂L/∂μ_θ[0] = −A_0·r̃_0·z_0/(D·B) = −[1, 1]/4; sample 1 (clipped): 0.
    clipfrac = 1/2."""
    s, old_mean, mean, _, sample = _hand_example(requires_grad=True)
    log_ratio = normalised_log_ratio(
        gaussian_log_prob(sample, mean, s), gaussian_log_prob(sample, old_mean, s), mean, old_mean, s
    )
    loss, stats = grpo_guard_loss(log_ratio, torch.ones(2), clip_range=0.05, adv_clip_max=5.0)
    assert loss.item() == pytest.approx(-1.025, abs=1e-6)
    assert stats["clipfrac"] == pytest.approx(0.5)
    assert stats["ratio_mean"] == pytest.approx((1 + math.exp(0.1)) / 2, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(mean.grad, torch.tensor([[-0.25, -0.25], [0.0, 0.0]]))


def test_both_forms_agree_on_flow_sde_steps():
    """On real Flow-SDE steps (x' sampled with noise z from the old velocity, μ_θ from a perturbed one),
    the log-prob form (Flow-Factory's) equals mean_dims((μ_θ − μ_old)·z) at every step of a schedule."""
    generator = torch.Generator().manual_seed(0)
    sigmas = torch.tensor([1.0, 0.9, 0.75, 0.5, 0.2, 0.05])
    x = torch.randn(3, 4, 8, 8, generator=generator)
    for j in range(len(sigmas) - 1):
        v_old = torch.randn(x.shape, generator=generator)
        v = v_old + 0.5 * torch.randn(x.shape, generator=generator)
        z = torch.randn(x.shape, generator=generator)
        args = dict(sigma=sigmas[j], sigma_next=sigmas[j + 1], noise_level=0.7, sigma_max=0.9)
        old = flow_sde_step(v_old, x, **args, noise=z)
        new = flow_sde_step(v, x, **args, prev_sample=old.prev_sample)
        by_log_prob = normalised_log_ratio(new.log_prob, old.log_prob, new.mean, old.mean, new.step_std)
        by_noise = noise_form_log_ratio(new.mean, old.mean, z)
        torch.testing.assert_close(by_log_prob, by_noise, rtol=0, atol=2e-6)
        assert by_noise.abs().max() > 1e-3  # a non-trivial ratio
        x = old.prev_sample


def test_transcription_of_flow_factory_guard_branch():
    """The same inputs through a re-statement of X-GenGroup/Flow-Factory ``src/flow_factory/trainers/grpo.py``
    @ a0b2bc5a, ``GRPOGuardTrainer.optimize`` lines 496-510 (advantage clip, "Reweighted ratio", PPO clip),
    with its scheduler's Flow-SDE log-prob (``scheduler/flow_match_euler_discrete.py`` lines 346, 364-371)
    and its shapes: ``dt`` and ``std_dev_t`` are [B, 1, 1, 1] (``to_broadcast_tensor``), so its ratio is
    [B, 1, 1, B]; with one σ per step every row equals the per-sample ratio. Loss and gradient agree."""
    generator = torch.Generator().manual_seed(1)
    batch, shape = 4, (4, 4, 4)
    sigma, sigma_prev, noise_level = 0.6, 0.45, 0.7
    old_mean = torch.randn(batch, *shape, generator=generator)
    mean_leaf = (old_mean + 0.02 * torch.randn(batch, *shape, generator=generator)).requires_grad_()
    adv_in = torch.tensor([2.0, -1.0, 7.0, -6.0])
    clip_range = (-1e-3, 1e-3)
    adv_clip_range = (-5.0, 5.0)

    # --- Flow-Factory (re-stated) ---
    sigma_b = torch.full((batch, 1, 1, 1), sigma)
    dt = torch.full((batch, 1, 1, 1), sigma_prev) - sigma_b
    std_dev_t = torch.sqrt(sigma_b / (1 - sigma_b)) * noise_level
    std_variance = std_dev_t * torch.sqrt(-1 * dt)
    next_latents = old_mean + std_variance * torch.randn(batch, *shape, generator=generator)

    def ff_log_prob(next_latents_mean):
        log_prob = (
            -((next_latents.detach() - next_latents_mean) ** 2) / (2 * std_variance**2)
            - torch.log(std_variance)
            - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))
        )
        return log_prob.mean(dim=tuple(range(1, log_prob.ndim)))

    adv = torch.clamp(adv_in, adv_clip_range[0], adv_clip_range[1])
    scale_factor = torch.sqrt(-dt) * std_dev_t
    mse = (mean_leaf - old_mean).flatten(1).pow(2).mean(dim=1)
    ratio = torch.exp(
        (ff_log_prob(mean_leaf) - ff_log_prob(old_mean)) * scale_factor + mse / (2 * scale_factor)
    )
    unclipped_loss = -adv * ratio
    clipped_loss = -adv * torch.clamp(ratio, 1.0 + clip_range[0], 1.0 + clip_range[1])
    ff_loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss))
    (ff_grad,) = torch.autograd.grad(ff_loss, mean_leaf)

    # --- ours ---
    mean = mean_leaf.detach().clone().requires_grad_()
    step_std = flow_sde_std_dev(sigma_b, noise_level, None) * math.sqrt(sigma - sigma_prev)
    log_ratio = normalised_log_ratio(
        gaussian_log_prob(next_latents, mean, step_std),
        gaussian_log_prob(next_latents, old_mean, step_std),
        mean,
        old_mean,
        step_std,
    )
    loss, _ = grpo_guard_loss(log_ratio, adv_in, clip_range=1e-3, adv_clip_max=5.0)
    loss.backward()

    assert ratio.shape == (batch, 1, 1, batch)
    for row in range(batch):
        torch.testing.assert_close(ratio[row, 0, 0].detach(), log_ratio.exp().detach(), rtol=1e-6, atol=1e-6)
    assert 0 < ((log_ratio.exp() - 1).abs() > 1e-3).sum() < batch  # some samples clipped, some not
    torch.testing.assert_close(loss.detach(), ff_loss.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(mean.grad, ff_grad, rtol=1e-5, atol=1e-8)
    assert LOG_SQRT_2PI == pytest.approx(math.log(math.sqrt(2 * math.pi)))


# --- the trainer -----------------------------------------------------------------------------------

CONFIG = "examples/grpo_guard/full/sd3_tiny/default.yaml"
OVERRIDES = ["train.kl_beta=0.001"]
STEPS = 30


@pytest.fixture(scope="module")
def learning_run(tmp_path_factory):
    """30 steps (15 rollout iterations × 2 minibatches) of the example config with a KL reference."""
    return trainer_utils.learning_run("grpo_guard", tmp_path_factory.mktemp("grpo_guard"), STEPS, *OVERRIDES)


@pytest.mark.integration
def test_rollout_velocities_reproduce_the_stored_log_probs(learning_run):
    """μ_old is recomputed from the velocities the sampler stored: on a fresh rollout (after training, so
    the run itself is untouched) the recomputed log p_old equals the stored one bit for bit."""
    from helpers.trainer.trainer_utils import assert_rollout_velocities_replay

    assert_rollout_velocities_replay(learning_run["trainer"])


@pytest.mark.integration
def test_grpo_guard_raises_reward_and_keeps_frozen_roles(learning_run, capsys):
    """The fixed-noise mean brightness reward rises; the VAE, text encoder and reference snapshot are
    bit-identical; every policy parameter that can get a gradient changed; the clip acts on the second
    minibatch of each iteration (the first is at the rollout policy: r̃ = 1)."""
    run = learning_run
    trainer, before, after = run["trainer"], run["before"], run["after"]
    with capsys.disabled():
        print(
            f"\nGRPO-Guard tiny SD3, {STEPS} steps: fixed-noise mean brightness reward {before:.4f} -> {after:.4f}"
        )
    # +0.020 with the per-sample rollout noise of issue 19 (its draws changed; +0.03 was met before)
    assert after > before + 0.015
    records = metrics(run["out"])
    assert [r["optimizer_step"] for r in records] == list(range(1, STEPS + 1))
    # (≈ rather than ==: the minibatch forward need not reproduce the rollout batch's bits on every CPU)
    assert all(
        r["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and r["clipfrac"] == 0.0 for r in records[0::2]
    )
    assert sum(r["clipfrac"] for r in records[1::2]) > 0
    assert records[0]["kl"] == 0.0 and records[-1]["kl"] > 0.0
    assert_bit_identical(run["frozen"], frozen_state(trainer))
    policy = trainer.variants.variant("policy")
    assert_every_parameter_changed(trainer, run["initial"]["policy"], policy, "policy")


@pytest.mark.numeric
@pytest.mark.integration
def test_grpo_guard_goldens(learning_run):
    check_golden("grpo_guard", metrics(learning_run["out"]), config=CONFIG, overrides=OVERRIDES)


@pytest.mark.integration
def test_two_identical_dumped_runs_compare_ok(tmp_path):
    from helpers.trainer.dump_utils import dumped_runs_compare

    result = dumped_runs_compare(tmp_path, REPO / CONFIG)
    keys = {stage["key"] for stage in result["stages"]}
    assert result["verdict"] == "ok" and result["first_divergence"] is None
    expected = {
        "rollout.latents",
        "rollout.log_prob",
        "rollout.velocity",
        "reward",
        "advantage",
        "train.mean",
        "train.mean_old",
        "train.log_ratio",
        "loss.policy",
        "grad_norm.policy",
    }
    assert expected <= keys, sorted(expected - keys)
    assert any(key.startswith("L000.") for key in keys), "block forwards were not dumped"
