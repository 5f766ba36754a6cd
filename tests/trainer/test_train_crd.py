"""CRD: the implicit reward, the centring modes, the scale and the reward-adaptive KL against hand values
and Flow-Factory's lines; the arguments are validated with the field named; it learns on the tiny SD3
model (frozen components and the reference bit-identical, the policy and the old snapshot changed), its
first steps match the goldens, two identical dumped runs compare ``ok``, and two ranks give the one-rank
numbers (the centring gathers every rank's samples)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.trainer import trainer_utils
from helpers.trainer.golden_utils import check_golden
from helpers.trainer.trainer_utils import (
    REPO,
    assert_every_parameter_changed,
    assert_frozen_except_followers,
    assert_rank_layout_matches,
    frozen_state,
    load,
    metrics,
)

from reference_trainer.errors import ConfigError
from reference_trainer.losses.crd import (
    compute_decay,
    crd_kl,
    crd_loss,
    implicit_reward,
    normalised_advantage,
    parse_decay,
)

# --- the loss --------------------------------------------------------------------------------------


def test_crd_hand_values():
    """Two samples, one dim, no adaptive weights: v* = 0, v_old = [1, 1], v_θ = [0, 2]:
    r_θ = −(v_θ² − v_old²) = [1, −3]. A = [5, −5] -> a = [1, 0]. Uniform centring: mean a = ½,
    mean r = −1: R^c = [½, −½], R^c_θ = [2, −2]; β = 1: ℓ = mean((2 − ½)², (−2 + ½)²) = 2.25;
    L = ℓ·A_max/β = 11.25; ∂L/∂r_θ = 5·2·(β R^c_θ − R^c)/2 = [7.5, −7.5] (the mean of r_θ is detached).
    Reward-adaptive KL with β_KL = 0.1: c = 1e-3, kl = [1, 1]: 0.1·mean(1·1, 1e-3·1) = 0.05005."""
    v = torch.tensor([[0.0], [2.0]], requires_grad=True)
    r = implicit_reward(v, torch.ones(2, 1), torch.zeros(2, 1), adaptive=False)
    torch.testing.assert_close(r.detach(), torch.tensor([1.0, -3.0]))
    a = normalised_advantage(torch.tensor([5.0, -5.0]), 5.0)
    assert a.tolist() == [1.0, 0.0]
    loss, ori = crd_loss(r, r.detach(), a, a, beta=1.0, adv_clip_max=5.0)
    assert ori.item() == pytest.approx(2.25) and loss.item() == pytest.approx(11.25)
    (grad_r,) = torch.autograd.grad(loss, r, retain_graph=True)
    torch.testing.assert_close(grad_r, torch.tensor([7.5, -7.5]))
    kl_loss, kl = crd_kl(v.detach() + torch.tensor([[1.0], [-1.0]]), v.detach(), a, kl_beta=0.1)
    assert kl.item() == 1.0 and kl_loss.item() == pytest.approx(0.1 * (1 + 1e-3) / 2)


def test_crd_decay_schedule():
    """Flow-Factory's defaults: old "0-0.25-0.005-0.999" -> 0.25 at 0, 0.3 at 10, 0.999 from 150 on;
    sampling "75-0.0-0.0075-0.999" -> 0 before 75, 0.075 at 85."""
    old, sampling = parse_decay("0-0.25-0.005-0.999"), parse_decay("75-0.0-0.0075-0.999")
    assert compute_decay(0, *old) == 0.25 and compute_decay(10, *old) == pytest.approx(0.3)
    assert compute_decay(150, *old) == 0.999 and compute_decay(1000, *old) == 0.999
    assert compute_decay(74, *sampling) == 0.0 and compute_decay(85, *sampling) == pytest.approx(0.075)


def _flow_factory_crd(
    adv_cur, adv_cur_rank, r_theta_gathered, r_theta_local, weight_temp, crd_loss_type, crd_beta
):
    """X-GenGroup/Flow-Factory ``src/flow_factory/trainers/crd.py`` @ 396dd6e28a6f1a43d3767c950b79976e89f1a072,
    ``CRDTrainer._compute_crd_loss``, re-stated (``self.`` attributes as arguments)."""
    weight_temp = torch.inf if weight_temp < 0 else weight_temp
    if weight_temp == torch.inf:
        softmax_p = torch.softmax(adv_cur / weight_temp, dim=0)
        adv_cur_avg = (adv_cur * softmax_p).sum(dim=0, keepdim=True)
        r_theta_avg = (r_theta_gathered * softmax_p).sum(dim=0, keepdim=True)
        Rc = adv_cur_rank - adv_cur_avg
        R_theta_c = r_theta_local - r_theta_avg.detach()
        if crd_loss_type == "bce":
            return F.binary_cross_entropy_with_logits(
                crd_beta * R_theta_c, torch.sigmoid(Rc.detach()), reduction="mean"
            )
        return ((crd_beta * R_theta_c - Rc) ** 2).mean()
    if weight_temp == 0:
        # Flow-Factory: ``adv_cur > 0.0`` / ``adv_cur < 0.0`` on adv_cur ∈ [0, 1]; ours splits at ½, the
        # advantage's sign (``losses.crd.group_weights``; test_loop_fidelity.py pins the departure)
        adv_plus_mask = adv_cur > 0.5
        if adv_plus_mask.sum() == 0:
            softmax_p = torch.ones_like(adv_cur) / adv_cur.shape[0]
        else:
            softmax_p = torch.softmax(adv_cur.where(adv_plus_mask, torch.tensor(float("-inf"))), dim=0)
        adv_minus_mask = adv_cur < 0.5
        if adv_minus_mask.sum() == 0:
            softmax_p_minus = torch.ones_like(adv_cur) / adv_cur.shape[0]
        else:
            softmax_p_minus = torch.softmax(adv_cur.where(adv_minus_mask, torch.tensor(float("-inf"))), dim=0)
    else:
        softmax_p = torch.softmax(adv_cur / weight_temp, dim=0)
        softmax_p_minus = torch.softmax(-adv_cur / weight_temp, dim=0)
    adv_cur_avg = (adv_cur * softmax_p).sum(dim=0, keepdim=True)
    r_theta_avg = (r_theta_gathered * softmax_p).sum(dim=0, keepdim=True)
    Rc = adv_cur_rank - adv_cur_avg
    R_theta_c = r_theta_local - r_theta_avg.detach()
    adv_cur_avg_minus = (adv_cur * softmax_p_minus).sum(dim=0, keepdim=True)
    r_theta_avg_minus = (r_theta_gathered * softmax_p_minus).sum(dim=0, keepdim=True)
    Rc_minus = adv_cur_rank - adv_cur_avg_minus
    R_theta_c_minus = r_theta_local - r_theta_avg_minus.detach()
    if crd_loss_type == "bce":
        return 0.5 * F.binary_cross_entropy_with_logits(
            crd_beta * R_theta_c, torch.sigmoid(Rc.detach()), reduction="mean"
        ) + 0.5 * F.binary_cross_entropy_with_logits(
            crd_beta * R_theta_c_minus, torch.sigmoid(Rc_minus.detach()), reduction="mean"
        )
    diff = crd_beta * R_theta_c - Rc
    diff_minus = crd_beta * R_theta_c_minus - Rc_minus
    return 0.5 * (diff**2).mean() + 0.5 * (diff_minus**2).mean()


@pytest.mark.parametrize(
    ("weight_temp", "loss_type", "adaptive", "reward_adaptive_kl"),
    [
        (-1.0, "mse", True, True),
        (0.0, "mse", True, False),
        (0.5, "bce", False, True),
        (0.0, "bce", True, True),
    ],
)
def test_transcription_of_flow_factory_crd(weight_temp, loss_type, adaptive, reward_adaptive_kl):
    """The same inputs through Flow-Factory ``src/flow_factory/trainers/crd.py`` @ 396dd6e2:
    ``_compute_crd_loss`` (re-stated above) and ``optimize`` steps 4-7 (the adaptive weights, r_theta, the
    advantage normalisation with ``adv_clip_range`` (−5, 5), the ``adv_clip_range[1] / crd_beta`` scale,
    the KL with and without ``reward_adaptive_kl``): equal loss and equal gradient w.r.t. v_θ."""
    g = torch.Generator().manual_seed(11)
    B, shape = 8, (4, 4, 4)
    crd_beta, kl_beta, adv_clip_range = 0.7, 0.1, (-5.0, 5.0)
    v_target = torch.randn(B, *shape, generator=g)
    old_v_pred = v_target + 0.5 * torch.randn(B, *shape, generator=g)
    ref_pred = v_target + 0.5 * torch.randn(B, *shape, generator=g)
    leaf = (old_v_pred + 0.1 * torch.randn(B, *shape, generator=g)).requires_grad_()
    adv = torch.tensor([1.5, -0.5, 6.0, -7.0, 0.0, 2.0, -1.0, 0.5])

    # --- Flow-Factory (re-stated, one process: gather = identity) ---
    forward_pred = leaf
    if adaptive:
        with torch.no_grad():
            weight_theta = torch.abs(forward_pred.double() - v_target.double()).mean(
                dim=tuple(range(1, forward_pred.ndim)), keepdim=True).clip(min=1e-5)  # fmt: skip
            weight_old = torch.abs(old_v_pred.double() - v_target.double()).mean(
                dim=tuple(range(1, old_v_pred.ndim)), keepdim=True).clip(min=1e-5)  # fmt: skip
        r_theta = -((forward_pred - v_target) ** 2 / weight_theta - (old_v_pred - v_target) ** 2 / weight_old)
    else:
        r_theta = -((forward_pred - v_target) ** 2 - (old_v_pred - v_target) ** 2)
    r_theta_local = r_theta.mean(dim=tuple(range(1, r_theta.ndim)))
    adv_clipped = torch.clamp(adv, adv_clip_range[0], adv_clip_range[1])
    adv_cur_rank = torch.clamp((adv_clipped / max(adv_clip_range)) / 2.0 + 0.5, 0, 1)
    ori_policy_loss = _flow_factory_crd(
        adv_cur_rank, adv_cur_rank, r_theta_local.detach(), r_theta_local, weight_temp, loss_type, crd_beta
    )
    policy_loss = (ori_policy_loss * adv_clip_range[1] / max(crd_beta, 1e-8)).mean()
    kl_div = ((forward_pred - ref_pred) ** 2).mean(dim=tuple(range(1, forward_pred.ndim)))
    if reward_adaptive_kl:
        min_coef = 1e-4 / max(kl_beta, 1e-8)
        kl_loss = kl_beta * torch.mean((min_coef + adv_cur_rank * (1 - min_coef)) * kl_div)
    else:
        kl_loss = kl_beta * kl_div.mean()
    reference_loss = policy_loss + kl_loss
    (reference_grad,) = torch.autograd.grad(reference_loss, leaf)

    # --- ours ---
    v = leaf.detach().clone().requires_grad_()
    r = implicit_reward(v, old_v_pred, v_target, adaptive=adaptive)
    a = normalised_advantage(adv, 5.0)
    ours, _ = crd_loss(
        r, r.detach(), a, a, beta=crd_beta, adv_clip_max=5.0, weight_temp=weight_temp, loss_type=loss_type
    )
    kl, _ = crd_kl(v, ref_pred, a, kl_beta=kl_beta, reward_adaptive=reward_adaptive_kl)
    (ours + kl).backward()
    assert (ours + kl).dtype == reference_loss.dtype
    torch.testing.assert_close((ours + kl).detach(), reference_loss.detach(), rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(v.grad, reference_grad, rtol=1e-5, atol=1e-9)


def test_crd_arguments_are_validated_with_the_field_named():
    config = REPO / "examples/crd/full/sd3_tiny/default.yaml"
    assert load(config).train.kl_cfg == 4.5
    with pytest.raises(ConfigError, match=r"train\.old_model_decay"):
        load(config, "train.old_model_decay=slow")
    with pytest.raises(ConfigError, match=r"train\.crd_loss_type"):
        load(config, "train.crd_loss_type=hinge")
    with pytest.raises(ConfigError, match=r"train\.crd_beta: must be > 0"):
        load(config, "train.crd_beta=0")


# --- the trainer -----------------------------------------------------------------------------------

CONFIG = "examples/crd/full/sd3_tiny/default.yaml"
OVERRIDES: list[str] = []
STEPS = 30


@pytest.fixture(scope="module")
def learning_run(tmp_path_factory):
    """30 steps (15 rollout iterations × 2 minibatches) of the example config."""
    return trainer_utils.learning_run("crd", tmp_path_factory.mktemp("crd"), STEPS, *OVERRIDES)


@pytest.mark.integration
def test_crd_raises_reward_and_keeps_frozen_roles(learning_run, capsys):
    """The reward rises; the VAE, text encoder and reference are bit-identical; the policy and the old and
    sampling snapshots changed (the sampling decay is 0 before step 75: a copy of the policy)."""
    run = learning_run
    trainer, before, after = run["trainer"], run["before"], run["after"]
    with capsys.disabled():
        print(
            f"\nCRD tiny SD3, {STEPS} steps: fixed-noise mean brightness reward {before:.4f} -> {after:.4f}"
        )
    assert after > before + 0.02
    records = metrics(run["out"])
    assert [r["optimizer_step"] for r in records] == list(range(1, STEPS + 1))
    assert records[0]["old_deviate"] == 0.0 and records[-1]["kl"] > 0.0
    following = ("snapshot.old.", "snapshot.sampling.")
    assert_frozen_except_followers(run["frozen"], frozen_state(trainer), following)
    policy = trainer.variants.variant("policy")
    assert_every_parameter_changed(trainer, run["initial"]["policy"], policy, "policy")


@pytest.mark.numeric
@pytest.mark.integration
def test_crd_goldens(learning_run):
    check_golden("crd", metrics(learning_run["out"]), config=CONFIG, overrides=OVERRIDES)


@pytest.mark.integration
def test_two_identical_dumped_runs_compare_ok(tmp_path):
    """The dual-direction softmax centring with the BCE form, dumped twice: ``ok``."""
    from helpers.trainer.dump_utils import dumped_runs_compare

    result = dumped_runs_compare(tmp_path, REPO / CONFIG, "train.weight_temp=0.5", "train.crd_loss_type=bce")
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
        "train.implicit_reward",
        "train.velocity_ref",
        "loss.policy",
        "grad_norm.policy",
    }
    assert expected <= keys, sorted(expected - keys)


@pytest.mark.integration
def test_two_ranks_center_over_every_rank_as_one_rank(tmp_path):
    """torchrun, two CPU ranks, one prompt per rank: each minibatch of 4 samples is split 2 + 2, and the
    centring means need the other rank's a and r_θ. Its metrics equal a one-process run with the same
    global batch (every float within 1e-7 + 1e-5·|value|)."""
    from test_distributed import torchrun

    from reference_trainer.run import train

    n, common = 3, ["checkpoint.every=0", "eval.every=0"]
    torchrun("straight", str(tmp_path / "two"), "crd", str(n), "train.prompts_per_iteration=1", *common)
    torch.set_num_threads(1)
    train(load(REPO / CONFIG, *common, max_steps=n), tmp_path / "one")
    single, double = metrics(tmp_path / "one"), metrics(tmp_path / "two" / "straight")
    assert len(single) == len(double) == n
    assert_rank_layout_matches(single, double)
