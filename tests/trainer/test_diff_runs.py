"""``reference-trainer diff`` compares the metric keys both runs log and lists the others."""

from __future__ import annotations

import json


def _run(path, records):
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _diff(a, b):
    from typer.testing import CliRunner

    from reference_trainer.cli import app

    result = CliRunner().invoke(app, ["diff", str(a), str(b), "--json"])
    return result.exit_code, json.loads(result.stdout) if result.stdout.startswith("{") else result.output


def test_runs_with_different_metric_keys_compare_on_the_shared_ones(tmp_path):
    ours = [{"optimizer_step": s, "loss": 0.5 / s, "reward_mean": 0.1 * s, "kl": 0.0} for s in (1, 2)]
    theirs = [
        {"optimizer_step": s, "loss": 0.5 / s, "reward_mean": 0.1 * s, "my.timer_s": 3.0} for s in (1, 2)
    ]
    code, out = _diff(_run(tmp_path / "a", ours), _run(tmp_path / "b", theirs))
    assert code == 0 and out["identical"]
    assert out["compared_keys"] == ["loss", "optimizer_step", "reward_mean"]
    assert out["only_in_a"] == ["kl"] and out["only_in_b"] == ["my.timer_s"]

    theirs[1]["reward_mean"] = 0.2000001
    code, out = _diff(tmp_path / "a", _run(tmp_path / "c", theirs))
    assert code == 1 and out["first_difference"]["optimizer_step"] == 2
    assert out["first_difference"]["keys"] == ["reward_mean"]


def test_runs_sharing_no_metric_are_a_usage_error(tmp_path):
    a = _run(tmp_path / "a", [{"optimizer_step": 1, "loss": 1.0}])
    b = _run(tmp_path / "b", [{"optimizer_step": 1, "objective": 1.0}])
    code, out = _diff(a, b)
    assert code == 2 and "no metric key in common" in out["error"]["message"]  # --json: the error object
