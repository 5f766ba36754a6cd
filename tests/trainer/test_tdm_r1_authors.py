"""TDM-R1 as its authors wrote it: each test restates lines of Luo-Yihong/TDM-R1 @
cc55d8975345e565b09d9c02c2800b69ca26fe90 ``scripts/train_tdmr1_pub.py`` (quoted in the docstrings, in the
script's own variables and 0..1000 timestep units) and checks ours against them on random inputs, loss
and gradient, or checks the trainer's draws and inputs (default ``train.variant: authors``).

Pinned: the surrogate's input (the stored x_{j+1} re-noised to τ ≥ max(t_{j+1}, t_min), one τ per
batch, ε shared within a group, the derived target velocity), the reference penalty (velocity MSE), the
runaway clip (batch-mean velocity MSE > 0.05), the time weight ((j+1)/N, j ∝ j+1), the fake score
(velocity DSM + 0.02·teacher pull), the generator's τ ranges, ``trunc_steps`` gating, the KL's unguided
teacher and the fixed CFG-reward scale 3.5.
"""

from __future__ import annotations

import pytest
import torch
from helpers.trainer.trainer_utils import REPO, load, make_trainer

from reference_trainer.errors import ConfigError
from reference_trainer.losses.tdm_r1 import (
    fake_score_loss,
    forward_renoise,
    generator_loss,
    renoise_sigma,
    surrogate_loss,
    surrogate_target,
)

CONFIG = REPO / "examples/tdm_r1/full/sd3_tiny/default.yaml"


# ---------------------------------------------------------------- the script's lines, restated
def convert(x, s=7):
    """``return s * x / 1000 / (1 + (s-1) * x / 1000) * 1000``"""
    return s * x / 1000 / (1 + (s - 1) * x / 1000) * 1000


def inv_convert(y, s=7):
    """``return 1000 * y / (1000 * s - (s - 1) * y)``"""
    return 1000 * y / (1000 * s - (s - 1) * y)


def tau_of(tau_scalar, t_next, t_min=None):
    """``t_next_tmp_inv = inv_convert(t_next_tmp, s=3)``
    ``tau_tmp_inv = tau_scalar * (1000 - (t_next_tmp_inv + 20)) + (t_next_tmp_inv + 20)``
    ``tau_tmp = convert(tau_tmp_inv, s=3)``; with ``t_min``: ``lower_bound = torch.maximum(t_next_tmp,
    t_min_tensor...)`` in place of ``t_next_tmp`` (timesteps in 0..1000)."""
    lower = t_next if t_min is None else torch.maximum(t_next, torch.full_like(t_next, t_min))
    inv = inv_convert(lower, s=3)
    return convert(tau_scalar * (1000 - (inv + 20)) + (inv + 20), s=3)


def authors_surrogate_step(
    dgpo_v, old_v, real_v_dgpo, target_v_dgpo, advantages, groups, K, beta_dpo, clip_range, beta, t_weight
):
    """The surrogate's loss, in the script's order:
    ``dgpo_dsm_loss = 1 * (target_v_dgpo - dgpo_v).square().reshape(x0.shape[0],-1).mean(dim=1)``
    ``ratio = torch.exp(-dgpo_dsm_loss + old_dgpo_dsm_loss)``; ``should_clip = torch.where(advantages > 0,
    ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)`` → ``dgpo_dsm_loss.detach()``
    ``loss_reg_dgpo = (dgpo_v.float() - real_v_dgpo.detach().float()).square().reshape(...).mean(dim=1)``,
    ``.mean()``; ``reg_threshold = getattr(config, "reg_threshold", 0.05)``
    ``ref_ratio = torch.exp(-dgpo_dsm_loss + ref_dsm_loss)``; ``should_clip_ref = (loss_reg_dgpo >
    reg_threshold) & torch.where(advantages > 0, ref_ratio > 1.0, ref_ratio < 1.0)``
    ``compute_group_dgpo_loss_allreduce``: ``delta_diff = dsm_loss.detach() - ref_dsm_loss.detach()``,
    ``per_sample_term = advantages * beta_dpo * delta_diff / group_size``, scatter_add per group,
    ``group_weights = torch.sigmoid(global_group_sums)``, ``loss = (local_weights.detach() * advantages *
    dsm_loss).mean()``
    ``accelerator.backward(t_weight * (dgpo_loss.mean() + config.train.beta * loss_reg_dgpo))``"""
    n = dgpo_v.shape[0]
    dgpo_dsm_loss = (target_v_dgpo - dgpo_v).square().reshape(n, -1).mean(dim=1)
    old_dgpo_dsm_loss = (target_v_dgpo - old_v).square().reshape(n, -1).mean(dim=1)
    ratio = torch.exp(-dgpo_dsm_loss + old_dgpo_dsm_loss)
    should_clip = torch.where(advantages > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)
    dgpo_dsm_loss = torch.where(should_clip, dgpo_dsm_loss.detach(), dgpo_dsm_loss)
    loss_reg_dgpo = (dgpo_v.float() - real_v_dgpo.detach().float()).square().reshape(n, -1).mean(dim=1).mean()
    ref_dsm_loss = (target_v_dgpo.float() - real_v_dgpo.detach().float()).square().reshape(n, -1).mean(dim=1)
    ref_ratio = torch.exp(-dgpo_dsm_loss + ref_dsm_loss)
    should_clip_ref = (loss_reg_dgpo > 0.05) & torch.where(advantages > 0, ref_ratio > 1.0, ref_ratio < 1.0)
    dgpo_dsm_loss = torch.where(should_clip_ref, dgpo_dsm_loss.detach(), dgpo_dsm_loss)
    delta_diff = dgpo_dsm_loss.detach() - ref_dsm_loss.detach()
    per_sample_term = advantages * beta_dpo * delta_diff / K
    sums = torch.zeros(int(groups.max()) + 1).scatter_add_(0, groups, per_sample_term)
    weights = torch.sigmoid(sums)[groups]
    dgpo_loss = (weights.detach() * advantages * dgpo_dsm_loss).mean()
    return t_weight * (dgpo_loss.mean() + beta * loss_reg_dgpo), should_clip_ref


def _rand(g, *shape):
    return torch.randn(*shape, generator=g, dtype=torch.float64).float()


# ---------------------------------------------------------------- losses against the lines
def test_renoise_times_restate_tau_list_and_tau_list_dgpo():
    g = torch.Generator().manual_seed(0)
    t_next = torch.tensor([0.0, 250.0, 500.0, 750.0])
    for u in torch.rand(5, generator=g).tolist():
        torch.testing.assert_close(
            renoise_sigma(u, t_next / 1000, shift=3.0, gap=0.02), tau_of(u, t_next) / 1000
        )
        lower = (t_next / 1000).clamp_min(0.3)
        ours = torch.maximum(renoise_sigma(u, lower, shift=3.0, gap=0.02), lower)  # tau_tmp_dgpo
        torch.testing.assert_close(
            ours, torch.maximum(tau_of(u, t_next, 300.0), t_next.clamp_min(300)) / 1000
        )
    # the range: above the next boundary (by the shifted gap), up to 1
    assert float(renoise_sigma(0.0, torch.tensor([0.5]), shift=3.0, gap=0.02)) > 0.5
    assert float(renoise_sigma(1.0 - 1e-7, torch.tensor([0.5]), shift=3.0, gap=0.02)) == pytest.approx(1.0)


def test_surrogate_target_and_renoise_restate_the_dgpo_lines():
    """``alpha_dgpo_train = (1 - sigmas_tau_dgpo_train) / (1 - sigmas_tnext_dgpo)``
    ``beta_dgpo_train = (sigmas_tau_dgpo_train ** 2 - (sigmas_tnext_dgpo * alpha_dgpo_train) ** 2) ** 0.5``
    ``xtau_dgpo_train = xnext_dgpo * alpha_dgpo_train + beta_dgpo_train * noise_diffuse_dgpo``
    ``target_v_dgpo = - xnext_dgpo / (1 - sigmas_tnext_dgpo) + noise_diffuse_dgpo / beta_dgpo_train *
    (sigmas_tau_dgpo_train + sigmas_tnext_dgpo ** 2 * alpha_dgpo_train / (1 - sigmas_tnext_dgpo))``"""
    g = torch.Generator().manual_seed(1)
    x, eps = _rand(g, 4, 2, 3, 3), _rand(g, 4, 2, 3, 3)
    s_n, s_tau = torch.tensor([0.0, 0.25, 0.5, 0.75]), torch.tensor([0.4, 0.5, 0.8, 0.9])
    a = ((1 - s_tau) / (1 - s_n)).reshape(-1, 1, 1, 1)
    b = (s_tau.reshape(-1, 1, 1, 1) ** 2 - (s_n.reshape(-1, 1, 1, 1) * a) ** 2) ** 0.5
    x_tau, alpha, beta = forward_renoise(x, s_n, s_tau, eps)
    torch.testing.assert_close(x_tau, x * a + b * eps)
    sn = s_n.reshape(-1, 1, 1, 1)
    expected = -x / (1 - sn) + eps / b * (s_tau.reshape(-1, 1, 1, 1) + sn**2 * a / (1 - sn))
    torch.testing.assert_close(surrogate_target(x, eps, s_n, s_tau, alpha, beta), expected)


def test_surrogate_loss_restates_the_reference_penalty_and_the_batch_runaway_clip():
    """Random velocities where R = mean (v_s − v_ref)² is above 0.05 (the clip fires for the samples that
    improved past the reference) and, scaled down, below it (no runaway clip): loss and gradient equal
    the restated lines."""
    g = torch.Generator().manual_seed(2)
    B, K = 8, 4
    groups = torch.arange(B) // K
    adv = _rand(g, B)
    target, v_ref = _rand(g, B, 2, 3, 3), _rand(g, B, 2, 3, 3)
    for scale, fires in ((0.5, True), (0.05, False)):
        v_s = (v_ref + scale * _rand(g, B, 2, 3, 3)).requires_grad_(True)
        v_theirs = v_s.detach().clone().requires_grad_(True)
        v_slow = v_s.detach() + 0.01 * _rand(g, B, 2, 3, 3)
        kwargs = dict(
            group_size=K, beta_dpo=10.0, clip_range=1e-3, runaway_threshold=0.05, reference_beta=1e-3
        )
        ours, info = surrogate_loss(v_s, v_ref, v_slow, target, adv, groups, time_weight=0.75, **kwargs)
        theirs, clipped = authors_surrogate_step(
            v_theirs, v_slow, v_ref, target, adv, groups, K, 10.0, 1e-3, 1e-3, 0.75
        )
        ours.backward()
        theirs.backward()
        assert bool(clipped.any()) is fires and (info["runaway_clip_ratio"] > 0) is fires
        assert info["reference_penalty"] == pytest.approx(
            float((v_s.detach() - v_ref).square().mean()), rel=1e-6
        )
        torch.testing.assert_close(ours, theirs)
        torch.testing.assert_close(v_s.grad, v_theirs.grad)


def test_fake_score_loss_restates_velocity_dsm_plus_the_teacher_pull():
    """``target_v = (xtau - model_x0) / sigmas_tau``; ``loss_fake = (target_v.detach() - fake_v).square().mean()``
    ``loss_reg_fake = (real_v - fake_v).square().mean()``; ``accelerator.backward(loss_fake + 0.02 * loss_reg_fake)``"""
    g = torch.Generator().manual_seed(3)
    fake_v = _rand(g, 3, 2, 3, 3).requires_grad_(True)
    theirs_v = fake_v.detach().clone().requires_grad_(True)
    target_v, real_v = _rand(g, 3, 2, 3, 3), _rand(g, 3, 2, 3, 3)
    ours, _ = fake_score_loss(fake_v, target_v, real_v)
    theirs = (target_v - theirs_v).square().mean() + 0.02 * (real_v - theirs_v).square().mean()
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(fake_v.grad, theirs_v.grad)


def authors_generator(
    model_x0,
    real_x0_for_fake,
    real_cond_x0,
    real_uncond_x0,
    fake_x0,
    dgpo_x0,
    dgpo_ref_x0,
    rl,
    use_huber,
    tdm_weight=0.3,
):
    """``cfg_revised_x0 = (model_x0 + 3.5 * (real_cond_x0 - real_uncond_x0)).detach()``
    ``kl_revised_x0 = (model_x0 + 1 * (real_cond_x0 - fake_x0)).detach()``
    ``weighting_factor = torch.abs(model_x0.double() - real_x0_for_fake.double()).mean(dim=[1, 2, 3], keepdim=True).detach()``
    ``err_kl = (kl_revised_x0 - model_x0).square()``; ``err_cfg_reward = (cfg_revised_x0 - model_x0).square()``
    ``err_tdm = err_cfg_reward + err_kl``; huber: ``loss_tdm = torch.mean((torch.sqrt(err_tdm + huber_c**2) - huber_c) / weighting_factor)``
    ``loss_cfg_reward = 3.5 * torch.mean((torch.sqrt( err_cfg_reward + huber_c**2) - huber_c) / weighting_factor)`` (huber)
    or ``(err_cfg_reward / weighting_factor).mean()``; ``loss_kl`` likewise (no factor)
    ``if j < trunc_steps``: ``dgpo_revised_x0 = (model_x0 + dgpo_x0 - dgpo_ref_x0).detach()``,
    ``weighting_dgpo = torch.abs(model_x0.double() - dgpo_x0.double()).mean(dim=[1, 2, 3], keepdim=True).detach()``,
    ``err_reward = (dgpo_revised_x0 - model_x0).square()``, ``loss = config.train.tdm_weight * loss_cfg_reward
    + (1 - config.train.tdm_weight) * loss_reward + loss_kl``; else ``loss = config.train.tdm_weight * loss_tdm``"""
    huber_c = 1e-3
    cfg_revised_x0 = (model_x0 + 3.5 * (real_cond_x0 - real_uncond_x0)).detach()
    kl_revised_x0 = (model_x0 + 1 * (real_cond_x0 - fake_x0)).detach()
    weighting_factor = (
        torch.abs(model_x0.double() - real_x0_for_fake.double()).mean(dim=[1, 2, 3], keepdim=True).detach()
    )
    err_kl = (kl_revised_x0 - model_x0).square()
    err_cfg_reward = (cfg_revised_x0 - model_x0).square()
    err_tdm = err_cfg_reward + err_kl
    if use_huber:
        loss_tdm = torch.mean((torch.sqrt(err_tdm + huber_c**2) - huber_c) / weighting_factor)
        loss_cfg_reward = 3.5 * torch.mean(
            (torch.sqrt(err_cfg_reward + huber_c**2) - huber_c) / weighting_factor
        )
        loss_kl = torch.mean((torch.sqrt(err_kl + huber_c**2) - huber_c) / weighting_factor)
    else:
        loss_tdm = (err_tdm / weighting_factor).mean()
        loss_cfg_reward = (err_cfg_reward / weighting_factor).mean()
        loss_kl = (err_kl / weighting_factor).mean()
    if not rl:
        return tdm_weight * loss_tdm
    dgpo_revised_x0 = (model_x0 + dgpo_x0 - dgpo_ref_x0).detach()
    weighting_dgpo = (
        torch.abs(model_x0.double() - dgpo_x0.double()).mean(dim=[1, 2, 3], keepdim=True).detach()
    )
    err_reward = (dgpo_revised_x0 - model_x0).square()
    if use_huber:
        loss_reward = torch.mean((torch.sqrt(err_reward + huber_c**2) - huber_c) / weighting_dgpo)
    else:
        loss_reward = (err_reward / weighting_dgpo).mean()
    return tdm_weight * loss_cfg_reward + (1 - tdm_weight) * loss_reward + loss_kl


@pytest.mark.parametrize("rl", [True, False], ids=["j<trunc", "j>=trunc"])
@pytest.mark.parametrize("use_huber", [False, True], ids=["squared", "huber"])
def test_generator_loss_restates_the_unguided_kl_the_fixed_cfg_reward_and_trunc_gating(rl, use_huber):
    g = torch.Generator().manual_seed(4)
    shape = (3, 2, 3, 3)
    x0 = _rand(g, *shape).requires_grad_(True)
    x0_theirs = x0.detach().clone().requires_grad_(True)
    guided, cond, uncond, fake, sur, ref = (_rand(g, *shape) for _ in range(6))
    ours, info = generator_loss(
        x0, guided, cond, uncond, fake, (sur, ref) if rl else None,
        tdm_weight=0.3, cfg_reward_scale=3.5, huber_c=1e-3 if use_huber else None,
    )  # fmt: skip
    theirs = authors_generator(x0_theirs, guided, cond, uncond, fake, sur, ref, rl, use_huber)
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(ours, theirs.float())
    torch.testing.assert_close(x0.grad, x0_theirs.grad)
    assert (info["surrogate_reward_loss"] > 0) is rl


# ---------------------------------------------------------------- the trainer's draws and inputs
def _recorded_forwards(trainer, monkeypatch):
    """Record (model kind, x, σ) of every adapter forward: kind = the variant's role or 'teacher'/'slow'."""
    calls = []
    forward = trainer.adapter.forward
    names = {id(trainer.variants.variant(role)): role for role in ("generator", "fake", "surrogate")}
    snapshots = {id(trainer.variants.snapshot(s)): s for s in ("teacher", "slow_surrogate")}

    def recording(x, sigma, condition, *, module=None, parameters=None):
        kind = names.get(id(module)) if module is not None else snapshots.get(id(parameters))
        calls.append((kind, x.detach().clone(), sigma.detach().clone()))
        return forward(x, sigma, condition, module=module, parameters=parameters)

    monkeypatch.setattr(trainer.adapter, "forward", recording)
    return calls


def test_the_surrogate_trains_on_the_stored_next_state_renoised_with_one_tau_and_group_noise(
    tmp_path, monkeypatch
):
    """``xnext_dgpo = sample["next_latents"][:, j_dgpo]``; ``tau_scalar_dgpo = generate_shared_timestep(...)``
    (one u for the batch); ``lower_bound = torch.maximum(t_next_dgpo, t_min_tensor...)``;
    ``noise_diffuse_dgpo = generate_shared_noise_for_groups(x0, group_info, accelerator)``."""
    trainer = make_trainer("tdm_r1", tmp_path, 3, "eval.every=0")
    rollout = trainer.sample()
    draws = trainer.shared_draws()
    calls = _recorded_forwards(trainer, monkeypatch)
    j = draws.stages[0]
    trainer.authors_surrogate_loss(rollout, draws, j)
    ((_, x_tau, sigma_tau),) = [c for c in calls if c[0] == "surrogate"]
    j_s = draws.surrogate_stage[j]
    sigmas, latents = rollout.trajectory.sigmas, rollout.trajectory.latents
    t_next = torch.full((len(x_tau),), float(sigmas[j_s + 1]) * 1000)
    assert torch.unique(sigma_tau).numel() == 1  # one τ for the batch
    torch.testing.assert_close(sigma_tau, tau_of(draws.u_surrogate[j], t_next, 300.0) / 1000)
    assert float(sigma_tau[0]) >= max(float(sigmas[j_s + 1]), 0.3)
    s_n, s_tau = float(sigmas[j_s + 1]), float(sigma_tau[0])
    alpha = (1 - s_tau) / (1 - s_n)
    beta = (s_tau**2 - (s_n * alpha) ** 2) ** 0.5
    noise = (x_tau - alpha * latents[:, j_s + 1]) / beta  # what the stored x_{j+1} was re-noised with
    for group in rollout.group_ids.unique():
        members = noise[rollout.group_ids == group]
        torch.testing.assert_close(members, members[:1].expand_as(members), atol=1e-5, rtol=0)
    assert not torch.allclose(noise[0], noise[-1])  # different groups: different noise
    # the generator's reward query (``tau_tmp_dgpo = torch.maximum(tau_tmp_dgpo, lower_bound)``): the
    # surrogate guided at rl_cfg in one doubled batch (unconditional and conditional rows), at one
    # τ' ≥ max(σ_{j+1}, t_min)
    calls.clear()
    trainer.authors_generator_loss(rollout, draws, j)
    ((_, x_r, sigma_r),) = [c for c in calls if c[0] == "surrogate"]
    assert len(x_r) == 2 * len(x_tau) and torch.unique(sigma_r).numel() == 1
    t_next = torch.full((len(x_tau),), float(sigmas[j + 1]) * 1000)
    expected = torch.maximum(tau_of(draws.u_reward[j], t_next, 300.0), t_next.clamp_min(300.0)) / 1000
    torch.testing.assert_close(sigma_r[: len(x_tau)], expected)


def test_the_surrogate_stage_is_drawn_in_proportion_to_j_plus_one_and_weighted_by_it(tmp_path):
    """``weights = torch.arange(N) + 1``; ``probs = weights / weights.sum()``; ``j_dgpo_tmp =
    torch.multinomial(probs, num_samples=1)``; ``t_weight = (j_dgpo + 1) / config.sample.num_steps``: the
    time weight is at most 1, and j_s = K − 1 is drawn K times as often as j_s = 0."""
    trainer = make_trainer("tdm_r1", tmp_path, 3, "eval.every=0")
    k = trainer.args.num_generator_steps
    counts = torch.zeros(k)
    for iteration in range(600):
        trainer.rollout_iteration = iteration
        draws = trainer.shared_draws()
        counts += torch.bincount(torch.tensor(draws.surrogate_stage), minlength=k)
        assert len(set(draws.stages)) == len(draws.stages) == trainer.args.stages_per_iteration
    expected = (torch.arange(k) + 1.0) / (k * (k + 1) / 2)
    torch.testing.assert_close(counts / counts.sum(), expected, atol=0.02, rtol=0)


def test_the_phases_run_generator_fake_surrogate_and_the_fake_reads_the_rollout_velocity(
    tmp_path, monkeypatch
):
    """Each role steps once per batch on the weights the batch started with: the generator first (it
    reads the fake score and the surrogate), the fake score from the rollout's own generator velocity
    (no generator forward in the fake phase)."""
    trainer = make_trainer("tdm_r1", tmp_path, 3, "eval.every=0")
    assert trainer.phase_roles() == ["generator", "fake", "surrogate"]
    rollout = trainer.sample()
    draws = trainer.shared_draws()
    calls = _recorded_forwards(trainer, monkeypatch)
    trainer.authors_fake_loss(rollout, draws, draws.stages[0])
    assert [c[0] for c in calls] == ["teacher", "fake"]


def test_variant_fields_are_refused_under_the_other_variant():
    assert load(CONFIG).train.variant == "authors"
    for overrides, message in [
        (["train.snr_cap=3"], r"train\.snr_cap: is read by variant flow_factory only"),
        (
            ["train.fake_updates_per_generator_update=2"],
            r"train\.fake_updates_per_generator_update: is read by",
        ),
        (["train.variant=flow_factory"], r"train\.trunc_steps: is read by variant authors only"),
        (
            ["train.stages_per_iteration=5"],
            r"train\.stages_per_iteration: must be in 1\.\.num_generator_steps=4",
        ),
        (["train.trunc_steps=1"], r"train\.trunc_steps: must be in stages_per_iteration"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load(CONFIG, *overrides)


def test_the_fake_phase_and_the_generators_tdm_terms_share_tau_list_without_t_min(tmp_path, monkeypatch):
    """``tau = tau_list[j]`` in both the fake score's step and the generator's (``fake_v = predict_v(
    transformer, xtau, tau, ...)`` twice), ``tau_list`` built from ``t_next_tmp`` alone (no t_min)."""
    trainer = make_trainer("tdm_r1", tmp_path, 3, "eval.every=0")
    rollout = trainer.sample()
    draws = trainer.shared_draws()
    calls = _recorded_forwards(trainer, monkeypatch)
    j = draws.stages[0]
    trainer.authors_fake_loss(rollout, draws, j)
    trainer.authors_generator_loss(rollout, draws, j)
    fake_sigmas = [sigma for kind, _, sigma in calls if kind == "fake"]
    assert len(fake_sigmas) == 2
    t_next = torch.full_like(fake_sigmas[0], float(rollout.trajectory.sigmas[j + 1]) * 1000)
    for sigma in fake_sigmas:
        torch.testing.assert_close(sigma, tau_of(draws.u_fake[j], t_next) / 1000)
