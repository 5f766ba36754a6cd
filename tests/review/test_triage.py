"""`ffdebug playbook triage`: the decision tree points at the right phase with the right commands."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from ffdebug.cli.app import app
from ffdebug.review.playbooks import load_all
from ffdebug.review.triage import TriageError, load_tree, parse_tree, walk

runner = CliRunner()


def triage(*args: str, input: str | None = None):
    r = runner.invoke(app, ["playbook", "triage", *args], input=input)
    return r


def triage_json(*args: str) -> dict:
    r = triage(*args, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def test_single_prompt_ok_batch_fails_goes_to_slot_invariance():
    out = triage_json("--symptom", "wrong-output", "--deterministic", "--batch-only")
    assert (out["playbook"], out["phase"]) == ("dump-bisect", 8)
    assert any(c.startswith("ffdebug slot-invariance --dir") for c in out["commands"])


def test_gibberish_at_temperature_0_with_a_reference_goes_to_weights_first():
    out = triage_json("--symptom", "wrong-output", "--deterministic", "--reference")
    assert (out["playbook"], out["phase"]) == ("dump-bisect", 1)
    assert any(c.startswith("ffdebug weights-diff") for c in out["commands"])
    assert any(c.startswith("ffdebug load-audit") for c in out["commands"])
    assumed = {a["question"]: a["answer"] for a in out["answers"] if a["how"] == "assumed"}
    assert assumed == {"batch-only": False, "weights-verified": False}


@pytest.mark.parametrize(
    "flags, playbook, phase",
    [
        (["--symptom", "wrong-output", "--no-deterministic"], "dump-bisect", 8),
        (["--symptom", "wrong-output", "--deterministic", "--no-reference"], "dump-bisect", 0),
        (
            ["--symptom", "wrong-output", "--deterministic", "--reference", "--weights-verified"],
            "dump-bisect",
            2,
        ),
        (
            [
                "--symptom",
                "wrong-output",
                "--deterministic",
                "--reference",
                "--weights-verified",
                "--dumps-agree",
            ],
            "dump-bisect",
            3,
        ),
        (
            [
                "--symptom",
                "wrong-output",
                "--deterministic",
                "--reference",
                "--weights-verified",
                "--dumps-agree",
                "--layer-known",
            ],
            "dump-bisect",
            5,
        ),
        (
            [
                "--symptom",
                "wrong-output",
                "--deterministic",
                "--reference",
                "--weights-verified",
                "--dumps-agree",
                "--layer-known",
                "--substage-known",
            ],
            "dump-bisect",
            6,
        ),
        (
            [
                "--symptom",
                "wrong-output",
                "--deterministic",
                "--reference",
                "--weights-verified",
                "--dumps-agree",
                "--layer-known",
                "--substage-known",
                "--fix-ready",
            ],
            "dump-bisect",
            7,
        ),
        (["--symptom", "crash", "--local"], "quick-path", None),
        (["--symptom", "crash", "--no-local"], "full-protocol", 1),
        (["--symptom", "training-divergence", "--no-deterministic"], "full-protocol", 3),
        (["--symptom", "training-divergence", "--deterministic", "--no-reference"], "dump-bisect", 0),
        (["--symptom", "training-divergence", "--deterministic", "--reference"], "dump-bisect", 1),
        (
            ["--symptom", "training-divergence", "--deterministic", "--reference", "--weights-verified"],
            "dump-bisect",
            4,
        ),
    ],
)
def test_paths(flags, playbook, phase):
    out = triage_json(*flags)
    assert (out["playbook"], out["phase"]) == (playbook, phase)
    assert out["commands"], "every outcome prints commands"


def test_training_divergence_with_known_step_bisects_that_step():
    out = triage_json(
        "--symptom",
        "training-divergence",
        "--deterministic",
        "--reference",
        "--weights-verified",
        "--step-known",
    )
    assert out["outcome"] == "train-bisect"
    assert any("FFDEBUG_FWD_DUMP_GRADS=1" in c for c in out["commands"])


def test_text_output_names_phase_commands_and_assumptions():
    r = triage("--symptom", "wrong-output", "--deterministic", "--reference")
    assert r.exit_code == 0
    text = " ".join(r.output.split())
    assert "phase 1, Rule out weight loading" in text
    assert "$ ffdebug weights-diff" in text
    assert "weights-verified=no (assumed; pass --weights-verified to change)" in text


def test_missing_answer_is_a_named_error_and_generic_answers_work():
    r = triage("--symptom", "wrong-output")
    assert r.exit_code == 2
    assert "--deterministic / --no-deterministic" in r.output
    out = triage_json("-a", "symptom=wrong-output", "-a", "deterministic=yes", "-a", "batch-only=yes")
    assert out["phase"] == 8
    assert triage("--symptom", "flaky", "--json").exit_code == 2
    assert triage("-a", "colour=blue", "--json").exit_code == 2


def test_interactive_prompts():
    # symptom, deterministic, batch-only, reference, weights-verified
    r = triage("--interactive", "--json", input="wrong-output\ny\nn\ny\nn\n")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output[r.output.index("{") :])
    assert out["phase"] == 1
    assert all(a["how"] == "asked" for a in out["answers"])


def test_tree_validation_rejects_dangling_nodes_and_loops():
    books = load_all()
    good = books["dump-bisect"].triage
    assert load_tree().start == good["start"]
    bad = {
        **good,
        "questions": {**good["questions"], "local": {"ask": "?", "yes": "nowhere", "no": "full-protocol"}},
    }
    with pytest.raises(TriageError, match="unknown node 'nowhere'"):
        parse_tree(bad, books, "t")
    loop = {
        "start": "a",
        "questions": {"a": {"ask": "?", "yes": "b", "no": "o"}, "b": {"ask": "?", "yes": "a", "no": "o"}},
        "outcomes": {"o": {"playbook": "dump-bisect", "phase": 1, "say": "s"}},
    }
    with pytest.raises(TriageError, match="loop"):
        parse_tree(loop, books, "t")
    bad_phase = {**loop, "questions": {"a": {"ask": "?", "yes": "o", "no": "o"}}}
    bad_phase["outcomes"] = {"o": {"playbook": "dump-bisect", "phase": 42, "say": "s"}}
    with pytest.raises(Exception, match="no phase 42"):
        parse_tree(bad_phase, books, "t")


def test_walk_api():
    result = walk(load_tree(), {"symptom": "crash", "local": True})
    assert result.outcome.playbook == "quick-path"
    assert result.commands[0] == "reference-trainer list"
