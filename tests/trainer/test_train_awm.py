"""AWM: the log-prob weightings and the loss against hand values and the canonical lines; the arguments
are validated with the field named; it learns on the tiny SD3 model (frozen components and the
reference bit-identical, the policy and its EMA changed), its first steps match the goldens, and two
identical dumped runs compare ``ok``."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.trainer import trainer_utils
from helpers.trainer.golden_utils import check_golden
from helpers.trainer.trainer_utils import (
    REPO,
    assert_every_parameter_changed,
    assert_frozen_except_followers,
    frozen_state,
    load,
    metrics,
)

from reference_trainer.errors import ConfigError
from reference_trainer.losses.awm import awm_log_prob, awm_loss

# --- the loss --------------------------------------------------------------------------------------


def test_awm_log_prob_weightings_hand_values():
    """v_θ − (ε − x_0) = [1, −3] (ε = x_0 = 0, v = [1, −3]): e = mean(1, 9) = 5; σ = 0.5:
    uniform −5; t −2.5; t**2 −1.25; huber −(√(5 + 1e-10) − 1e-5)·0.5; ghuber (p = ½)
    −((5 + 1e-10)^½ − (1e-10)^½)·0.5/0.5."""
    v, zero, sigma = torch.tensor([[1.0, -3.0]]), torch.zeros(1, 2), torch.tensor([0.5])
    values = {w: awm_log_prob(v, zero, zero, sigma, weighting=w, ghuber_power=0.5).item() for w in
              ("uniform", "t", "t**2", "huber", "ghuber")}  # fmt: skip
    assert values["uniform"] == -5.0 and values["t"] == -2.5 and values["t**2"] == -1.25
    assert values["huber"] == pytest.approx(-(math.sqrt(5 + 1e-10) - 1e-5) * 0.5, rel=1e-12)
    assert values["ghuber"] == pytest.approx(-(math.sqrt(5 + 1e-10) - 1e-5), rel=1e-12)
    assert awm_log_prob(v, zero, zero, sigma).dtype == torch.float64


def test_awm_loss_sum_first_and_exp_first_hand_values():
    """S = 2, B = 2; ℓ_θ − ℓ_old = [[0.1, −0.2], [0.3, 0.0]], A = [1, −1], ε = 0.05.
    sum_first: r = exp([0.2, −0.1]) = [1.2214, 0.9048]; sample 0 (A > 0): max(−1.2214, −1.05) = −1.05;
    sample 1 (A < 0): max(0.9048, 0.95) = 0.95; L = (−1.05 + 0.95)/2 = −0.05, both clipped (no gradient).
    exp_first: r = exp([0.1, −0.2, 0.3, 0]): terms max(−1.1052, −1.05) = −1.05, max(0.8187, 0.95) = 0.95,
    −1.05, max(−1·1, ...) = 1 for (A = −1, r = 1): 1.0; L = (−1.05 + 0.95 − 1.05 + 1)/4 = −0.0375."""
    delta = torch.tensor([[0.1, -0.2], [0.3, 0.0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0])
    log_prob = delta.clone().requires_grad_()
    loss, stats = awm_loss(
        log_prob, torch.zeros(2, 2, dtype=torch.float64), adv, clip_range=0.05, adv_clip_max=5
    )
    assert loss.item() == pytest.approx(-0.05, abs=1e-12) and stats["clip_frac"] == 1.0
    loss.backward()
    assert torch.equal(log_prob.grad, torch.zeros(2, 2, dtype=torch.float64))
    loss, _ = awm_loss(
        delta,
        torch.zeros(2, 2, dtype=torch.float64),
        adv,
        clip_range=0.05,
        adv_clip_max=5,
        loss_type="exp_first",
    )
    assert loss.item() == pytest.approx(-0.0375, abs=1e-12)
    velocity, ref = torch.ones(2, 2, 3), torch.zeros(2, 2, 3)
    loss, stats = awm_loss(
        delta, delta, adv, clip_range=0.05, adv_clip_max=5, velocity=velocity,
        kl_beta=0.5, ref_velocity=ref, ema_kl_beta=0.25, ema_velocity=2 * velocity,
    )  # fmt: skip
    # r = 1: L_pg = mean(−1, +1) = 0; KL = 1, EMA-KL = 1: L = 0.5 + 0.25
    assert stats["kl"] == 1.0 and stats["ema_kl"] == 1.0 and loss.item() == pytest.approx(0.75)


@pytest.mark.parametrize(
    ("weighting", "loss_type"), [("uniform", "sum_first"), ("t", "exp_first"), ("huber", "sum_first"),
                                 ("ghuber", "exp_first"), ("t**2", "sum_first")]
)  # fmt: skip
def test_transcription_of_awm_reference(weighting, loss_type):
    """The same inputs through a re-statement of scxue/advantage_weighted_matching
    ``advantage_weighted_matching/scripts/train_sd3_awm.py`` @ be5137232e33a21b449ed65a533211d0deb97ed8:
    ``compute_log_prob_awm`` lines 237-251 (fp64 error, the weightings) and the training step lines
    1289-1350 (advantage clip, ``sum_first`` / ``exp_first`` ratio, PPO clip, the Uniform KL and EMA-KL,
    ``loss = policy_loss + beta·kl_loss + ema_beta·ema_kl_loss``), with its [S·B, C, H, W] batching and
    [S·B, 1, 1, 1] timesteps: equal loss and equal gradient with respect to the policy velocity."""
    g = torch.Generator().manual_seed(5)
    S, B, shape = 3, 4, (4, 4, 4)
    clip_range, adv_clip_max, beta, ema_beta, ghuber_power = 0.02, 5.0, 0.01, 0.1, 0.25
    clean_latents = torch.randn(S * B, *shape, generator=g)
    random_noise = torch.randn(S * B, *shape, generator=g)
    timestep = (torch.rand(S, generator=g) * 0.9 + 0.05).repeat_interleave(B).view(-1, 1, 1, 1)
    advantages_in = torch.tensor([1.5, -0.5, 7.0, -2.0])
    target = random_noise - clean_latents
    old_output = target + 0.5 * torch.randn(S * B, *shape, generator=g)
    ref_output = target + 0.5 * torch.randn(S * B, *shape, generator=g)
    ema_output = target + 0.5 * torch.randn(S * B, *shape, generator=g)
    scale = torch.tensor([0.002, 0.3, 0.002, 0.3]).repeat(S).view(-1, 1, 1, 1)  # samples 1, 3 move far
    leaf = (old_output + scale * torch.randn(S * B, *shape, generator=g)).requires_grad_()

    def compute_log_prob_awm(noise_pred):
        model_output = noise_pred.double()
        log_prob = -((model_output - (random_noise.double() - clean_latents.double())) ** 2)
        log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
        if weighting == "t":
            log_prob = log_prob * timestep.view(-1)
        elif weighting == "t**2":
            log_prob = log_prob * timestep.view(-1) ** 2
        elif weighting == "huber":
            log_prob = -(torch.sqrt(-log_prob + 1e-10) - 1e-5) * timestep.view(-1)
        elif weighting == "ghuber":
            log_prob = (
                -(
                    torch.pow(-log_prob + 1e-10, ghuber_power)
                    - torch.pow(torch.tensor(1e-10, dtype=log_prob.dtype), ghuber_power)
                )
                * timestep.view(-1)
                / ghuber_power
            )
        return log_prob, model_output

    # --- canonical (re-stated) ---
    log_prob, model_output = compute_log_prob_awm(leaf)
    old_log_prob, _ = compute_log_prob_awm(old_output)
    _, model_output_ref = compute_log_prob_awm(ref_output)
    _, model_output_ema = compute_log_prob_awm(ema_output)
    log_probs, old_log_probs = log_prob.reshape(S, B), old_log_prob.reshape(S, B)
    advantages = torch.clamp(advantages_in, -adv_clip_max, adv_clip_max)
    if loss_type == "sum_first":
        ratio = torch.exp(log_probs.mean(dim=0) - old_log_probs.mean(dim=0).detach())
    else:
        ratio = torch.exp(log_probs.view(-1) - old_log_probs.view(-1).detach())
        advantages = advantages.unsqueeze(0).repeat(S, 1).view(-1)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy_loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss))
    mo = model_output.reshape(S, B, *shape)
    kl_loss = ((mo - model_output_ref.reshape(S, B, *shape)) ** 2).mean(dim=(2, 3, 4), keepdim=True)
    kl_loss = kl_loss.mean(dim=0).mean()
    ema_kl_loss = ((mo - model_output_ema.reshape(S, B, *shape)) ** 2).mean(dim=(2, 3, 4), keepdim=True)
    ema_kl_loss = ema_kl_loss.mean(dim=0).mean()
    reference_loss = policy_loss + beta * kl_loss + ema_beta * ema_kl_loss
    (reference_grad,) = torch.autograd.grad(reference_loss, leaf)

    # --- ours ---
    v = leaf.detach().clone().requires_grad_()
    sigma = timestep.view(-1)

    def ours_log_prob(u):
        lp = awm_log_prob(
            u, random_noise, clean_latents, sigma, weighting=weighting, ghuber_power=ghuber_power
        )
        return lp.view(S, B)

    loss, _ = awm_loss(
        ours_log_prob(v), ours_log_prob(old_output), advantages_in, clip_range=clip_range,
        adv_clip_max=adv_clip_max, loss_type=loss_type, velocity=v.view(S, B, *shape), kl_beta=beta,
        ref_velocity=ref_output.view(S, B, *shape), ema_kl_beta=ema_beta, ema_velocity=ema_output.view(S, B, *shape),
    )  # fmt: skip
    loss.backward()
    torch.testing.assert_close(loss.detach(), reference_loss.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(v.grad, reference_grad, rtol=1e-6, atol=1e-9)
    clipped = torch.abs(ratio.detach() - 1) > clip_range
    assert bool(clipped.any()) and not bool(clipped.all()), "the clip must act on some ratios, not all"


def test_awm_arguments_are_validated_with_the_field_named():
    config = REPO / "examples/awm/full/sd3_tiny/default.yaml"
    assert load(config).train.clip_range == 1e-4
    with pytest.raises(ConfigError, match=r"train\.weighting"):
        load(config, "train.weighting=cubic")
    with pytest.raises(ConfigError, match=r"train\.loss_type"):
        load(config, "train.loss_type=mean_first")
    with pytest.raises(ConfigError, match=r"train\.clip_range: must be > 0"):
        load(config, "train.clip_range=0")


# --- the trainer -----------------------------------------------------------------------------------

CONFIG = "examples/awm/full/sd3_tiny/default.yaml"
OVERRIDES = ["train.kl_beta=0.001", "train.ema_kl_beta=0.1"]
STEPS = 30


@pytest.fixture(scope="module")
def learning_run(tmp_path_factory):
    """30 steps (15 rollout iterations × 2 minibatches) of the example config with KL and EMA-KL."""
    return trainer_utils.learning_run("awm", tmp_path_factory.mktemp("awm"), STEPS, *OVERRIDES)


@pytest.mark.integration
def test_awm_raises_reward_and_keeps_frozen_roles(learning_run, capsys):
    """The fixed-noise mean brightness reward rises; the VAE, text encoder and reference are bit-identical;
    every policy parameter that can get a gradient changed, and so did the old and EMA snapshots. The
    first minibatch of an iteration is at the rollout policy (r = 1); the second is off it."""
    run = learning_run
    trainer, before, after = run["trainer"], run["before"], run["after"]
    with capsys.disabled():
        print(
            f"\nAWM tiny SD3, {STEPS} steps: fixed-noise mean brightness reward {before:.4f} -> {after:.4f}"
        )
    assert after > before + 0.01
    records = metrics(run["out"])
    assert [r["optimizer_step"] for r in records] == list(range(1, STEPS + 1))
    assert all(r["ratio_mean"] == 1.0 and r["clip_frac"] == 0.0 for r in records[0::2])
    assert any(r["clip_frac"] > 0 for r in records[1::2])
    assert records[0]["kl"] == 0.0 and records[-1]["kl"] > 0.0 and records[-1]["ema_kl"] > 0.0
    following = ("snapshot.old.", "snapshot.ema.")
    assert_frozen_except_followers(run["frozen"], frozen_state(trainer), following)
    policy = trainer.variants.variant("policy")
    assert_every_parameter_changed(trainer, run["initial"]["policy"], policy, "policy")


@pytest.mark.numeric
@pytest.mark.integration
def test_awm_goldens(learning_run):
    check_golden("awm", metrics(learning_run["out"]), config=CONFIG, overrides=OVERRIDES)


@pytest.mark.integration
def test_two_identical_dumped_runs_compare_ok(tmp_path):
    """Off-policy (rollouts from the EMA), dumped twice: ``ok``."""
    from helpers.trainer.dump_utils import dumped_runs_compare

    result = dumped_runs_compare(
        tmp_path, REPO / CONFIG, "train.off_policy=true", "train.loss_type=exp_first"
    )
    keys = {stage["key"] for stage in result["stages"]}
    assert result["verdict"] == "ok" and result["first_divergence"] is None
    expected = {
        "rollout.prompt_ids",  # the inputs (same-inputs gate)
        "rollout.noise",
        "rollout.timesteps",
        "rollout.latents",
        "reward",
        "advantage",
        "train.x_t",
        "train.log_prob",
        "train.log_prob_old",
        "train.ratio",
        "loss.policy",
        "grad_norm.policy",
    }
    assert expected <= keys, sorted(expected - keys)
    assert any(key.startswith("L000.") for key in keys), "block forwards were not dumped"
