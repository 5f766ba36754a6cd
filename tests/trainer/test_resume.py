"""Exact resume: N steps in one go == N/2 steps, stop, resume, N/2 steps (bitwise, one thread).

Add an algorithm by appending ``(config, overrides, N)`` to ``RESUME_CASES`` (N must be a multiple of
2 × the optimizer steps per cycle, since runs stop at cycle boundaries).
"""

from __future__ import annotations

import pytest
import torch
from framework_utils import REPO, load, metrics
from safetensors.torch import load_file

RESUME_CASES = {
    "grpo": (
        REPO / "examples/grpo/full/sd3_tiny/default.yaml",
        ("train.kl_beta=0.01", "train.gradient_steps_per_iteration=2"),
        4,
    ),
}


@pytest.mark.parametrize("algorithm", sorted(RESUME_CASES))
def test_resume_is_bitwise_exact(algorithm, tmp_path):
    """Same losses, metrics and final weights / optimizer state whether or not the run was interrupted."""
    from reference_trainer.cli import first_difference
    from reference_trainer.run import train

    config_path, overrides, steps = RESUME_CASES[algorithm]
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    train(load(config_path, *overrides, max_steps=steps), straight)
    train(load(config_path, *overrides, max_steps=steps // 2), interrupted)
    train(load(config_path, *overrides, max_steps=steps), interrupted, resume="latest")

    a, b = metrics(straight), metrics(interrupted)
    assert len(a) == steps
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

    config_path, overrides, _ = RESUME_CASES["grpo"]
    train(load(config_path, *overrides, max_steps=1), tmp_path)

    def no_loading(self):
        raise AssertionError("model weights loaded before the identity check")

    monkeypatch.setattr(SD3TinyAdapter, "load_pipeline", no_loading)
    with pytest.raises(CheckpointError, match=r"train\.kl_beta"):
        train(load(config_path, "train.kl_beta=0.5", max_steps=2), tmp_path, resume="latest")
    with pytest.raises(CheckpointError, match=r"runtime\.threads"):
        train(load(config_path, *overrides, "runtime.threads=2", max_steps=2), tmp_path, resume="latest")
