"""DiffusionNFT: the loss against hand values and NVlabs' lines; the arguments are validated with the
field named; it learns on the tiny SD3 model (frozen components and the reference bit-identical, the
policy and its old / EMA snapshots changed), its first steps match the goldens, and two identical dumped
runs compare ``ok``."""

from __future__ import annotations

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
from reference_trainer.losses.nft import nft_loss, old_decay

# --- the loss --------------------------------------------------------------------------------------


def test_nft_loss_and_gradient_hand_values():
    """One sample, two dims, β = 1, σ = ½, x_t = [1, 1], x_0 = 0, v_θ = [2, 0], v_old = 0, A = 2.5, A_max = 5:

        r  = 2.5/5/2 + ½ = 0.75
        v⁺ = v_θ = [2, 0]:            x̂⁺ = [0, 1],  w⁺ = ½,   mean(x̂⁺²)/w⁺ = ½/½ = 1
        v⁻ = 2v_old − v_θ = [−2, 0]:  x̂⁻ = [2, 1],  w⁻ = 3/2, mean(x̂⁻²)/w⁻ = (5/2)/(3/2) = 5/3
        L  = 5·(0.75·1 + 0.25·5/3) = 35/6
        ∂L/∂v_θ = 5·(0.75·(−σ·x̂⁺/w⁺) + 0.25·(+σ·x̂⁻/w⁻))/2·2 = 5·([0, −¾] + [⅙, 1/12]) = [5/6, −10/3]
    (the weights w carry no gradient)."""
    v = torch.tensor([[2.0, 0.0]], requires_grad=True)
    loss, stats = nft_loss(
        v,
        torch.zeros(1, 2),
        torch.ones(1, 2),
        torch.zeros(1, 2),
        torch.tensor([0.5]),
        torch.tensor([2.5]),
        beta=1.0,
        adv_clip_max=5.0,
    )
    assert loss.item() == pytest.approx(35 / 6, rel=1e-6)
    loss.backward()
    torch.testing.assert_close(v.grad, torch.tensor([[5 / 6, -10 / 3]]))
    assert stats["old_deviate"] == pytest.approx(2.0)


def test_nft_advantage_normalisation_and_kl():
    """A = ±10 clips to ±A_max: r = 1 keeps only the positive branch, r = 0 only the negative one; with
    v_θ = v_old both branches are the plain x̂_0 error. KL = β_KL·mean(v_θ − v_ref)² = 1e-2·mean(1, 1)."""
    x_t, x0 = torch.tensor([[1.0, 3.0]]).repeat(2, 1), torch.zeros(2, 2)
    v = torch.ones(2, 2)
    loss, stats = nft_loss(
        v, v, x_t, x0, torch.tensor([0.5, 0.5]), torch.tensor([10.0, -10.0]),
        beta=0.5, adv_clip_max=5.0, kl_beta=1e-2, ref_velocity=torch.zeros(2, 2),
    )  # fmt: skip
    # x̂ = x_t − ½·1 = [½, 5/2]: mean(x̂²)/mean|x̂| = (13/4)/(3/2) = 13/6, over β = ½, times A_max 5
    assert stats["policy_loss"] == pytest.approx(5 * (13 / 6) / 0.5, rel=1e-6)
    assert stats["kl"] == pytest.approx(1.0) and loss.item() == pytest.approx(stats["policy_loss"] + 1e-2)


def return_decay(step, decay_type):
    """NVlabs/DiffusionNFT ``scripts/train_nft_sd3.py`` ``return_decay`` (pkuhxy fork @ 619456aa, lines
    172-192), re-stated."""
    flat, uprate, uphold = {0: (0, 0.0, 0.0), 1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}[decay_type]
    if step < flat:
        return 0.0
    decay = (step - flat) * uprate
    return min(decay, uphold)


@pytest.mark.parametrize("decay_type", [0, 1, 2])
def test_transcription_of_nvlabs_return_decay(decay_type):
    params = {0: (0, 0.0, 0.0), 1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}[decay_type]
    for step in (0, 1, 10, 74, 75, 76, 200, 499, 500, 1000):
        assert old_decay(step, *params) == return_decay(step, decay_type)


@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_transcription_of_nvlabs_nft_loss(beta):
    """The same inputs through a re-statement of NVlabs/DiffusionNFT ``scripts/train_nft_sd3.py`` (read in
    the fork pkuhxy/DiffusionNFT @ 619456aabc96a9203baa525d6bcb24f0f4560117, lines 911-973: advantage
    clip, ``normalized_advantages_clip``, ``positive_prediction`` / ``implicit_negative_prediction``, the
    adaptive ``weight_factor`` (fp64, no grad), ``ori_policy_loss``, ``policy_loss``, ``kl_div_loss``):
    equal loss and equal gradient with respect to the policy velocity."""
    g = torch.Generator().manual_seed(3)
    batch, shape = 6, (4, 4, 4)
    adv_clip_max, train_beta = 5.0, 1e-3
    x0 = torch.randn(batch, *shape, generator=g)
    noise = torch.randn(batch, *shape, generator=g)
    t = torch.rand(batch, generator=g) * 0.9 + 0.05
    advantages = torch.tensor([1.5, -0.5, 6.0, -7.0, 0.0, 2.0])
    old_prediction = torch.randn(batch, *shape, generator=g)
    ref_forward_prediction = torch.randn(batch, *shape, generator=g)
    leaf = (old_prediction + 0.1 * torch.randn(batch, *shape, generator=g)).requires_grad_()

    # --- NVlabs (re-stated) ---
    forward_prediction = leaf
    t_expanded = t.view(-1, *([1] * (len(x0.shape) - 1)))
    xt = (1 - t_expanded) * x0 + t_expanded * noise
    advantages_clip = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    normalized_advantages_clip = (advantages_clip / adv_clip_max) / 2.0 + 0.5
    r = torch.clamp(normalized_advantages_clip, 0, 1)
    positive_prediction = beta * forward_prediction + (1 - beta) * old_prediction.detach()
    implicit_negative_prediction = (1.0 + beta) * old_prediction.detach() - beta * forward_prediction
    x0_prediction = xt - t_expanded * positive_prediction
    with torch.no_grad():
        weight_factor = (
            torch.abs(x0_prediction.double() - x0.double())
            .mean(dim=tuple(range(1, x0.ndim)), keepdim=True)
            .clip(min=0.00001)
        )
    positive_loss = ((x0_prediction - x0) ** 2 / weight_factor).mean(dim=tuple(range(1, x0.ndim)))
    negative_x0_prediction = xt - t_expanded * implicit_negative_prediction
    with torch.no_grad():
        negative_weight_factor = (
            torch.abs(negative_x0_prediction.double() - x0.double())
            .mean(dim=tuple(range(1, x0.ndim)), keepdim=True)
            .clip(min=0.00001)
        )
    negative_loss = ((negative_x0_prediction - x0) ** 2 / negative_weight_factor).mean(
        dim=tuple(range(1, x0.ndim))
    )
    ori_policy_loss = r * positive_loss / beta + (1.0 - r) * negative_loss / beta
    policy_loss = (ori_policy_loss * adv_clip_max).mean()
    kl_div_loss = ((forward_prediction - ref_forward_prediction) ** 2).mean(dim=tuple(range(1, x0.ndim)))
    reference_loss = policy_loss + train_beta * torch.mean(kl_div_loss)
    (reference_grad,) = torch.autograd.grad(reference_loss, leaf)

    # --- ours ---
    v = leaf.detach().clone().requires_grad_()
    loss, _ = nft_loss(
        v, old_prediction, xt, x0, t, advantages, beta=beta, adv_clip_max=adv_clip_max,
        kl_beta=train_beta, ref_velocity=ref_forward_prediction,
    )  # fmt: skip
    loss.backward()
    assert reference_loss.dtype == loss.dtype
    torch.testing.assert_close(loss.detach(), reference_loss.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(v.grad, reference_grad, rtol=1e-5, atol=1e-8)


def test_nft_arguments_are_validated_with_the_field_named():
    config = REPO / "examples/nft/full/sd3_tiny/default.yaml"
    assert load(config).train.nft_beta == 1.0
    with pytest.raises(ConfigError, match=r"train\.nft_beta: must be > 0"):
        load(config, "train.nft_beta=0")
    with pytest.raises(ConfigError, match=r"train\.old_decay_max"):
        load(config, "train.old_decay_max=1.0")
    with pytest.raises(ConfigError, match=r"train\.clip_range: unknown field"):
        load(config, "train.clip_range=0.2")


# --- the trainer -----------------------------------------------------------------------------------

CONFIG = "examples/nft/full/sd3_tiny/default.yaml"
OVERRIDES = ["train.kl_beta=0.001"]
STEPS = 30


@pytest.fixture(scope="module")
def learning_run(tmp_path_factory):
    """30 steps (15 rollout iterations × 2 minibatches) of the example config with a KL reference."""
    return trainer_utils.learning_run("nft", tmp_path_factory.mktemp("nft"), STEPS, *OVERRIDES)


@pytest.mark.integration
def test_nft_raises_reward_and_keeps_frozen_roles(learning_run, capsys):
    """The fixed-noise mean brightness reward rises; the VAE, text encoder and reference snapshot are
    bit-identical; every policy parameter that can get a gradient changed, and so did the old and EMA
    snapshots (they follow the policy)."""
    run = learning_run
    trainer, before, after = run["trainer"], run["before"], run["after"]
    with capsys.disabled():
        print(
            f"\nDiffusionNFT tiny SD3, {STEPS} steps: fixed-noise mean brightness reward {before:.4f} -> {after:.4f}"
        )
    assert after > before + 0.02
    records = metrics(run["out"])
    assert [r["optimizer_step"] for r in records] == list(range(1, STEPS + 1))
    assert records[0]["kl"] == 0.0 and records[-1]["kl"] > 0.0
    following = ("snapshot.old.", "snapshot.ema.")
    assert_frozen_except_followers(run["frozen"], frozen_state(trainer), following)
    policy = trainer.variants.variant("policy")
    assert_every_parameter_changed(trainer, run["initial"]["policy"], policy, "policy")


@pytest.mark.numeric
@pytest.mark.integration
def test_nft_goldens(learning_run):
    check_golden("nft", metrics(learning_run["out"]), config=CONFIG, overrides=OVERRIDES)


@pytest.mark.integration
def test_two_identical_dumped_runs_compare_ok(tmp_path):
    from helpers.trainer.dump_utils import dumped_runs_compare

    result = dumped_runs_compare(tmp_path, REPO / CONFIG, *OVERRIDES)
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
        "train.velocity",
        "train.velocity_old",
        "loss.policy",
        "grad_norm.policy",
    }
    assert expected <= keys, sorted(expected - keys)
    assert any(key.startswith("L000.") for key in keys), "block forwards were not dumped"
