"""Each loss against a value derived by hand from the paper's formula (derivation in the docstring)."""

import math

import pytest
import torch

from reference_trainer.flow_matching import interpolate, predicted_x0, sample_sigmas, velocity_target
from reference_trainer.losses.dmd2 import dmd_generator_loss, fake_score_loss
from reference_trainer.losses.dpo import diffusion_dpo_loss, diffusion_dpo_velocity_loss, pair_errors
from reference_trainer.losses.grpo import grpo_loss, ppo_clip_loss, sde_kl
from reference_trainer.losses.sft import flow_matching_loss


def sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z))


# --- GRPO ------------------------------------------------------------------------------------------


def test_ppo_clip_hand_value_and_gradient():
    """log p_old = 0, log p_θ = log[1.5, 0.5, 1.0] → r = [1.5, 0.5, 1.0]; A = [2, −1, 10], A_max = 5
    → Â = [2, −1, 5]; ε = 0.2 → clip(r) = [1.2, 0.8, 1.0].
    −Â·r = [−3, 0.5, −5];  −Â·clip(r) = [−2.4, 0.8, −5];  max = [−2.4, 0.8, −5];  L = −6.6/3 = −2.2.
    clipfrac: |r − 1| > 0.2 for samples 0, 1 → 2/3.
    Gradient: samples 0 and 1 take the clipped branch (flat in r) → 0; sample 2 is unclipped:
    ∂L/∂log p_2 = −Â_2·r_2/3 = −5/3.
    """
    log_prob = torch.tensor([math.log(1.5), math.log(0.5), 0.0], requires_grad=True)
    loss, metrics = ppo_clip_loss(
        log_prob, torch.zeros(3), torch.tensor([2.0, -1.0, 10.0]), clip_range=0.2, adv_clip_max=5.0
    )
    assert loss.item() == pytest.approx(-2.2, abs=1e-6)
    assert metrics["clipfrac"] == pytest.approx(2 / 3)
    loss.backward()
    torch.testing.assert_close(log_prob.grad, torch.tensor([0.0, 0.0, -5.0 / 3.0]))


def test_sde_kl_hand_value():
    """μ_θ = [[1, 2]], μ_ref = [[0, 0]], s = 0.5: per element (μ_θ − μ_ref)²/(2s²) = [1/0.5, 4/0.5] = [2, 8];
    mean over dims → 5; one sample → KL = 5."""
    assert sde_kl(torch.tensor([[1.0, 2.0]]), torch.zeros(1, 2), torch.tensor(0.5)).item() == pytest.approx(
        5.0
    )


def test_grpo_loss_adds_beta_times_kl_with_gradient_to_policy_mean():
    """On-policy (r = 1) with A = 0: L_pg = 0; β = 0.1, KL = 5 (above) → L = 0.5.
    ∂L/∂μ_θ = β·(μ_θ − μ_ref)/(s²·D) = 0.1·[1, 2]/(0.25·2) = [0.2, 0.4]."""
    mean = torch.tensor([[1.0, 2.0]], requires_grad=True)
    loss, metrics = grpo_loss(
        torch.zeros(1),
        torch.zeros(1),
        torch.zeros(1),
        clip_range=1e-4,
        adv_clip_max=5.0,
        kl_beta=0.1,
        mean=mean,
        ref_mean=torch.zeros(1, 2),
        kl_std=torch.tensor(0.5),
    )
    assert loss.item() == pytest.approx(0.5) and metrics["kl"] == pytest.approx(5.0)
    loss.backward()
    torch.testing.assert_close(mean.grad, torch.tensor([[0.2, 0.4]]))


# --- Diffusion-DPO ---------------------------------------------------------------------------------


def test_diffusion_dpo_hand_value_and_gradient():
    """Targets v* = 0, D = 2 elements, e = mean(v²):
    v_θ^w = [1, 1] → e_θ^w = 1;  v_ref^w = [2, 0] → e_ref^w = 2;
    v_θ^l = [2, 2] → e_θ^l = 4;  v_ref^l = [1, 1] → e_ref^l = 1.
    Δ = (1 − 2) − (4 − 1) = −4;  β = 0.5: inside = −β/2·Δ = 1;  L = −log σ(1) = log(1 + e^{−1}).
    ∂L/∂v_θ^w = −σ(−1) · ∂inside/∂e_θ^w · ∂e_θ^w/∂v = −σ(−1)·(−β/2)·(2v/D) = 0.25·σ(−1) per element.
    implicit_acc = 1 (inside > 0).
    """
    v_theta_w = torch.tensor([[1.0, 1.0]], requires_grad=True)
    zero = torch.zeros(1, 2)
    loss, metrics = diffusion_dpo_velocity_loss(
        v_theta_w,
        torch.tensor([[2.0, 2.0]]),
        torch.tensor([[2.0, 0.0]]),
        torch.tensor([[1.0, 1.0]]),
        zero,
        zero,
        beta=0.5,
    )
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-1)), abs=1e-7)
    assert metrics["implicit_acc"] == 1.0 and metrics["margin"] == pytest.approx(1.0)
    loss.backward()
    torch.testing.assert_close(v_theta_w.grad, torch.full((1, 2), 0.25 * sigmoid(-1.0)))


def test_diffusion_dpo_at_reference_is_log_two():
    """θ = ref → Δ = 0 → L = −log σ(0) = log 2 for any β."""
    e = torch.tensor([0.3, 1.7])
    loss, metrics = diffusion_dpo_loss(e, e.flip(0), e, e.flip(0), beta=2000.0)
    assert loss.item() == pytest.approx(math.log(2.0)) and metrics["implicit_acc"] == 0.0


# --- SFT -------------------------------------------------------------------------------------------


def test_flow_matching_loss_hand_value():
    """v = [[1, 2]], ε = [[1, 1]], x_0 = [[0, 1]] → v* = ε − x_0 = [1, 0]; (v − v*)² = [0, 4]; mean = 2.
    Weighted: two samples with errors [2, 0] (second: v = v*) and w = [3, 1] → mean([6, 0]) = 3."""
    loss, _ = flow_matching_loss(
        torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0, 1.0]]), torch.tensor([[0.0, 1.0]])
    )
    assert loss.item() == 2.0
    v = torch.tensor([[1.0, 2.0], [1.0, 0.0]])
    loss, _ = flow_matching_loss(
        v, torch.ones(2, 2), torch.tensor([[0.0, 1.0], [0.0, 1.0]]), torch.tensor([3.0, 1.0])
    )
    assert loss.item() == 3.0


def test_flow_matching_primitives():
    """x_σ = (1 − σ)x_0 + σε: x_0 = 2, ε = −2, σ = 0.25 → 1.5 − 0.5 = 1.0; v* = ε − x_0 = −4;
    x̂_0 = x_σ − σ·v* = 1 + 1 = 2 = x_0 (the true velocity recovers x_0)."""
    x0, eps, sigma = torch.full((1, 2), 2.0), torch.full((1, 2), -2.0), torch.tensor([0.25])
    x_t = interpolate(x0, eps, sigma)
    assert torch.equal(x_t, torch.ones(1, 2))
    assert torch.equal(predicted_x0(x_t, velocity_target(x0, eps), sigma), x0)
    g = torch.Generator().manual_seed(0)
    s = sample_sigmas(1000, "logit_normal", g, low=0.01, high=0.99)
    assert s.min() >= 0.01 and s.max() <= 0.99 and abs(s.median().item() - 0.5) < 0.05


# --- DMD2 ------------------------------------------------------------------------------------------


def test_dmd_generator_loss_hand_value_and_gradient():
    """x = [[1, 3]], x̂_0^real = [[0, 1]], x̂_0^fake = [[1, 1]]:
    p_real = x − x̂_0^real = [1, 2], mean|p_real| = 1.5; p_fake = [0, 2];
    g = (p_real − p_fake)/1.5 = [2/3, 0];  L = ½·mean(g²) = ½·(4/9)/2 = 1/9;
    ∂L/∂x = g/numel = [1/3, 0] (descent moves x[0] towards the teacher's 0, away from the fake's 1).
    """
    x = torch.tensor([[1.0, 3.0]], requires_grad=True)
    loss, metrics = dmd_generator_loss(x, torch.tensor([[0.0, 1.0]]), torch.tensor([[1.0, 1.0]]))
    assert loss.item() == pytest.approx(1 / 9)
    assert metrics["normaliser_mean"] == pytest.approx(1.5) and metrics["zero_normaliser"] == 0
    loss.backward()
    torch.testing.assert_close(x.grad, torch.tensor([[1 / 3, 0.0]]))


def test_dmd_generator_zero_normaliser_is_explicit_and_nonfinite_is_an_error():
    """x = x̂_0^real exactly → normaliser 0 → g := 0 for that sample (counted), L = 0."""
    x = torch.tensor([[1.0, 1.0]], requires_grad=True)
    loss, metrics = dmd_generator_loss(x, torch.tensor([[1.0, 1.0]]), torch.tensor([[0.0, 0.0]]))
    assert loss.item() == 0.0 and metrics["zero_normaliser"] == 1
    with pytest.raises(ValueError, match="x0_fake has non-finite"):
        dmd_generator_loss(x, x.detach(), torch.tensor([[float("nan"), 0.0]]))


def test_fake_score_loss_is_flow_matching_on_detached_generator_output():
    """v_fake = [[0, 0]], ε = [[1, 1]], x = [[1, −1]] → v* = ε − x = [0, 2] → mean((v − v*)²) = 2;
    the generator output receives no gradient from the fake-score loss."""
    x = torch.tensor([[1.0, -1.0]], requires_grad=True)
    v_fake = torch.zeros(1, 2, requires_grad=True)
    loss, _ = fake_score_loss(v_fake, torch.ones(1, 2), x)
    assert loss.item() == 2.0
    loss.backward()
    assert x.grad is None and v_fake.grad is not None


def test_dpo_pair_errors_share_noise_and_sigma():
    """chosen == rejected: with one σ and one ε per pair both arms see the same x_σ, so e^w = e^l,
    Δ = 0 and L = log 2 exactly, whatever the velocity functions (here: policy v = 2x, reference v = x).
    Hand check of one error: x_0 = 1, ε = 0, σ = 0.5 → x_σ = 0.5, v* = ε − x_0 = −1;
    policy v = 1 → e_θ = (1 − (−1))² = 4; reference v = 0.5 → e_ref = 2.25."""
    x0 = torch.ones(2, 1, 2, 2)
    errors = pair_errors(
        x0, x0.clone(), torch.full((2,), 0.5), torch.zeros(2, 1, 2, 2), lambda x, s: 2 * x, lambda x, s: x
    )
    e_theta_w, e_theta_l, e_ref_w, e_ref_l = errors
    assert torch.equal(e_theta_w, torch.full((2,), 4.0)) and torch.equal(e_ref_w, torch.full((2,), 2.25))
    assert torch.equal(e_theta_w, e_theta_l) and torch.equal(e_ref_w, e_ref_l)
    loss, _ = diffusion_dpo_loss(*errors, beta=1000.0)
    assert loss.item() == pytest.approx(math.log(2.0))
