"""`ffdebug trace`: per module / tap statistics, grad contexts, mask summaries, and one trainer step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import TESTS
from typer.testing import CliRunner

from ffdebug.cli.app import app
from ffdebug.trace import mask_summary, trace

ROOT = Path(__file__).resolve().parents[2]
TARGET = str(TESTS / "helpers" / "review" / "trace_target.py")
runner = CliRunner()


def test_trace_rows_contexts_and_masks():
    result = trace(f"{TARGET}:one_step", params=True)
    assert result.error is None
    rows = {(r.name, r.grad_enabled, r.phase): r for r in result.rows}
    # module names come from the module tree of the outermost module called
    assert ("TinyLM.blocks.0.proj", True, None) in rows
    assert ("TinyLM.blocks.1.act", True, None) in rows
    # the no_grad reference forward and the training forward are separate rows
    ref = rows[("TinyLM", False, "reference")]
    train = rows[("TinyLM", True, None)]
    assert ref.requires_grad is False and train.requires_grad is True
    assert train.shape == [2, 10, 32] and train.dtype == "float32"
    assert rows[("TinyLM.embed", True, None)].calls == 1
    # taps and the returned dict are rows too
    loss = rows[("loss", True, None)]
    assert loss.kind == "tap" and loss.requires_grad and loss.shape == []
    probe = rows[("return.nan_probe", True, None)]
    assert probe.stats["nan"] == 1 and probe.kind == "return"
    # masks: the tapped loss mask and the attention_mask keyword argument
    masks = {m.name: m for m in result.masks}
    lm = masks["loss_mask"]
    assert (lm.unmasked, lm.total, lm.first_unmasked, lm.row_first) == (12, 20, 3, [3, 5])
    assert masks["TinyLM(attention_mask=)"].unmasked == 20
    # parameters of the traced root
    assert any(p.name == "TinyLM.head.weight" and p.requires_grad for p in result.params)


def test_trace_filters():
    result = trace(f"{TARGET}:one_step", modules=("*.proj",))
    names = {r.name for r in result.rows if r.kind == "module"}
    assert names == {"TinyLM.blocks.0.proj", "TinyLM.blocks.1.proj"}
    result = trace(f"{TARGET}:one_step", depth=1)
    assert {r.name for r in result.rows if r.kind == "module"} == {"TinyLM", "TinyLM.embed", "TinyLM.head"}
    all_calls = trace(f"{TARGET}:one_step", all_calls=True)
    assert sum(r.name == "TinyLM" for r in all_calls.rows) == 2


def test_mask_summary_additive_and_empty():
    import torch

    additive = torch.tensor([[-1e9, -1e9, 0.0, 0.0]])
    s = mask_summary("m", additive)
    assert s.additive and s.unmasked == 2 and s.first_unmasked == 2
    none = mask_summary("m", torch.zeros(3))
    assert none.unmasked == 0 and none.first_unmasked is None
    assert "none counted" in none.describe()


def test_cli_text_json_and_errors():
    r = runner.invoke(app, ["trace", f"{TARGET}:one_step"])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "blocks.0.proj" in text  # (module classes are in --json)
    assert "loss_mask [2, 10]: 12/20 positions counted, first at position 3; first per row: 3, 5" in text
    r = runner.invoke(app, ["trace", f"{TARGET}:one_step", "--json"])
    out = json.loads(r.output)
    assert out["error"] is None and {
        "name",
        "shape",
        "dtype",
        "mean",
        "std",
        "min",
        "max",
        "nan",
        "requires_grad",
    } <= set(out["rows"][0])
    r = runner.invoke(app, ["trace", f"{TARGET}:fails", "--json"])
    assert r.exit_code == 1
    out = json.loads(r.output)
    assert out["error"] == "RuntimeError: boom after the forward" and out["rows"]
    assert runner.invoke(app, ["trace", f"{TARGET}:missing"]).exit_code == 2
    assert runner.invoke(app, ["trace", "no_colon"]).exit_code == 2
    assert runner.invoke(app, ["trace"]).exit_code == 2
    assert runner.invoke(app, ["trace", "--train", "no/such.yaml"]).exit_code == 2


@pytest.mark.integration
@pytest.mark.slow
def test_trace_one_reference_trainer_step(monkeypatch):
    monkeypatch.chdir(ROOT)
    r = runner.invoke(app, ["trace", "--train", "examples/grpo/full/sd3_tiny/default.yaml", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)  # the trainer's own prints went to stderr
    assert out["error"] is None
    names = {row["name"] for row in out["rows"]}
    taps = {row["name"] for row in out["rows"] if row["kind"] == "tap"}
    assert {"reward", "advantage"} <= taps, taps
    assert any(n.startswith("SD3Transformer2DModel") for n in names)
    # the rollout runs without grad, the training forward with it: both contexts are traced
    transformer = [row for row in out["rows"] if row["name"] == "SD3Transformer2DModel[0]"]
    assert {(row["grad_enabled"], row["phase"]) for row in transformer} == {
        (False, "rollout"),
        (True, "train"),
    }
    train = next(row for row in transformer if row["grad_enabled"])
    assert train["requires_grad"] is True and train["nan"] == 0


def test_trace_is_the_sink_of_a_plain_session(tmp_path, monkeypatch):
    """Inside a trace, `ffdebug.install` hooks the model into the trace's session: its module
    stages are not rows (the tracer's own hooks see every module), a tap is a row in its own
    phase, and nothing is written to disk."""
    monkeypatch.chdir(tmp_path)
    result = trace(f"{TARGET}:installed_step")
    assert result.error is None
    names = {r.name for r in result.rows}
    assert "TinyLM.blocks.0.proj" in names
    assert not any(n.startswith(("L0", "embed.", "final.")) for n in names)
    probs = next(r for r in result.rows if r.name == "probs")
    assert (probs.kind, probs.phase, probs.shape, probs.requires_grad) == ("tap", "sample", [2, 10, 32], True)
    assert list(tmp_path.iterdir()) == []
