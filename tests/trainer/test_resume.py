"""Exact resume: N steps in one go == M steps, stop, resume, N − M steps (bitwise, one thread).

Add an algorithm by appending ``(config, overrides, N, M)`` to ``RESUME_CASES``. M may fall inside a
rollout iteration of several optimizer steps: ``--max-steps`` is exact, and the checkpoint of a run
cut inside a cycle records the cycle position (``BaseTrainer`` docstring).
"""

from __future__ import annotations

import pytest
import torch
from framework_utils import REPO, load, metrics
from safetensors.torch import load_file

RESUME_CASES = {
    # 2 optimizer steps per rollout iteration; cut after the first step of the first iteration
    "grpo": (
        REPO / "examples/grpo/full/sd3_tiny/default.yaml",
        ("train.kl_beta=0.01", "train.gradient_steps_per_iteration=2"),
        4,
        1,
    ),
    # (fake, fake, generator) per rollout iteration; cut after the first fake step of the second
    "dmd2": (REPO / "examples/dmd2/full/sd3_tiny/default.yaml", (), 6, 4),
    # a cut at a cycle boundary still resumes exactly
    "dmd2-boundary": (REPO / "examples/dmd2/full/sd3_tiny/default.yaml", (), 6, 3),
}


@pytest.mark.parametrize("algorithm", sorted(RESUME_CASES))
def test_resume_is_bitwise_exact(algorithm, tmp_path, monkeypatch):
    """Same losses, metrics and final weights / optimizer state whether or not the run was interrupted,
    and the resumed run really continues: it runs only the N − M remaining optimizer steps (a resume
    that silently restarted from step 0 would reproduce the same numbers)."""
    from reference_trainer.cli import first_difference
    from reference_trainer.optim import RoleOptimizer
    from reference_trainer.run import train

    config_path, overrides, steps, cut = RESUME_CASES[algorithm]
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    train(load(config_path, *overrides, max_steps=steps), straight)
    first = train(load(config_path, *overrides, max_steps=cut), interrupted)
    assert first.optimizer_step == cut and len(metrics(interrupted)) == cut  # --max-steps is exact
    phases: list[str] = []  # the optimizer steps the resumed process runs, counted outside the trainer
    phase = RoleOptimizer.phase

    def counted_phase(self, role):
        phases.append(role)
        return phase(self, role)

    monkeypatch.setattr(RoleOptimizer, "phase", counted_phase)
    train(load(config_path, *overrides, max_steps=steps), interrupted, resume="latest")

    a, b = metrics(straight), metrics(interrupted)
    assert len(a) == steps
    assert phases == [record["role"] for record in a[cut:]]  # N − M steps, the roles of the straight run
    assert first_difference(a, b) is None
    final = f"checkpoints/step-{steps:06d}/state"
    for name in ("variants.safetensors", "optimizer.safetensors"):
        left, right = load_file(straight / final / name), load_file(interrupted / final / name)
        assert left.keys() == right.keys()
        for key in left:
            assert torch.equal(left[key], right[key]), f"{name}:{key}"


def test_resume_refuses_a_different_run_before_loading(tmp_path, monkeypatch):
    """A changed objective (train.kl_beta) is refused with the field named, before any model loads."""
    from reference_trainer.adapters.sd3 import SD3TinyAdapter
    from reference_trainer.checkpoint import CheckpointError
    from reference_trainer.run import train

    config_path, overrides, _, _ = RESUME_CASES["grpo"]
    train(load(config_path, *overrides, max_steps=1), tmp_path)

    def no_loading(self):
        raise AssertionError("model weights loaded before the identity check")

    monkeypatch.setattr(SD3TinyAdapter, "load_pipeline", no_loading)
    with pytest.raises(CheckpointError, match=r"train\.kl_beta"):
        train(load(config_path, "train.kl_beta=0.5", max_steps=2), tmp_path, resume="latest")
    with pytest.raises(CheckpointError, match=r"runtime\.threads"):
        train(load(config_path, *overrides, "runtime.threads=2", max_steps=2), tmp_path, resume="latest")


def test_max_steps_stops_inside_a_cycle_and_records_its_position(tmp_path):
    """DMD2 with 3 optimizer steps per rollout iteration and --max-steps 4: exactly 4 steps run; the
    final checkpoint is step 4, in rollout iteration 1 with 1 of its 3 steps done, and it carries the
    generator/fake weights of that iteration's start (= the weights after step 3)."""
    from reference_trainer.checkpoint import list_checkpoints, read_trainer_state
    from reference_trainer.run import train

    config_path = REPO / "examples/dmd2/full/sd3_tiny/default.yaml"
    train(load(config_path, "checkpoint.every=3", max_steps=4), tmp_path)
    records = metrics(tmp_path)
    assert [r["role"] for r in records] == ["fake", "fake", "generator", "fake"]
    assert [r["rollout_iteration"] for r in records] == [0, 0, 0, 1]
    assert [path.name for path in list_checkpoints(tmp_path)] == ["step-000003", "step-000004"]
    state = read_trainer_state(tmp_path / "checkpoints/step-000004")
    assert state["optimizer_step"] == 4 and state["rollout_iteration"] == 1
    assert state["cycle"] == {"steps_done": 1}
    assert read_trainer_state(tmp_path / "checkpoints/step-000003")["cycle"] == {"steps_done": 0}
    cycle_start = load_file(tmp_path / "checkpoints/step-000004/state/cycle_start.safetensors")
    after_step_3 = load_file(tmp_path / "checkpoints/step-000003/state/variants.safetensors")
    assert cycle_start.keys() == after_step_3.keys()
    assert all(torch.equal(cycle_start[key], after_step_3[key]) for key in cycle_start)
    assert not (tmp_path / "checkpoints/step-000003/state/cycle_start.safetensors").exists()
