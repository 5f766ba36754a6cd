"""Flow-DPPO: the trust-region mask and loss against hand values and Flow-Factory-Draft's lines; the
arguments are validated with the field named; it learns on the tiny SD3 model, only the trainable role
changes, its first steps match the goldens, and two identical dumped runs (v-based mask) compare ``ok``."""

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
    assert_rollout_velocities_replay,
    frozen_state,
    load,
    metrics,
)

from reference_trainer.errors import ConfigError
from reference_trainer.losses.dppo import (
    dppo_loss,
    gaussian_mean_kl,
    trust_region_keep,
    velocity_sq_error,
)

# --- the loss --------------------------------------------------------------------------------------

E = math.exp(0.1)


def test_dppo_mask_loss_and_gradient_hand_values():
    """τ = 1e-6; five samples, Δlogp = log r and A chosen to hit every case of
    drop = [D ≥ τ] ∧ ([r > 1 ∧ A > 0] ∨ [r < 1 ∧ A < 0]):

        i  log r   A    D      drop?                         −A·r·keep
        0  +0.1   +1   1e-3   outside, moving further: yes   0
        1  +0.1   −1   1e-3   outside, moving back: no       +e^0.1
        2  −0.1   −2   1e-3   outside, moving further: yes   0
        3  −0.1   +2   1e-7   inside: no                     −2·e^−0.1
        4  +0.1   +1   1e-7   inside: no                     −e^0.1

    L = (e^0.1 − 2e^−0.1 − e^0.1)/5 = −2e^−0.1/5 = −0.361935; ∂L/∂log p_i = −A_i·r_i·keep_i/5 (no ratio clip)."""
    log_prob = torch.tensor([0.1, 0.1, -0.1, -0.1, 0.1], requires_grad=True)
    advantages = torch.tensor([1.0, -1.0, -2.0, 2.0, 1.0])
    kl = torch.tensor([1e-3, 1e-3, 1e-3, 1e-7, 1e-7])
    loss, keep, stats = dppo_loss(log_prob, torch.zeros(5), advantages, kl, threshold=1e-6, adv_clip_max=5.0)
    assert keep.tolist() == [0.0, 1.0, 0.0, 1.0, 1.0]
    assert loss.item() == pytest.approx(-2 * math.exp(-0.1) / 5, abs=1e-6)
    assert stats["keep_frac"] == pytest.approx(0.6)
    loss.backward()
    expected = torch.tensor([0.0, E, 0.0, -2 * math.exp(-0.1), -E]) / 5
    torch.testing.assert_close(log_prob.grad, expected)


def test_dppo_advantage_clip_and_ratio_exactly_one():
    """A = [10, −10] clipped to ±A_max = ±5; r = 1 is neither > 1 nor < 1, so it is kept even far outside
    the region: L = mean(−5, +5) = 0, keep = [1, 1]."""
    loss, keep, _ = dppo_loss(
        torch.zeros(2),
        torch.zeros(2),
        torch.tensor([10.0, -10.0]),
        torch.tensor([1.0, 1.0]),
        threshold=1e-6,
        adv_clip_max=5.0,
    )
    assert keep.tolist() == [1.0, 1.0] and loss.item() == 0.0


def test_trust_region_divergences_hand_values():
    """x-based: μ_θ − μ_old = [[0.1, 0.3]], s = 0.5: mean((0.01, 0.09))/(2·0.25) = 0.05/0.5 = 0.1.
    v-based: v_θ − v_old = [[1, −2], [0, 0]]: mean((1, 4)) = 2.5, and 0.
    The mask has no gradient: ∂keep/∂anything = 0 (it is built from comparisons)."""
    kl_x = gaussian_mean_kl(torch.tensor([[0.1, 0.3]]), torch.zeros(1, 2), torch.full((1, 1), 0.5))
    torch.testing.assert_close(kl_x, torch.tensor([0.1]))
    kl_v = velocity_sq_error(torch.tensor([[1.0, -2.0], [0.0, 0.0]]), torch.zeros(2, 2))
    torch.testing.assert_close(kl_v, torch.tensor([2.5, 0.0]))
    ratio = torch.tensor([1.1, 0.9], requires_grad=True)
    keep = trust_region_keep(torch.tensor([1.0, 1.0]), ratio, torch.tensor([1.0, 1.0]), 1e-6)
    assert keep.tolist() == [0.0, 1.0] and not keep.requires_grad


@pytest.mark.parametrize("kl_mask_type", ["x-based", "v-based"])
def test_transcription_of_flow_factory_draft_dppo(kl_mask_type):
    """The same inputs through a re-statement of Jayce-Ping/Flow-Factory-Draft
    ``src/flow_factory/trainers/dppo.py`` @ 42b71566: ``gaussian_kl_div`` (lines 46-48),
    ``_effective_sigma`` for Flow-SDE (lines 76-77: ``std_dev_t·sqrt(−dt)``) and ``optimize`` step
    "3. Compute loss" (lines 183-213: advantage clip, ratio, ``kl_new_old``, ``violate`` / ``pos_rm`` /
    ``neg_rm`` / ``keep_mask``, ``policy_loss``), with its [B, 1, 1, 1] ``std_dev_t`` and ``dt``.
    The keep masks are equal, and so are the loss and its gradient (the velocity's and the log-prob's)."""
    generator = torch.Generator().manual_seed(2)
    batch, shape = 8, (4, 4, 4)
    sigma, sigma_prev, noise_level = 0.7, 0.5, 0.7
    adv_in = torch.tensor([1.5, -0.5, 6.0, -2.0, 0.3, -7.0, 1.0, -1.0])
    log_prob_leaf = (0.01 * torch.randn(batch, generator=generator)).requires_grad_()
    old_log_prob = torch.zeros(batch)
    old_tensor = torch.randn(batch, *shape, generator=generator)
    # per-sample distances from the old policy: half inside τ = 1e-6, half outside
    scale = torch.tensor([1e-5, 1e-1, 1e-5, 1e-1, 1e-1, 1e-1, 1e-5, 1e-1]).view(-1, 1, 1, 1)
    new_leaf = (old_tensor + scale * torch.randn(batch, *shape, generator=generator)).requires_grad_()
    threshold = 1e-6
    adv_clip_range = (-5.0, 5.0)

    # --- Flow-Factory-Draft (re-stated) ---
    sigma_b = torch.full((batch, 1, 1, 1), sigma)
    dt = torch.full((batch, 1, 1, 1), sigma_prev) - sigma_b
    std_dev_t = torch.sqrt(sigma_b / (1 - sigma_b)) * noise_level
    adv = torch.clamp(adv_in, adv_clip_range[0], adv_clip_range[1])
    ratio = torch.exp(log_prob_leaf - old_log_prob)
    if kl_mask_type == "v-based":
        sq = (new_leaf - old_tensor) ** 2
        kl_new_old = sq.mean(dim=tuple(range(1, sq.ndim)))
    else:
        sigma_t = std_dev_t * torch.sqrt(-dt)
        kl_elem = (new_leaf - old_tensor) ** 2 / (2 * sigma_t**2)
        kl_new_old = kl_elem.mean(dim=tuple(range(1, kl_elem.ndim)))
    unclipped_loss = -adv * ratio
    violate = kl_new_old >= threshold
    pos_rm = violate & (ratio > 1.0) & (adv > 0)
    neg_rm = violate & (ratio < 1.0) & (adv < 0)
    keep_mask = torch.logical_not(pos_rm | neg_rm).to(dtype=unclipped_loss.dtype).detach()
    draft_loss = torch.mean(unclipped_loss * keep_mask)
    draft_grads = torch.autograd.grad(draft_loss, [log_prob_leaf, new_leaf], allow_unused=True)

    # --- ours ---
    log_prob = log_prob_leaf.detach().clone().requires_grad_()
    new = new_leaf.detach().clone().requires_grad_()
    if kl_mask_type == "v-based":
        kl = velocity_sq_error(new, old_tensor)
    else:
        kl = gaussian_mean_kl(new, old_tensor, std_dev_t * math.sqrt(sigma - sigma_prev))
    loss, keep, _ = dppo_loss(log_prob, old_log_prob, adv_in, kl, threshold=threshold, adv_clip_max=5.0)
    loss.backward()

    torch.testing.assert_close(kl.detach(), kl_new_old.detach(), rtol=1e-6, atol=0)
    assert torch.equal(keep, keep_mask)
    assert 0 < int(keep.sum()) < batch and bool((kl < threshold).any()) and bool((kl >= threshold).any())
    torch.testing.assert_close(loss.detach(), draft_loss.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(log_prob.grad, draft_grads[0])
    # the mask is detached in both: no gradient reaches the velocity / mean through D
    assert draft_grads[1] is None and new.grad is None


def test_dppo_arguments_are_validated_with_the_field_named():
    config = REPO / "examples/dppo/full/sd3_tiny/default.yaml"
    assert load(config).train.kl_mask_threshold == 1e-6
    with pytest.raises(ConfigError, match=r"train\.clip_range: unknown field"):
        load(config, "train.clip_range=0.2")
    with pytest.raises(ConfigError, match=r"train\.kl_mask_threshold: must be > 0"):
        load(config, "train.kl_mask_threshold=0")
    with pytest.raises(ConfigError, match=r"train\.kl_mask_type"):
        load(config, "train.kl_mask_type=z-based")


# --- the trainer -----------------------------------------------------------------------------------

CONFIG = "examples/dppo/full/sd3_tiny/default.yaml"
OVERRIDES = ["train.kl_beta=0.001"]
STEPS = 30


@pytest.fixture(scope="module")
def learning_run(tmp_path_factory):
    """30 steps (15 rollout iterations × 2 minibatches) of the example config with a KL reference."""
    return trainer_utils.learning_run("dppo", tmp_path_factory.mktemp("dppo"), STEPS, *OVERRIDES)


@pytest.mark.integration
def test_dppo_raises_reward_and_keeps_frozen_roles(learning_run, capsys):
    """The fixed-noise mean brightness reward rises; the VAE, text encoder and reference snapshot are
    bit-identical; every policy parameter that can get a gradient changed. The first minibatch of each
    iteration is at the rollout policy (D = 0, nothing masked); the mask acts on the second."""
    run = learning_run
    trainer, before, after = run["trainer"], run["before"], run["after"]
    with capsys.disabled():
        print(
            f"\nFlow-DPPO tiny SD3, {STEPS} steps: fixed-noise mean brightness reward {before:.4f} -> {after:.4f}"
        )
    assert after > before + 0.03
    records = metrics(run["out"])
    assert [r["optimizer_step"] for r in records] == list(range(1, STEPS + 1))
    assert all(r["kl_new_old"] < 1e-9 and r["keep_frac"] == 1.0 for r in records[0::2])
    assert all(r["kl_new_old"] > 1e-6 for r in records[1::2])
    assert 0 < min(r["keep_frac"] for r in records[1::2]) < 1
    assert records[0]["kl"] == 0.0 and records[-1]["kl"] > 0.0
    assert_bit_identical(run["frozen"], frozen_state(trainer))
    policy = trainer.variants.variant("policy")
    assert_every_parameter_changed(trainer, run["initial"]["policy"], policy, "policy")


@pytest.mark.integration
def test_rollout_velocities_reproduce_the_stored_log_probs(learning_run):
    """v_old is the sampler's stored velocity: the recomputed rollout step gives the stored log p_old."""
    assert_rollout_velocities_replay(learning_run["trainer"])


@pytest.mark.numeric
@pytest.mark.integration
def test_dppo_goldens(learning_run):
    check_golden("dppo", metrics(learning_run["out"]), config=CONFIG, overrides=OVERRIDES)


@pytest.mark.integration
def test_two_identical_dumped_runs_compare_ok(tmp_path):
    """The v-based mask (the learning run covers the x-based one), dumped twice: ``ok``."""
    from helpers.trainer.dump_utils import dumped_runs_compare

    result = dumped_runs_compare(tmp_path, REPO / CONFIG, "train.kl_mask_type=v-based")
    keys = {stage["key"] for stage in result["stages"]}
    assert result["verdict"] == "ok" and result["first_divergence"] is None
    expected = {
        "rollout.latents",
        "rollout.log_prob",
        "rollout.velocity",
        "reward",
        "advantage",
        "train.velocity",
        "train.velocity_old",
        "train.log_ratio",
        "train.kl_new_old",
        "train.keep",
        "loss.policy",
        "grad_norm.policy",
    }
    assert expected <= keys, sorted(expected - keys)
    assert any(key.startswith("L000.") for key in keys), "block forwards were not dumped"
