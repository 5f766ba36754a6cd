"""The loops around the losses, against the originals' lines (quoted in each test): which noise levels
each decoupled trainer trains at, which draws are shared by the samples, minibatches and ranks, AWM's
EMA cadence and coefficient, GRPO-Guard's per-step reweighting, CRD's centring and pools.

Sources: NVlabs/DiffusionNFT @ 24af5554 ``scripts/train_nft_sd3.py``; Luo-Yihong/DGPO @ 01ceb4b8
``scripts/train_sd3_dgpo.py``; scxue/advantage_weighted_matching @ be513723 ``scripts/train_sd3_awm.py``;
yifan123/flow_grpo (the authors' GRPO-Guard, @ 2e2f712e) ``scripts/train_sd3_GRPO_Guard.py``;
X-GenGroup/Flow-Factory @ a0b2bc5a ``src/flow_factory/trainers/crd.py``.
"""

from __future__ import annotations

import pytest
import torch
from helpers.trainer.trainer_utils import make_trainer

from reference_trainer.losses import crd as crd_losses

pytestmark = pytest.mark.integration  # builds trainers on the tiny model


def _sigma_table(trainer, samples, index, minibatch=0):
    """σ of every term for samples ``index``: [terms, b]."""
    return torch.stack(
        [trainer.term_sigma(samples, index, j, minibatch) for j in range(trainer.args.term_count())]
    )


def _schedule_index(samples, sigma):
    """The schedule index of each σ (σ drawn from the rollout's schedule), same shape."""
    return (samples.sigmas[:, None, None] == sigma[None]).float().argmax(dim=0)


def test_nft_trains_a_per_sample_shuffle_of_the_schedule_keeping_int_t_times_099(tmp_path):
    """``perms_time = torch.stack([torch.randperm(num_timesteps_filtered) for _ in
    range(total_batch_size_filtered)])``; ``num_train_timesteps = int(config.sample.num_steps *
    config.train.timestep_fraction)`` with ``timestep_fraction = 0.99``: each sample trains
    int(4·0.99) = 3 distinct steps of the 4, its own."""
    trainer = make_trainer("nft", tmp_path, 2, "eval.every=0")
    samples = trainer.sample()
    steps = len(samples.sigmas) - 1
    index = torch.arange(len(samples.prompts))
    table = _schedule_index(samples, _sigma_table(trainer, samples, index))  # [terms, B]
    assert table.shape[0] == int(steps * 0.99) == 3
    for column in table.T:
        assert len(set(column.tolist())) == 3 and max(column.tolist()) < steps
    assert len({tuple(sorted(c.tolist())) for c in table.T}) > 1  # per sample, not one set for all
    # keyed by the global sample: the same whatever rows share the call (any rank layout)
    half = _schedule_index(samples, _sigma_table(trainer, samples, index[len(index) // 2 :]))
    assert torch.equal(half, table[:, len(index) // 2 :])


def test_dgpo_trains_m_shared_steps_of_zero_to_trunc(tmp_path):
    """``train_timesteps = [step_index for step_index in range(config.trunc_steps + 1)]``;
    ``sampled = random.sample(train_timesteps, M)`` on rank 0, ``dist.broadcast(sampled_tensor, src=0)``,
    drawn once before the loop over the iteration's batches: M distinct indices, the same for every
    sample, minibatch and rank."""
    trainer = make_trainer(
        "dgpo", tmp_path, 2, "eval.every=0", "train.trunc_steps=2", "train.num_train_timesteps=2"
    )
    samples = trainer.sample()
    index = torch.arange(len(samples.prompts))
    tables = [_schedule_index(samples, _sigma_table(trainer, samples, index, m)) for m in (0, 1)]
    assert torch.equal(tables[0], tables[1])  # every minibatch
    column = tables[0][:, 0]
    assert (tables[0] == column[:, None]).all()  # every sample (and so every rank's share)
    assert len(set(column.tolist())) == trainer.args.num_train_timesteps == 2
    assert max(column.tolist()) <= 2  # within 0 .. trunc_steps
    seen = set()
    for iteration in range(30):
        trainer.rollout_iteration = iteration
        seen |= set(_schedule_index(samples, _sigma_table(trainer, samples, index[:1]))[:, 0].tolist())
    assert seen == {0, 1, 2}


@pytest.mark.parametrize(
    "kind, strata", [("discrete", [{0, 1}, {2, 3}]), ("discrete_wo_init", [{1}, {2, 3}])]
)
def test_awm_draws_one_step_per_stratum_shared_by_the_minibatch(tmp_path, kind, strata):
    """``boundaries = torch.linspace(0 (discrete) | 1 (discrete_wo_init), int(config.sample.num_steps *
    config.train.timestep_fraction), steps=config.train.train_timesteps + 1)``; ``lower_bounds =
    boundaries[:-1].long()``, ``upper_bounds = boundaries[1:].long()``; ``t_indices = lower_bounds +
    (rand_u * (upper_bounds - lower_bounds)).long()``; ``torch.repeat_interleave(t_indices,
    repeats=config.train.batch_size)``: with T = 4, f = 1, S = 2 the strata are {0, 1}, {2, 3}
    (from 1: linspace(1, 4, 3) = 1, 2.5, 4 → {1}, {2, 3}); one draw for all samples of the minibatch."""
    trainer = make_trainer("awm", tmp_path, 2, "eval.every=0", f"train.timestep_sampling={kind}")
    samples = trainer.sample()
    index = torch.arange(len(samples.prompts))
    seen = [set(), set()]
    for iteration in range(20):
        trainer.rollout_iteration = iteration
        for m in (0, 1):
            table = _schedule_index(samples, _sigma_table(trainer, samples, index, m))
            assert (table == table[:, :1]).all()  # shared by the minibatch's samples
            for s in range(2):
                assert int(table[s, 0]) in strata[s]
                seen[s].add(int(table[s, 0]))
    assert seen == strata


def test_awm_logit_normal_restates_the_stratified_logit_normal_draw():
    """``base_uniform_vector = (torch.arange(T) + torch.rand(T)) / T``; ``u_standard_vector =
    normal_dist.icdf(base_uniform_vector)``; ``u_standard_shuffled = u_standard_vector[torch.randperm(T)]``;
    ``t_vector = torch.sigmoid(u)``; ``shift * t_vector / (1 + (shift - 1) * t_vector)``;
    ``torch.clamp(timesteps, min=0.01)``: one σ per stratum of the logit-normal's quantiles."""
    from reference_trainer.timesteps import logit_normal_sigmas

    T, shift = 6, 3.0
    g, theirs_g = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    ours = logit_normal_sigmas(T, shift, g)
    base = (torch.arange(T) + torch.rand(T, generator=theirs_g)) / T
    u = torch.distributions.Normal(0.0, 1.0).icdf(base)[torch.randperm(T, generator=theirs_g)]
    t = torch.sigmoid(u)
    torch.testing.assert_close(ours, (shift * t / (1 + (shift - 1) * t)).clamp(min=0.01))
    unshifted = ours / (shift - (shift - 1) * ours)  # back to t: one in each stratum of the quantiles
    strata = torch.distributions.Normal(0.0, 1.0).cdf(torch.logit(unshifted)) * T
    assert sorted(int(s) for s in strata) == list(range(T))


def test_awm_ema_moves_once_per_iteration_at_min_of_03_and_0001_step(tmp_path):
    """``decay = min(config.train.kl_ema_decay, 0.001 * global_step)`` (``kl_ema_decay_type`` linear,
    ``kl_ema_decay`` 0.3) and ``tgt_param.data.copy_(tgt_param.detach().data * decay +
    src_param.detach().clone().data * (1.0 - decay))``, once per epoch after its optimizer steps: with two
    optimizer steps per iteration the anchor is unchanged after step 1 and, after step 2, is
    0.002·anchor + 0.998·θ."""
    trainer = make_trainer("awm", tmp_path, 2, "eval.every=0", "train.ema_kl_beta=0.1")
    before = {k: v.clone() for k, v in trainer.variants.snapshot("ema").items()}
    samples = trainer.sample()
    steps = trainer.cycle_steps  # stop after the first step of the iteration: the anchor has not moved
    moved = []

    def watch(items):
        for item in steps(items):
            yield item
            moved.append(
                any(not torch.equal(before[k], v) for k, v in trainer.variants.snapshot("ema").items())
            )

    trainer.cycle_steps = watch
    trainer.optimize(samples)
    assert trainer.optimizer_step == 2 and moved == [False, False]  # not after either step
    policy = dict(trainer.variants.variant("policy").named_parameters())
    for key, anchor in trainer.variants.snapshot("ema").items():
        expected = before[key] * 0.002 + policy[key].detach() * (1 - 0.002)
        torch.testing.assert_close(anchor, expected, rtol=0, atol=1e-6)


def test_grpo_guard_divides_each_steps_policy_loss_by_its_dt(tmp_path):
    """``dt = sigma_prev - sigma``, ``torch.sqrt(-1*dt)`` (the SDE step) and, under ``config.rationorm``,
    ``policy_loss = policy_loss / (sqrt_dt.mean()**2)``: the weight of step j is 1/(σ_j − σ_{j+1});
    Flow-Factory's form (``dt_reweighting: false``) has none."""
    trainer = make_trainer("grpo_guard", tmp_path, 2, "eval.every=0")
    samples = trainer.sample()
    sigmas = samples.trajectory.sigmas
    index = torch.arange(2)
    for j in range(2):
        assert trainer.step_weight(samples, j) == pytest.approx(1.0 / float(sigmas[j] - sigmas[j + 1]))
        weighted, _ = trainer.step_loss(samples, index, j)
        plain = make_trainer(
            "grpo_guard", tmp_path / f"plain{j}", 2, "eval.every=0", "train.dt_reweighting=false"
        )
        assert plain.step_weight(samples, j) == 1.0
        unweighted, _ = plain.step_loss(samples, index, j)
        torch.testing.assert_close(weighted, unweighted / float(sigmas[j] - sigmas[j + 1]))


def test_crd_centres_within_each_prompt_group():
    """Two prompt groups in one minibatch (two ranks, or one minibatch an iteration): each sample is
    centred on its own group's mean (the paper's premise); Flow-Factory's ``adv_cur_avg = (adv_cur *
    softmax_p).sum(dim=0)`` over the gathered minibatch mixes the groups."""
    a = torch.tensor([0.2, 0.8, 0.6, 0.9])
    r = torch.tensor([0.1, -0.3, 0.5, 0.2], dtype=torch.float64)
    groups = torch.tensor([0, 0, 1, 1])
    ours, _ = crd_losses.crd_loss(
        r, r, a, a, beta=1.0, adv_clip_max=5.0, groups_local=groups, groups_all=groups
    )
    expected = 0.0
    for g in (0, 1):
        rows = groups == g
        rc, rc_theta = a[rows] - a[rows].mean(), r[rows] - r[rows].mean()
        expected += ((rc_theta - rc) ** 2).sum()
    torch.testing.assert_close(ours, (expected / 4 * 5.0).to(ours.dtype))
    mixed, _ = crd_losses.crd_loss(r, r, a, a, beta=1.0, adv_clip_max=5.0)  # one group: Flow-Factory's
    assert not torch.isclose(mixed, ours)


def test_crd_hard_pools_split_at_the_advantage_sign():
    """τ = 0: "Positive pool (adv > 0) vs negative pool (adv < 0)" on the advantage A, i.e. a = A/A_max/2
    + ½ above / below ½; Flow-Factory's ``adv_minus_mask = (adv_cur < 0.0)`` on a ∈ [0, 1] is never true."""
    a = crd_losses.normalised_advantage(torch.tensor([-2.0, -1.0, 1.0, 3.0]), 5.0)
    p, p_minus = crd_losses.group_weights(a, 0.0)
    assert (p[:2] == 0).all() and (p[2:] > 0).all()
    assert (p_minus[2:] == 0).all() and (p_minus[:2] > 0).all()
    torch.testing.assert_close(p_minus[:2], torch.softmax(a[:2], dim=0))


def test_crd_refuses_minibatches_that_split_a_prompt_group(tmp_path):
    from reference_trainer.errors import ConfigError

    trainer = make_trainer("crd", tmp_path, 2, "eval.every=0", "train.gradient_steps_per_iteration=4")
    samples = trainer.sample()
    with pytest.raises(ConfigError, match=r"train\.gradient_steps_per_iteration: 4 minibatches would split"):
        trainer.minibatch_order(samples)


def test_dgpo_rolls_out_guided_and_guides_the_reference_at_kl_cfg(tmp_path, monkeypatch):
    """``pipeline_with_logprob(..., guidance_scale=config.sample.guidance_scale)`` (4.5 in
    ``config/dgpo.py``); ``if config.kl_cfg > 1: ref_old_v = predict_v(..., cfg = True,
    cfg_scale=config.kl_cfg)`` else the conditional prediction; the policy's ``model_v`` is never guided."""
    trainer = make_trainer("dgpo", tmp_path, 2, "eval.every=0", "train.kl_cfg=2.5")
    scales = []
    guided = trainer.adapter.guided_forward

    def recording(x, sigma, condition, *, guidance_scale, **model):
        scales.append((guidance_scale, "parameters" in model and model["parameters"] is not None))
        return guided(x, sigma, condition, guidance_scale=guidance_scale, **model)

    monkeypatch.setattr(trainer.adapter, "guided_forward", recording)
    samples = trainer.sample()
    steps = trainer.args.num_inference_steps
    assert {scale for scale, _ in scales} == {4.5} and len(scales) == steps  # every rollout step
    scales.clear()
    trainer.term_loss(samples, torch.arange(4), (0,), 0)
    # the policy unguided, the frozen reference at kl_cfg, ema_ref (the DSM clip's old model) unguided
    assert scales == [(1.0, False), (2.5, True), (1.0, True)]


def test_awm_train_time_cfg_guides_every_velocity_of_the_loss(tmp_path, monkeypatch):
    """``if config.train.cfg``: ``noise_pred = noise_pred_uncond + config.sample.guidance_scale *
    (noise_pred_text - noise_pred_uncond)`` for every model call of the log-prob (the policy's and the
    old one's; the KL partners through the same function)."""
    trainer = make_trainer(
        "awm", tmp_path, 2, "eval.every=0", "train.train_guidance_scale=4.5", "train.kl_beta=0.01"
    )
    samples = trainer.sample()
    scales = []
    guided = trainer.adapter.guided_forward

    def recording(x, sigma, condition, *, guidance_scale, **model):
        scales.append(guidance_scale)
        return guided(x, sigma, condition, guidance_scale=guidance_scale, **model)

    monkeypatch.setattr(trainer.adapter, "guided_forward", recording)
    trainer.term_loss(samples, torch.arange(4), tuple(range(trainer.args.term_count())), 0)
    assert scales == [4.5, 4.5, 4.5]  # policy, old, reference
