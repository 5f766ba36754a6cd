"""Training-order bisect on hand-built trainer stages (`ffdebug.bisection.training.locate`): the
exact-prefix signal without a noise run, the noise run's judgement with one."""

from __future__ import annotations

from ffdebug.bisection.engine import break_in_exact_prefix
from ffdebug.bisection.training import locate
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
