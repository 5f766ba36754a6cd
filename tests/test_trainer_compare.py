"""Compare features for trainer stores, on hand-made taps: near-zero values, --exclude, the inputs gate."""

from __future__ import annotations

import pytest
import torch

import ffdebug
from ffdebug.errors import InputIdsMismatch
from ffdebug.verdict import Severity


def _side(tmp_path, side, taps):
    with ffdebug.capture(dir=str(tmp_path), side=side), ffdebug.step(optimizer_step=0, phase="train"):
        for key, value, tags in taps:
            ffdebug.tap(key, torch.tensor(value, dtype=torch.float32), **tags)
    return tmp_path / side


def test_near_zero_loss_within_sixteen_eps_of_its_declared_scale_is_ok(tmp_path):
    """atol = 16 · 1.19e-7 · 0.2 = 3.8e-7: 1.5e-8 vs 0.0 is inside, 1e-6 vs 0.0 is not."""
    ref = _side(tmp_path, "ref", [("loss.policy", 0.0, {"scale": 0.2}), ("x", [1.0, 2.0], {})])
    tiny = _side(tmp_path, "tiny", [("loss.policy", 1.5e-8, {"scale": 0.2}), ("x", [1.0, 2.0], {})])
    big = _side(tmp_path, "big", [("loss.policy", 1e-6, {"scale": 0.2}), ("x", [1.0, 2.0], {})])
    undeclared = _side(tmp_path, "undeclared", [("loss.policy", 1.5e-8, {}), ("x", [1.0, 2.0], {})])

    ok = ffdebug.compare(ref, tiny)
    loss = next(e for e in ok.stages if e.key == "loss.policy")
    assert loss.severity is Severity.OK and any(n.startswith("near zero") for n in loss.notes)
    assert ffdebug.compare(ref, big).verdict.rank >= Severity.BUG.rank
    plain = _side(tmp_path, "plain", [("loss.policy", 0.0, {}), ("x", [1.0, 2.0], {})])
    assert ffdebug.compare(plain, undeclared).verdict.rank >= Severity.BUG.rank  # no scale: the bands


def test_exclude_leaves_stages_out_and_says_so(tmp_path):
    ref = _side(tmp_path, "ref", [("loss.policy", 1.0, {}), ("grad_norm.policy", 2.0, {})])
    target = _side(tmp_path, "target", [("loss.policy", 1.0, {}), ("grad_norm.policy", -2.0, {})])
    assert ffdebug.compare(ref, target).verdict.rank >= Severity.BUG.rank
    result = ffdebug.compare(ref, target, exclude=("grad_norm.*",))
    assert [e.key for e in result.stages] == ["loss.policy"] and result.verdict is Severity.OK
    assert any("--exclude grad_norm.*" in s for s in result.coverage.selected_out)


def test_different_noise_stops_at_the_inputs_gate_naming_it(tmp_path):
    noise = [[0.5, -1.0], [2.0, 0.25]]
    ref = _side(tmp_path, "ref", [("rollout.noise", noise, {}), ("reward", [1.0, 2.0], {})])
    other = [[0.5, -1.0], [2.0, 0.5]]
    target = _side(tmp_path, "target", [("rollout.noise", other, {}), ("reward", [1.0, 2.0], {})])
    with pytest.raises(InputIdsMismatch) as raised:
        ffdebug.compare(ref, target)
    message = str(raised.value)
    assert message.startswith("rollout.noise (initial noise) differs at optimizer_step=0, phase=train")
    assert "first at index [1, 1]: ref 0.25 vs target 0.5" in message
    assert "feed both runs the same prompts / noise" in message
