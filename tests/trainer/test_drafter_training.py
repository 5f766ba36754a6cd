"""Two drafter-training loops of different codebases compared through the LM training tap contract.

``examples/drafter_training/reference_loop.py`` (Hugging Face style: ``output_hidden_states``, the
target's embedding shared) and ``port_loop.py`` (engine style: hooks on the target's layers, its own
embedding copy, a transposed projection loaded through a rename table that skips what does not
fit) train the same drafter on the same frozen target. The correct port passes ``bisect``; each
planted bug is named by one ``bisect`` at the stage and optimizer step where it first acts (stages
in capture order; the eval of the starting weights, ``phase=eval`` at ``optimizer_step=0``, comes
first in step 0):

* the projection left at its init (the loader forgets the transpose: a shape mismatch it skips):
  ``fc.out``;
* the last feature taken from ``hidden_states[-1]`` (the final norm's output, not the layer's):
  ``features.layer2``, and ``trace`` says whose output it is;
* the loss mask shifted by one position: ``data.loss_mask``;
* the embedding table copied with its rows rolled by one (a pad row inserted): ``embed.out`` of the
  drafter's forward, not the loss;
* the loss normalised by all positions instead of the counted ones: ``eval.loss`` (the eval at step
  0 computes it first);
* the drafter's causal mask dropped (it attends to later tokens): ``L000.attn_out`` of the drafter's
  forward (call 1; its q and k after rotary are equal);
* the warm-up one step late (lr 0 at step 0): ``update.drafter`` (the gradient is equal).
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
from helpers import REPO, load_script

import ffdebug

pytestmark = pytest.mark.integration

EXAMPLE = REPO / "examples/drafter_training"


def _script(name: str):
    return load_script(EXAMPLE / f"{name}.py", f"drafter_{name}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """FIX (target, drafter checkpoint, data), D/ref and D/port: 3 optimizer steps each."""
    root = tmp_path_factory.mktemp("drafter")
    fixtures = root / "fixtures"
    _script("make_fixtures").main([str(fixtures)])
    for side in ("ref", "port"):
        script = _script("reference_loop" if side == "ref" else "port_loop")
        with ffdebug.capture(dir=str(root / "dumps"), side=side):
            script.main([str(fixtures), "--steps", "3"])
    return root


def test_the_correct_port_passes_and_every_contract_stage_is_compared(runs):
    dumps = runs / "dumps"
    result = ffdebug.bisect(dumps / "ref", dumps / "port")
    assert result.exit_code() == 0, result.notes
    compared = ffdebug.compare(dumps / "ref", dumps / "port")
    assert compared.exit_code() == 0
    keys = {e.key for e in compared.stages}
    contract = {"data.input_ids", "data.loss_mask", "data.labels", "features.layer0", "fc.out"}
    contract |= {"loss.drafter", "grad_norm.drafter", "update.drafter", "eval.loss", "eval.accept"}
    assert contract <= keys
    # both models' forwards: the target (call 0) and the drafter (call 1), one embed.out each
    embeds = [e for e in compared.stages if e.key == "embed.out" and e.step.get("optimizer_step") == 0]
    assert sorted((e.phase, e.call) for e in embeds) == [("eval", 0), ("eval", 1), ("train", 0), ("train", 1)]
    steps = {(e.phase, e.step["optimizer_step"]) for e in compared.stages if e.key == "eval.accept"}
    assert steps == {("eval", 0), ("eval", 2), ("eval", 3)}


def _bugs(port):
    take_features, convert, embedding_rows = port.take_features, port.convert, port.embedding_rows

    def last_hidden_state(outputs, captured):
        return take_features(outputs, captured)[:-1] + [outputs.hidden_states[-1]]

    def no_transpose(name, tensor):
        key, value = convert(name, tensor)
        return (key, tensor) if name == "fc.weight" else (key, value)

    def shifted_mask(prompt_lengths, seq):
        t = torch.arange(seq).unsqueeze(0)
        return ((t >= prompt_lengths.unsqueeze(1)) & (t + 1 < seq)).float()

    def all_positions(student, teacher, mask):
        per_token = -(torch.softmax(teacher, -1) * torch.log_softmax(student, -1)).sum(-1)
        return (per_token * mask).mean()

    def bidirectional(seq):
        return torch.zeros(1, 1, seq, seq)

    return {
        "fc_left_at_init": ("convert", no_transpose, "fc.out"),
        "wrong_layer": ("take_features", last_hidden_state, "features.layer2"),
        "shifted_loss_mask": ("make_loss_mask", shifted_mask, "data.loss_mask"),
        "embedding_scrambled": ("embedding_rows", lambda w: torch.roll(embedding_rows(w), 1, 0), "embed.out"),
        "loss_over_all_positions": ("soft_ce", all_positions, "eval.loss"),
        "causal_mask_dropped": ("causal_mask", bidirectional, "L000.attn_out"),
        "warmup_late": (
            "learning_rate",
            lambda step: port.PEAK_LR * min(1.0, step / port.WARMUP_STEPS),
            "update.drafter",
        ),
    }


BUGS = [
    "fc_left_at_init",
    "wrong_layer",
    "shifted_loss_mask",
    "embedding_scrambled",
    "loss_over_all_positions",
    "causal_mask_dropped",
    "warmup_late",
]


@pytest.mark.parametrize("bug", BUGS)
def test_planted_bug_is_named_at_its_stage_and_step(runs, tmp_path, monkeypatch, bug):
    port = _script("port_loop")
    name, replacement, stage = _bugs(port)[bug]
    monkeypatch.setattr(port, name, replacement)
    with ffdebug.capture(dir=str(tmp_path), side="buggy"), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        port.main([str(runs / "fixtures"), "--steps", "1"])
    if bug == "fc_left_at_init":  # the loader said so, in a warning a training log buries
        assert any("fc.weight (32, 96)" in str(w.message) for w in seen)

    result = ffdebug.bisect(runs / "dumps" / "ref", tmp_path / "buggy", allow_partial=True)
    first = result.first_divergence
    assert (first.key, first.step["optimizer_step"]) == (stage, 0), result.notes
    if stage.startswith(("embed.", "L000.")):  # the drafter's forward, not the target's
        assert first.call == 1
    assert result.exit_code() == 1
    sentence = next(n for n in result.notes if n.startswith("training order:"))
    assert f"optimizer_step 0, {stage}" in sentence


def test_trace_says_whose_output_a_feature_is(runs, monkeypatch):
    """The wrong-layer bug, third command: `trace` of one port step names the final norm."""
    from ffdebug.trace import trace

    port = _script("port_loop")
    monkeypatch.setattr(port, "take_features", _bugs(port)["wrong_layer"][1])
    monkeypatch.setitem(sys.modules, "drafter_port_buggy", port)
    result = trace("drafter_port_buggy:main", [str(runs / "fixtures"), "--steps", "1", "--eval-every", "5"])
    assert result.error is None
    sources = {(r.name, r.phase): r.source for r in result.rows if r.kind == "tap"}
    wrong = sources[("features.layer2", "train")]
    assert wrong.relation == "same" and wrong.modules[0] == "LlamaForCausalLM.model.norm"
    right = sources[("features.layer1", "train")]
    assert right.relation == "same" and right.modules[0] == "LlamaForCausalLM.model.layers.1"
    assert sources[("loss.drafter", "train")].relation is None


def test_a_difference_within_rounding_upstream_is_no_later_calls_bug_signal(runs, tmp_path, monkeypatch):
    """AdamW's β₂ changed: step 0's update differs only by rounding (bias correction makes m̂ = g,
    v̂ = g²), and every later stage inherits it. Compare and bisect agree (no stage outside the ok
    band, no exact-prefix break above rounding), and bisect says where the bits first part."""
    port = _script("port_loop")
    adamw = torch.optim.AdamW
    monkeypatch.setattr(port.torch.optim, "AdamW", lambda *a, **k: adamw(*a, **{**k, "betas": (0.9, 0.95)}))
    with ffdebug.capture(dir=str(tmp_path), side="betas"):
        port.main([str(runs / "fixtures"), "--steps", "3"])
    compared = ffdebug.compare(runs / "dumps" / "ref", tmp_path / "betas")
    result = ffdebug.bisect(runs / "dumps" / "ref", tmp_path / "betas")
    assert result.exit_code() == compared.exit_code()
    if result.exit_code() == 0:
        note = next(n for n in result.notes if n.startswith("training order:"))
        assert "the bits first part at optimizer_step 0, update.drafter" in note
