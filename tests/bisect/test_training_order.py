"""Training-order bisect on hand-built trainer stages (`ffdebug.bisection.training.locate`): the
exact-prefix signal without a noise run, the noise run's judgement with one."""

from __future__ import annotations

from ffdebug.bisection.engine import break_in_exact_prefix
from ffdebug.bisection.training import locate, training_order
from ffdebug.results import StageResult, TensorMeta
from ffdebug.verdict import Severity, exact_prefix_end


def _stage(key, phase, rel, severity=Severity.OK, noise_rel=None, noise=False, step=1):
    meta = TensorMeta("torch.float32", [4])
    return StageResult(
        key=key, layer=None, layer_class=None, stage=key, io="out", call=None, invocation=0, rank=0,
        step={"optimizer_step": step, "phase": phase}, phase=phase, ref=meta, target=meta,
        cos=1.0, rel=rel, bit_equal=1.0 if rel == 0.0 else 0.0, severity=severity,
        noise_given=noise, noise_rel=noise_rel,
    )  # fmt: skip


def test_a_drift_right_after_bit_equal_stages_is_the_exact_prefix_signal():
    stages = [
        _stage("update.policy", "train", 0.5, Severity.BUG),  # captured first, trained last
        _stage("grad.policy.blocks.0", "train", 0.04, Severity.DRIFT),
        _stage("loss.policy", "train", 0.0),
        _stage("reward", "rollout", 0.0),
    ]
    located = locate(stages)
    assert located.stage.key == "grad.policy.blocks.0" and located.exact_signal
    assert located.per_role["policy"].key == "grad.policy.blocks.0"


def test_with_a_noise_run_rounding_it_shares_is_no_signal():
    """Every stage differs a little, within the noise run's error: nothing located. A stage raised
    beyond noise (compare's rule: at least diverge) is the divergence, not the first rounding."""
    shared = [
        _stage("reward", "rollout", 3e-6, noise_rel=3e-6, noise=True),
        _stage("loss.policy", "train", 1e-6, noise_rel=1e-6, noise=True),
        _stage("grad_norm.policy", "train", 4e-7, noise_rel=3e-7, noise=True),
    ]
    assert locate(shared) is None
    beyond = _stage("grad.policy.blocks.0", "train", 0.04, Severity.DIVERGE, noise_rel=7e-6, noise=True)
    beyond.beyond_noise = True
    located = locate([*shared, beyond])
    assert located.stage is beyond and not located.exact_signal
    assert "x the noise run's" in located.sentence()


def test_a_dtype_change_inside_the_prefix_ends_it_without_a_signal():
    """The exact-prefix rule is "exactly equal stages in the same dtype" (`verdict.exact_prefix_end`)
    in training order as in bisect's execution order: a bit-equal stage whose sides differ in dtype
    ends the prefix, so the rounding-size difference after it is no signal; with the same dtype it is."""
    cast = _stage("reward", "rollout", 0.0)
    cast.target = TensorMeta("torch.bfloat16", [4])
    stages = [cast, _stage("loss.policy", "train", 1e-5)]  # above rounding (16 fp32 eps)
    assert exact_prefix_end(stages) is None and break_in_exact_prefix(stages) is None
    assert locate(stages) is None
    stages[0] = _stage("reward", "rollout", 0.0)
    located = locate(stages)
    assert located.stage is stages[1] and located.exact_signal
    assert exact_prefix_end(stages) is break_in_exact_prefix(stages) is stages[1]


def test_a_noise_run_not_comparable_at_the_break_leaves_it_to_the_exact_prefix_rule():
    """A noise run was given but has no error at the first stage that is not bit-equal (noise_rel
    None: compare judged it as without a noise run), so the exact-prefix rule decides there; where
    the noise run was measured and the stage is within it, there is no signal."""
    loss = _stage("loss.policy", "train", 0.0, noise_rel=0.0, noise=True)
    unmeasured = _stage("grad.policy.blocks.0", "train", 1e-5, noise=True)
    located = locate([loss, unmeasured])
    assert located is not None and located.stage is unmeasured and located.exact_signal
    measured = _stage("grad.policy.blocks.0", "train", 1e-5, noise_rel=1e-5, noise=True)
    assert locate([loss, measured]) is None


def test_the_exact_prefix_break_wins_over_a_later_step_outside_the_ok_band():
    """A KL gradient lost at step 1 is a 0.19% gradient-norm change after exactly equal stages; by
    step 2 it has grown into a drift. The break is the divergence, the later drift only follows."""
    stages = [
        _stage("loss.policy", "train", 0.0, step=1),
        _stage("grad_norm.policy", "train", 1.9e-3, step=1),  # inside the ok band, above rounding
        _stage("train.kl", "train", 0.05, Severity.DRIFT, step=2),
    ]
    located = locate(stages)
    assert (located.stage.key, located.stage.step["optimizer_step"], located.exact_signal) == (
        "grad_norm.policy",
        1,
        True,
    )


def test_a_frozen_role_that_gains_a_gradient_is_named_with_its_update():
    """At one step the policy's norm (over every parameter, the reference's included) and the
    reference's norm (all zeros in the reference run) differ: the role that gained a gradient is
    named, as the gradient of its update."""
    policy = _stage("grad_norm.policy", "train", 0.4, Severity.BUG, step=0)
    frozen = _stage("grad_norm.reference", "train", None, Severity.SCRAMBLE, step=0)
    frozen.cos, frozen.norm_ratio, frozen.max_abs = 0.0, None, 3.0  # the reference run's is exactly 0
    located = locate([_stage("loss.policy", "train", 0.0, step=0), policy, frozen])
    assert located.stage is frozen
    assert (
        "grad_norm.reference (" in located.sentence()
        and "the gradient of update.reference" in located.sentence()
    )


def test_stages_follow_capture_order_within_a_step_and_untagged_ones_where_captured():
    """A tap made after a forward (a larger capture sequence number) comes after the forward's
    stages whatever order compare listed them in; an evaluation tagged only with its phase is placed
    after the stage captured before it, not before step 0."""
    velocity = _stage("train.velocity", "train", 0.2, Severity.BUG, step=0)
    latents = _stage("embed.latents", "train", 0.3, Severity.BUG, step=0)
    velocity.seq, latents.seq = 9, 5
    update = _stage("update.policy", "train", 0.0, step=0)
    update.seq = 12
    evaluation = _stage("eval.reward", "eval", 0.5, Severity.BUG)
    evaluation.step, evaluation.seq = {"phase": "eval"}, 13
    step1 = _stage("loss.policy", "train", 0.0, step=1)
    step1.seq = 20
    ordered = training_order([evaluation, velocity, step1, latents, update])
    assert [e.key for e in ordered] == [
        "embed.latents",
        "train.velocity",
        "update.policy",
        "eval.reward",
        "loss.policy",
    ]
    assert locate([velocity, latents]).stage is latents
