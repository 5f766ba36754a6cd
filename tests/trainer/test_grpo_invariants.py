"""Flow-GRPO invariants on the tiny SD3 model, measured in the trainer itself (one optimizer step each):

* ``timestep_fraction`` trains ``int(fraction·T)`` steps, flow_grpo's count (``trainers/grpo.py``);
* the first minibatch of a rollout iteration is on-policy: its PPO ratio is 1 up to the last bits of a
  recomputed fp32 log-prob;
* gradient accumulation: microbatches of 1, 2 and the whole minibatch give the same gradient.

Example config ``examples/grpo/full/sd3_tiny/default.yaml``: B = 8 samples, T = 4 steps, one minibatch
per iteration.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.trainer.trainer_utils import GRPO_CONFIG, load, metrics

from reference_trainer.errors import ConfigError

pytestmark = [
    pytest.mark.integration,
    pytest.mark.numeric,
]  # every test here spawns a process, runs a trainer or kills one


def one_step(out, *overrides: str, monkeypatch) -> dict:
    """Build and run one GRPO optimizer step; record what each ``grpo_loss`` call saw (the step j, the
    log-ratio log p_θ − log p_old and log p_old per sample) and the policy's pre-clip gradient at the optimizer step."""
    from reference_trainer.losses import grpo as grpo_losses
    from reference_trainer.optim import RoleOptimizer
    from reference_trainer.run import build_trainer
    from reference_trainer.trainers.grpo import GRPOTrainer

    calls: list[tuple[int, torch.Tensor]] = []
    grads: list[torch.Tensor] = []
    loss_fn, finish, step_loss = grpo_losses.grpo_loss, RoleOptimizer._finish, GRPOTrainer.step_loss

    def recording_step_loss(self, samples, index, j):
        calls.append((j, None, None))
        return step_loss(self, samples, index, j)

    def recording_loss(log_prob, old_log_prob, *args, **kwargs):
        calls[-1] = (
            calls[-1][0],
            (log_prob - old_log_prob).detach().double(),
            old_log_prob.detach().double(),
        )
        return loss_fn(log_prob, old_log_prob, *args, **kwargs)

    def recording_finish(self, phase):
        grads.append(
            torch.cat([p.grad.reshape(-1).double() for p in self.roles[phase.role] if p.grad is not None])
        )
        return finish(self, phase)

    monkeypatch.setattr(grpo_losses, "grpo_loss", recording_loss)
    monkeypatch.setattr(GRPOTrainer, "step_loss", recording_step_loss)
    monkeypatch.setattr(RoleOptimizer, "_finish", recording_finish)
    trainer = build_trainer(load(GRPO_CONFIG, *overrides, max_steps=1), out)
    trainer.start()
    monkeypatch.undo()
    (record,) = metrics(out)
    return dict(calls=calls, grad=grads[0], record=record)


@pytest.fixture(scope="module")
def microbatch_runs(tmp_path_factory):
    """One optimizer step for microbatch_size 1, 2 and 0 (the whole minibatch of 8)."""
    runs = {}
    with pytest.MonkeyPatch.context() as monkeypatch:
        for size in (1, 2, 0):
            out = tmp_path_factory.mktemp(f"grpo-microbatch-{size}")
            runs[size] = one_step(out, f"train.microbatch_size={size}", monkeypatch=monkeypatch)
    return runs


def test_timestep_fraction_trains_flow_grpos_int_count(tmp_path, monkeypatch):
    """fraction 0.6 of T = 4: flow_grpo trains int(2.4) = 2 steps, j = 0, 1 (⌈2.4⌉ = 3 would add j = 2);
    with microbatches of 4 that is 2 microbatches × 2 steps = 4 loss terms. A fraction that trains no
    step (int(0.2 × 4) = 0) is a config error naming the field."""
    run = one_step(
        tmp_path, "train.timestep_fraction=0.6", "train.microbatch_size=4", monkeypatch=monkeypatch
    )
    assert [j for j, _, _ in run["calls"]] == [0, 1, 0, 1]
    with pytest.raises(ConfigError, match=r"^train\.timestep_fraction: int\(0\.2 × num_inference_steps 4\)"):
        load(GRPO_CONFIG, "train.timestep_fraction=0.2")


def test_first_on_policy_ratio_is_one(microbatch_runs):
    """The step's minibatch is the rollout's own samples under the rollout's weights, so every per-sample
    ratio r = exp(log p_θ − log p_old) is 1. Trained as the rollout's own batch of 8 (microbatch 0) the
    log-probs come from the same kernels on the same rows: r is exactly 1 on every CPU. Trained in
    microbatches of 1 or 2, the forward runs other GEMM shapes, whose kernels round differently (which
    ones depends on the CPU): |log r| ≤ 4 ulp of log p_old (measured 2 ulp at ATEN_CPU_CAPABILITY avx2 and
    default), and the logged ``ratio_mean`` is 1 within that plus one float32 ulp of 1 (its own rounding).
    An off-by-one step index or a different noise level would move log r by orders of magnitude more."""
    one = float(np.spacing(np.float32(1.0)))
    for size, run in microbatch_runs.items():
        log_ratios = torch.cat([log_ratio for _, log_ratio, _ in run["calls"]])
        old = torch.cat([old for _, _, old in run["calls"]])
        assert log_ratios.numel() == 8 * 4, size  # every sample at every one of the T = 4 steps
        if size == 0:
            assert torch.equal(log_ratios, torch.zeros_like(log_ratios)), float(log_ratios.abs().max())
            assert run["record"]["ratio_mean"] == 1.0
        else:
            ulps = log_ratios.abs() / torch.from_numpy(np.spacing(old.abs().float().numpy())).double()
            assert float(ulps.max()) <= 4, (size, float(ulps.max()))
            assert abs(run["record"]["ratio_mean"] - 1.0) <= float(log_ratios.abs().max()) + one, size
        assert run["record"]["clipfrac"] == 0.0


def test_gradient_accumulation_is_equivalent_to_the_whole_minibatch(microbatch_runs):
    """The accumulated gradient (each microbatch loss divided by microbatches × trained steps) equals
    the whole minibatch's: ‖g − g_whole‖ ≤ 1e-5·‖g_whole‖ (measured 1.2e-6 for microbatch 1), elementwise rtol 1e-4 / atol 1e-7 (the
    gradient's RMS is ~3e-4), and the norms agree to rel 1e-6 (measured 0.09388938 for microbatch 1, 0.09388936 for 2 and for the whole batch: fp32 sums in
    another order). A missing 1/microbatches factor would scale the norm by 8 or 4."""
    whole = microbatch_runs[0]
    for size in (1, 2):
        run = microbatch_runs[size]
        relative = float((run["grad"] - whole["grad"]).norm() / whole["grad"].norm())
        print(f"microbatch {size}: ‖g − g_whole‖/‖g_whole‖ = {relative:.2e}")
        assert relative <= 1e-5, (size, relative)
        torch.testing.assert_close(run["grad"], whole["grad"], rtol=1e-4, atol=1e-7)
        assert run["record"]["grad_norm.policy"] == pytest.approx(
            whole["record"]["grad_norm.policy"], rel=1e-6
        )
        assert run["record"]["loss"] == pytest.approx(whole["record"]["loss"], abs=1e-7)
    assert float(whole["grad"].norm()) == pytest.approx(whole["record"]["grad_norm.policy"], rel=1e-6)
    assert 0.05 < whole["record"]["grad_norm.policy"] < 0.2
