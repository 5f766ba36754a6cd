"""`ffdebug hunt` without forwards: round 0 on weights, resume refusals and the byte budget
(docs/hunt.md "Hunt: from symptom to root cause"). The commands are `false`: running one fails the test."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from ffdebug.cli.app import app
from ffdebug.hunt.state import HuntState, Round

NEVER = "false"  # a command hunt must not run


def _weights(tmp_path, scale):
    path = tmp_path / f"w{scale}.safetensors"
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    save_file({"layers.0.q_proj.weight": w * scale, "norm.weight": torch.ones(4)}, str(path))
    return str(path)


def test_round0_weight_bug_ends_the_hunt_before_any_forward(tmp_path):
    a, b = _weights(tmp_path, 1.0), _weights(tmp_path, 2.0)
    d = tmp_path / "h"
    args = [
        "hunt",
        "--ref",
        NEVER,
        "--target",
        NEVER,
        "--weights",
        a,
        "--weights",
        b,
        "--dir",
        str(d),
        "--json",
    ]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 1, out.output
    result = json.loads(out.stdout)
    assert [r["round"] for r in result["rounds"]] == [0] and result["complete"]
    assert result["rounds"][0]["decision"].startswith("weight bug") and result["sub_stage"] == "weights"
    assert result["budget"] == {"limit": None, "used": 0}


def _saved(d, budget, used):
    d.mkdir()
    state = HuntState(budget_limit=budget)
    state.layer = 3
    state.rounds.append(
        Round(1, {"ref": {}, "target": {}}, NEVER, NEVER, used, "layer 3 introduces error", [])
    )
    state.save(str(d))


def test_resume_stops_when_the_budget_is_spent(tmp_path):
    """1 MiB written by round 1 against a 500 KiB budget: round 2 never starts, exit 4."""
    d = tmp_path / "h"
    _saved(d, 500 * 1024, 1 << 20)
    args = [
        "hunt",
        "--ref",
        NEVER,
        "--target",
        NEVER,
        "--dir",
        str(d),
        "--budget",
        "500KiB",
        "--resume",
        "--json",
    ]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 4, out.output
    result = json.loads(out.stdout)
    assert [r["round"] for r in result["rounds"]] == [1] and not result["complete"]
    assert result["budget"] == {"limit": 500 * 1024, "used": 1 << 20}


def test_resume_refuses_other_commands(tmp_path):
    d = tmp_path / "h"
    _saved(d, None, 10)
    out = CliRunner().invoke(app, ["hunt", "--ref", "true", "--target", NEVER, "--dir", str(d), "--resume"])
    assert out.exit_code == 2 and "round 1 ran other commands" in out.output
    out = CliRunner().invoke(app, ["hunt", "--ref", NEVER, "--target", NEVER, "--dir", str(d)])
    assert out.exit_code == 2 and "continue it with --resume" in out.output
    out = CliRunner().invoke(
        app, ["hunt", "--ref", NEVER, "--target", NEVER, "--dir", str(tmp_path / "x"), "--budget", "lots"]
    )
    assert out.exit_code == 2 and "--budget 'lots' is invalid" in out.output
