"""Flow-SDE step (Flow-GRPO eq. 12) against hand calculations and an independent Gaussian density."""

import math

import pytest
import torch

from reference_trainer.sde import flow_ode_step, flow_sde_step, gaussian_log_prob


def test_mean_and_std_match_hand_calculation():
    """σ = 0.5, σ_next = 0.25, a = 0.5, x = 1, v = 2, ε = 1.

    σ_t = a·√(σ/(1−σ)) = 0.5·√(0.5/0.5) = 0.5;  Δt = 0.25 − 0.5 = −0.25;  σ_t² = 0.25.
    mean = x·(1 + σ_t²/(2σ)·Δt) + v·(1 + σ_t²(1−σ)/(2σ))·Δt
         = 1·(1 + 0.25/1·(−0.25)) + 2·(1 + 0.25·0.5/1)·(−0.25)
         = 0.9375 + 2·1.125·(−0.25) = 0.9375 − 0.5625 = 0.375.
    step std s = σ_t·√(−Δt) = 0.5·0.5 = 0.25;  x' = mean + s·ε = 0.625.
    log p = −(x'−mean)²/(2s²) − log s − ½log(2π) = −½ − log 0.25 − ½log(2π) = −0.5 + log 4 − ½log(2π).
    """
    x = torch.ones(1, 2, 2)
    v = torch.full((1, 2, 2), 2.0)
    out = flow_sde_step(v, x, 0.5, 0.25, 0.5, noise=torch.ones(1, 2, 2))
    assert torch.equal(out.mean, torch.full((1, 2, 2), 0.375))
    assert torch.equal(out.std_dev_t.flatten(), torch.tensor([0.5]))
    assert torch.equal(out.step_std.flatten(), torch.tensor([0.25]))
    assert torch.equal(out.prev_sample, torch.full((1, 2, 2), 0.625))
    expected = -0.5 + math.log(4.0) - 0.5 * math.log(2 * math.pi)
    assert out.log_prob.shape == (1,)
    assert out.log_prob.item() == pytest.approx(expected, abs=1e-6)


def test_sigma_one_uses_sigma_max_in_denominator():
    """σ = 1 (first step), σ_next = 0.75, σ_max = sigmas[1] = 0.75, a = 0.5.

    σ_t = a·√(σ/(1 − σ_max)) = 0.5·√(1/0.25) = 1.0 (numerator keeps σ = 1, as flow_grpo does).
    Δt = −0.25, s = 1·√0.25 = 0.5.  mean = x(1 + 1/2·(−0.25)) + v(1 + 0)(−0.25) = 0.875x − 0.25v.
    With x = 2, v = −4: mean = 1.75 + 1 = 2.75.
    """
    out = flow_sde_step(
        torch.full((1, 3), -4.0),
        torch.full((1, 3), 2.0),
        1.0,
        0.75,
        0.5,
        sigma_max=0.75,
        noise=torch.zeros(1, 3),
    )
    assert torch.equal(out.std_dev_t.flatten(), torch.tensor([1.0]))
    assert torch.equal(out.step_std.flatten(), torch.tensor([0.5]))
    assert torch.equal(out.mean, torch.full((1, 3), 2.75))
    with pytest.raises(ValueError, match="sigma_max"):
        flow_sde_step(torch.zeros(1, 3), torch.zeros(1, 3), 1.0, 0.75, 0.5)


def test_log_prob_equals_independent_normal_density():
    """log_prob = mean over non-batch dims of torch.distributions.Normal(mean, s).log_prob(x').

    Checked on random fp32 inputs with per-sample sigmas, and independently in float64.
    """
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 5, 5, generator=g)
    v = torch.randn(3, 4, 5, 5, generator=g)
    sigma = torch.tensor([0.9, 0.6, 0.3])
    sigma_next = torch.tensor([0.7, 0.5, 0.1])
    out = flow_sde_step(v, x, sigma, sigma_next, 0.7, generator=g)
    # independent: float64 closed form written out here from eq. 12
    s64, sn64 = sigma.double().view(-1, 1, 1, 1), sigma_next.double().view(-1, 1, 1, 1)
    std = 0.7 * torch.sqrt(s64 / (1 - s64))
    dt = sn64 - s64
    mean64 = x.double() + (v.double() + std**2 / (2 * s64) * (x.double() + (1 - s64) * v.double())) * dt
    scale = std * torch.sqrt(-dt)
    normal = torch.distributions.Normal(mean64, scale.expand_as(mean64))
    expected = normal.log_prob(out.prev_sample.double()).mean(dim=(1, 2, 3))
    torch.testing.assert_close(out.mean.double(), mean64, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.log_prob.double(), expected, rtol=1e-5, atol=1e-5)


def test_recomputed_log_prob_of_stored_sample_is_identical_and_differentiable():
    """Training recomputes log p of the stored x' from a fresh velocity: same value, grads reach v only."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 3, 3, generator=g).to(torch.bfloat16)
    v = torch.randn(2, 4, 3, 3, generator=g).to(torch.bfloat16)
    rollout = flow_sde_step(v, x, 0.8, 0.6, 0.7, generator=g)
    assert rollout.prev_sample.dtype == torch.bfloat16 and rollout.log_prob.dtype == torch.float32
    v_train = v.float().clone().requires_grad_(True)
    again = flow_sde_step(v_train, x, 0.8, 0.6, 0.7, prev_sample=rollout.prev_sample)
    torch.testing.assert_close(again.log_prob, rollout.log_prob, rtol=0, atol=1e-6)
    again.log_prob.sum().backward()
    assert v_train.grad is not None and v_train.grad.abs().sum() > 0


def test_gaussian_log_prob_closed_form():
    """x = μ + s: per element −½ − log s − ½log 2π; for s = 2 that is −½ − log 2 − ½log 2π."""
    mean = torch.zeros(2, 3)
    got = gaussian_log_prob(mean + 2.0, mean, torch.tensor(2.0))
    assert torch.allclose(got, torch.full((2,), -0.5 - math.log(2.0) - 0.5 * math.log(2 * math.pi)))


def test_ode_step_is_euler():
    """x' = x + v·Δt with Δt = 0.25 − 0.5: x = 1, v = 2 → 0.5."""
    assert torch.equal(
        flow_ode_step(torch.full((1, 2), 2.0), torch.ones(1, 2), 0.5, 0.25), torch.full((1, 2), 0.5)
    )


def test_rejects_bad_schedule():
    with pytest.raises(ValueError, match="sigma_next < sigma"):
        flow_sde_step(torch.zeros(1, 2), torch.zeros(1, 2), 0.3, 0.4, 0.7)
