"""The losses and their gradients against transcriptions of the reference implementations' lines.

Each test restates the few lines of one reference implementation (cited: repository, file, commit,
lines) as literally as this codebase's inputs allow, feeds it and ``reference_trainer`` the same fixed
small tensors, and compares the loss and its gradient. The tolerances say what may differ: 0 where the
two compute the same float operations in the same order, else the reduction order of one float32 mean.

Sources (the commits of the stored snapshots read for these tests):

* FLOW_GRPO = yifan123/flow_grpo @ ac4c86e8cae021841f1fde853d340e0db67690dd
* DIFFUSION_DPO = SalesforceAIResearch/DiffusionDPO @ 5233e75919f912f3f631958ee4ebb5b5204382d9
* DMD2 = tianweiy/DMD2 @ 8d8fa55633d47cfb81bbc7a892e7248f9518763f
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from reference_trainer.losses.dmd2 import dmd_generator_loss
from reference_trainer.losses.dpo import diffusion_dpo_velocity_loss
from reference_trainer.losses.grpo import grpo_loss
from reference_trainer.sde import flow_sde_step
from reference_trainer.trainers.grpo import trained_steps

pytestmark = pytest.mark.numeric  # CI runs these again at ATEN_CPU_CAPABILITY=default

FLOW_GRPO = "yifan123/flow_grpo@ac4c86e8cae021841f1fde853d340e0db67690dd"
DIFFUSION_DPO = "SalesforceAIResearch/DiffusionDPO@5233e75919f912f3f631958ee4ebb5b5204382d9"
DMD2 = "tianweiy/DMD2@8d8fa55633d47cfb81bbc7a892e7248f9518763f"

# A 4-step schedule with the σ = 1 first step (flow_grpo substitutes sigmas[1] in 1 − σ there).
SIGMAS = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
NOISE_LEVEL = 0.7


# --------------------------------------------------------------------------------------------------
# transcriptions (the reference lines, restated; comments give the source line of each statement)
# --------------------------------------------------------------------------------------------------


def flow_grpo_sde_step_with_logprob(
    self, model_output, timestep, sample, noise_level=0.7, prev_sample=None, noise=None
):
    """FLOW_GRPO ``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py`` lines 34-70
    (``sde_step_with_logprob``); the only change: ``randn_tensor(...)`` (lines 53-58) is the given ``noise``."""
    model_output = model_output.float()  # 35
    sample = sample.float()  # 36
    if prev_sample is not None:  # 37
        prev_sample = prev_sample.float()  # 38
    step_index = [self.index_for_timestep(t) for t in timestep]  # 40
    prev_step_index = [step + 1 for step in step_index]  # 41
    sigma = self.sigmas[step_index].view(-1, 1, 1, 1)  # 42
    sigma_prev = self.sigmas[prev_step_index].view(-1, 1, 1, 1)  # 43
    sigma_max = self.sigmas[1].item()  # 44
    dt = sigma_prev - sigma  # 45
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level  # 47
    prev_sample_mean = (  # 50
        sample * (1 + std_dev_t**2 / (2 * sigma) * dt)
        + model_output * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    )
    if prev_sample is None:  # 52
        variance_noise = noise  # 53-58
        prev_sample = prev_sample_mean + std_dev_t * torch.sqrt(-1 * dt) * variance_noise  # 59
    log_prob = (  # 61-65
        -((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2))
        - torch.log(std_dev_t * torch.sqrt(-1 * dt))
        - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))
    )
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))  # 68
    return prev_sample, log_prob, prev_sample_mean, std_dev_t  # 70


def flow_grpo_scheduler():
    """The two things ``sde_step_with_logprob`` reads of diffusers' ``FlowMatchEulerDiscreteScheduler``:
    ``sigmas`` and ``index_for_timestep`` (timesteps are σ·1000, the position in the schedule)."""
    timesteps = SIGMAS[:-1] * 1000
    return SimpleNamespace(sigmas=SIGMAS, index_for_timestep=lambda t: int((timesteps == t).nonzero().item()))


def flow_grpo_loss(
    log_prob,
    old_log_prob,
    sample_advantages,
    prev_sample_mean,
    prev_sample_mean_ref,
    std_dev_t,
    *,
    clip_range,
    adv_clip_max,
    beta,
):
    """FLOW_GRPO ``scripts/train_sd3.py`` lines 881-899 (the "grpo logic" of the training loop), for one
    trained step j: ``sample["advantages"][:, j]`` -> ``sample_advantages``, ``sample["log_probs"][:, j]``
    -> ``old_log_prob``, ``config.train.*`` -> keyword arguments."""
    advantages = torch.clamp(sample_advantages, -adv_clip_max, adv_clip_max)  # 881-885
    ratio = torch.exp(log_prob - old_log_prob)  # 886
    unclipped_loss = -advantages * ratio  # 887
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)  # 888-892
    policy_loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss))  # 893
    if beta > 0:  # 894
        kl_loss = ((prev_sample_mean - prev_sample_mean_ref) ** 2).mean(dim=(1, 2, 3), keepdim=True) / (
            2 * std_dev_t**2
        )  # 895
        kl_loss = torch.mean(kl_loss)  # 896
        loss = policy_loss + beta * kl_loss  # 897
    else:
        loss = policy_loss  # 899
    return loss


def diffusion_dpo_loss_lines(model_pred, ref_pred, target, beta_dpo):
    """DIFFUSION_DPO ``train.py`` lines 1125-1145 (the ``--train_method dpo`` branch): the batch is
    [chosen; rejected] stacked on dim 0 (``feed_pixel_values``, line 1016), ``ref_pred`` is computed
    under ``no_grad`` (lines 1132-1136)."""
    model_losses = (model_pred - target).pow(2).mean(dim=[1, 2, 3])  # 1125
    model_losses_w, model_losses_l = model_losses.chunk(2)  # 1126
    model_diff = model_losses_w - model_losses_l  # 1130
    ref_losses = (ref_pred - target).pow(2).mean(dim=[1, 2, 3])  # 1137
    ref_losses_w, ref_losses_l = ref_losses.chunk(2)  # 1138
    ref_diff = ref_losses_w - ref_losses_l  # 1139
    scale_term = -0.5 * beta_dpo  # 1142
    inside_term = scale_term * (model_diff - ref_diff)  # 1143
    implicit_acc = (inside_term > 0).sum().float() / inside_term.size(0)  # 1144
    loss = -1 * F.logsigmoid(inside_term).mean()  # 1145
    return loss, implicit_acc


def dmd2_distribution_matching_loss(latents, pred_real_image, pred_fake_image):
    """DMD2 ``main/sd_guidance.py`` lines 235-241 (``compute_distribution_matching_loss``, after the two
    score predictions): ``original_latents = latents`` (line 176); lines 235-239 run under ``no_grad``."""
    original_latents = latents
    with torch.no_grad():
        p_real = latents - pred_real_image  # 235
        p_fake = latents - pred_fake_image  # 236
        grad = (p_real - p_fake) / torch.abs(p_real).mean(dim=[1, 2, 3], keepdim=True)  # 238
        grad = torch.nan_to_num(grad)  # 239
    return 0.5 * F.mse_loss(
        original_latents.float(), (original_latents - grad).detach().float(), reduction="mean"
    )  # 241


# --------------------------------------------------------------------------------------------------
# fixed small inputs
# --------------------------------------------------------------------------------------------------


def rollout_step_inputs(seed: int = 0):
    """Six samples at steps j = [0, 1, 2, 3, 0, 2] of ``SIGMAS`` (σ = 1 included), latents [6, 2, 3, 3]."""
    g = torch.Generator().manual_seed(seed)
    j = torch.tensor([0, 1, 2, 3, 0, 2])
    x = torch.randn(6, 2, 3, 3, generator=g)
    v = torch.randn(6, 2, 3, 3, generator=g)
    noise = torch.randn(6, 2, 3, 3, generator=g)
    return j, x, v, noise


def ours_sde(v, x, j, **kwargs):
    return flow_sde_step(v, x, SIGMAS[j], SIGMAS[j + 1], NOISE_LEVEL, sigma_max=float(SIGMAS[1]), **kwargs)


# --------------------------------------------------------------------------------------------------
# GRPO: the SDE step, the ratio, the clip and the KL
# --------------------------------------------------------------------------------------------------


def test_sde_step_equals_flow_grpo_sde_step_with_logprob():
    """``sde.flow_sde_step`` vs FLOW_GRPO ``sd3_sde_with_logprob.py`` lines 34-70, sampling with the same
    ε and then re-scoring the stored sample with a fresh velocity: prev_sample, log-prob, mean and σ_t are
    bit-identical, and so is ∂(Σ log p)/∂v of the re-scored step (the gradient the PPO ratio carries)."""
    j, x, v, noise = rollout_step_inputs()
    scheduler = flow_grpo_scheduler()
    timestep = SIGMAS[j] * 1000
    ref_sample, ref_log_prob, ref_mean, ref_std = flow_grpo_sde_step_with_logprob(
        scheduler, v, timestep, x, noise_level=NOISE_LEVEL, noise=noise
    )
    ours = ours_sde(v, x, j, noise=noise)
    assert torch.equal(ours.prev_sample, ref_sample)
    assert torch.equal(ours.mean, ref_mean)
    assert torch.equal(ours.std_dev_t, ref_std)
    assert torch.equal(ours.log_prob, ref_log_prob)
    # training: the stored sample re-scored under a moved velocity, with gradients
    v_theta = (v + 0.01 * torch.randn(v.shape, generator=torch.Generator().manual_seed(9))).requires_grad_()
    v_ref = v_theta.detach().clone().requires_grad_()
    ours = ours_sde(v_theta, x, j, prev_sample=ref_sample)
    _, ref_log_prob, _, _ = flow_grpo_sde_step_with_logprob(
        scheduler, v_ref, timestep, x, noise_level=NOISE_LEVEL, prev_sample=ref_sample
    )
    assert torch.equal(ours.log_prob, ref_log_prob)
    ours.log_prob.sum().backward()
    ref_log_prob.sum().backward()
    assert torch.equal(v_theta.grad, v_ref.grad) and bool(v_theta.grad.abs().sum() > 0)


def grpo_inputs():
    """B = 6 samples of one trained step: log-ratios straddling ε = 0.1 (clipped and unclipped, both
    signs), advantages inside and outside ±A_max = 5, and a reference mean 0.05·N(0, 1) away."""
    j, x, v, noise = rollout_step_inputs(seed=1)
    old = ours_sde(v, x, j, noise=noise)
    delta = torch.tensor([-0.3, -0.05, 0.0, 0.05, 0.3, 0.12])
    advantages = torch.tensor([2.0, -1.0, 0.5, 7.0, -6.0, 1.0])
    g = torch.Generator().manual_seed(3)
    ref_mean = old.mean + 0.05 * torch.randn(old.mean.shape, generator=g)
    return old, delta, advantages, ref_mean


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_grpo_loss_equals_flow_grpo_train_sd3_with_std_dev_t(beta):
    """``losses.grpo.grpo_loss(kl_std=σ_t)`` (``kl_std="std_dev_t"``) vs FLOW_GRPO ``scripts/train_sd3.py``
    lines 881-899: the advantage clip, ratio, PPO clip and (β > 0) the KL with flow_grpo's denominator
    2σ_t². Leaves: the per-sample log-prob (so the ratio's gradient is compared) and the policy mean (the
    KL's). The PPO part is bit-identical; the KL reduces in another order (the per-element division
    before the mean): rtol 1e-6 on the loss and its gradients."""
    old, delta, advantages, ref_mean = grpo_inputs()
    log_prob_ours = (old.log_prob + delta).requires_grad_()
    log_prob_ref = log_prob_ours.detach().clone().requires_grad_()
    mean_ours = old.mean.clone().requires_grad_()
    mean_ref = old.mean.clone().requires_grad_()
    settings = dict(clip_range=0.1, adv_clip_max=5.0)
    loss, metrics = grpo_loss(
        log_prob_ours, old.log_prob, advantages, **settings, kl_beta=beta,
        mean=mean_ours, ref_mean=ref_mean, kl_std=old.std_dev_t,
    )  # fmt: skip
    expected = flow_grpo_loss(
        log_prob_ref, old.log_prob, advantages, mean_ref, ref_mean, old.std_dev_t, **settings, beta=beta
    )
    (loss + 0 * mean_ours.sum()).backward()
    (expected + 0 * mean_ref.sum()).backward()
    if beta == 0:
        assert torch.equal(loss, expected) and torch.equal(log_prob_ours.grad, log_prob_ref.grad)
        assert "kl" not in metrics
    else:
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
        torch.testing.assert_close(log_prob_ours.grad, log_prob_ref.grad, rtol=1e-6, atol=0)
        torch.testing.assert_close(mean_ours.grad, mean_ref.grad, rtol=1e-6, atol=1e-12)
        assert metrics["kl"] > 0 and bool(mean_ours.grad.abs().sum() > 0)
    # the inputs exercise both branches of the clip and the advantage clip
    ratio = delta.exp()
    assert 0 < int(((ratio - 1).abs() > 0.1).sum()) < 6 and bool((advantages.abs() > 5).any())
    assert bool(log_prob_ours.grad.eq(0).any()) and bool(log_prob_ours.grad.ne(0).any())


def test_grpo_exact_kl_is_flow_grpo_kl_with_the_transition_std():
    """``kl_std="step_std"``: the exact KL between the two Gaussian transitions. It is FLOW_GRPO
    ``train_sd3.py`` line 895 with the denominator's σ_t replaced by the std of the Gaussian whose
    log-prob the step scores, σ_t·√(−Δt) (``sd3_sde_with_logprob.py`` lines 61-63), and it is also
    torch.distributions' closed-form KL(N(μ_θ, s²) ‖ N(μ_ref, s²)) averaged over the elements. Loss and
    ∂/∂μ_θ agree with both (rtol 1e-6, the reduction order). The two forms differ by the factor −Δt."""
    old, delta, advantages, ref_mean = grpo_inputs()
    log_prob = (old.log_prob + delta).detach()
    mean_ours = old.mean.clone().requires_grad_()
    mean_ref = old.mean.clone().requires_grad_()
    settings = dict(clip_range=0.1, adv_clip_max=5.0)
    loss, metrics = grpo_loss(
        log_prob, old.log_prob, advantages, **settings, kl_beta=0.04,
        mean=mean_ours, ref_mean=ref_mean, kl_std=old.step_std,
    )  # fmt: skip
    expected = flow_grpo_loss(
        log_prob, old.log_prob, advantages, mean_ref, ref_mean, old.step_std, **settings, beta=0.04
    )
    loss.backward()
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(mean_ours.grad, mean_ref.grad, rtol=1e-6, atol=1e-12)
    s = old.step_std.double().expand(old.mean.shape)
    closed_form = torch.distributions.kl_divergence(
        torch.distributions.Normal(old.mean.double(), s), torch.distributions.Normal(ref_mean.double(), s)
    )
    assert metrics["kl"] == pytest.approx(closed_form.mean().item(), rel=1e-6)
    # the flow_grpo form is the exact one times −Δt per sample: here Δt = −0.25 for every step
    flow_form = grpo_loss(
        log_prob, old.log_prob, advantages, **settings, kl_beta=0.04,
        mean=old.mean, ref_mean=ref_mean, kl_std=old.std_dev_t,
    )[1]["kl"]  # fmt: skip
    assert flow_form == pytest.approx(0.25 * metrics["kl"], rel=1e-6)


@pytest.mark.parametrize(
    ("fraction", "steps", "expected"),
    [(0.99, 10, 9), (1.0, 4, 4), (0.6, 4, 2), (0.5, 10, 5), (0.29, 100, 28)],
)
def test_trained_steps_is_flow_grpo_int_truncation(fraction, steps, expected):
    """FLOW_GRPO ``scripts/train_sd3.py`` line 345: ``num_train_timesteps = int(config.sample.num_steps *
    config.train.timestep_fraction)`` (truncated: 0.99 × 10 trains 9 steps, 0.29 × 100 = 28.999… trains 28)."""
    assert trained_steps(fraction, steps) == int(steps * fraction) == expected


# --------------------------------------------------------------------------------------------------
# Diffusion-DPO
# --------------------------------------------------------------------------------------------------


def test_diffusion_dpo_equals_diffusiondpo_train_py():
    """``losses.dpo.diffusion_dpo_velocity_loss`` vs DIFFUSION_DPO ``train.py`` lines 1125-1145 on B = 4
    pairs of [2, 3, 3] predictions (the velocity target standing for its ε target), β = 100 (so the
    sigmoid is neither flat nor saturated): the loss, the implicit accuracy and ∂L/∂v_θ for both arms are
    equal (the per-sample errors are the same float ops; the reward difference is formed in another
    order: rtol 1e-6)."""
    g = torch.Generator().manual_seed(4)
    target = torch.randn(8, 2, 3, 3, generator=g)
    model_pred = (target + 0.3 * torch.randn(8, 2, 3, 3, generator=g)).requires_grad_()
    ref_pred = target + 0.3 * torch.randn(8, 2, 3, 3, generator=g)
    ours_pred = model_pred.detach().clone().requires_grad_()
    expected, implicit_acc = diffusion_dpo_loss_lines(model_pred, ref_pred, target, 100.0)
    w, lose = slice(0, 4), slice(4, 8)
    loss, metrics = diffusion_dpo_velocity_loss(
        ours_pred[w], ours_pred[lose], ref_pred[w], ref_pred[lose], target[w], target[lose], beta=100.0
    )
    expected.backward()
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(ours_pred.grad, model_pred.grad, rtol=1e-6, atol=1e-12)
    assert metrics["implicit_acc"] == implicit_acc.item() and 0 < implicit_acc.item() < 1
    assert 0.1 < expected.item() < 2.0


# --------------------------------------------------------------------------------------------------
# DMD2
# --------------------------------------------------------------------------------------------------


def test_dmd_generator_loss_equals_dmd2_sd_guidance():
    """``losses.dmd2.dmd_generator_loss`` vs DMD2 ``main/sd_guidance.py`` lines 235-241: the generator
    output is a float32 leaf, the two x̂_0 predictions float64 (``get_x0_from_noise`` on ``.double()``
    inputs, lines 199-201 and 231-233); the loss and ∂L/∂x are bit-identical."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, 4, 4, generator=g)
    x0_real = (x + 0.5 * torch.randn(x.shape, generator=g)).double()
    x0_fake = (x + 0.5 * torch.randn(x.shape, generator=g)).double()
    x_ours, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    loss, metrics = dmd_generator_loss(x_ours, x0_real, x0_fake)
    expected = dmd2_distribution_matching_loss(x_ref, x0_real, x0_fake)
    loss.backward()
    expected.backward()
    assert torch.equal(loss, expected) and torch.equal(x_ours.grad, x_ref.grad)
    assert metrics["zero_normaliser"] == 0 and bool(x_ours.grad.abs().sum() > 0)
