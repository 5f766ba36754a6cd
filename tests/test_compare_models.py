"""compare() on real HF implementations: identical, injected bug at layer k, bf16, input ids."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from typer.testing import CliRunner

import ffdebug
from ffdebug.cli.app import app

pytestmark = pytest.mark.integration  # every test here spawns a process, runs a trainer or kills one


def _dump(model, ids, directory, side, **kw):
    with ffdebug.capture(model, dir=directory, side=side, **kw), torch.no_grad():
        model(input_ids=ids)
    return directory / side


def test_identical_is_ok_and_bit_equal(tmp_path, tiny_llama, input_ids):
    ref = _dump(tiny_llama, input_ids, tmp_path, "ref")
    tgt = _dump(copy.deepcopy(tiny_llama), input_ids, tmp_path, "target")
    res = ffdebug.compare(ref, tgt)
    assert res.verdict == "ok" and res.first_divergence is None and bool(res)
    assert all(s.bit_equal == 1.0 and s.severity == "ok" for s in res.stages)
    # embed.input_ids, embed.out, final.norm_out, final.logits; per layer the 6 block stages and
    # the rotated q / k that transformers' apply_rotary_pos_emb hands back
    assert len(res.stages) == 4 + 8 * 4


@pytest.mark.parametrize("k", [1, 2])
def test_scaled_mlp_at_layer_k_is_first_divergence(tmp_path, tiny_llama, input_ids, k):
    ref = _dump(tiny_llama, input_ids, tmp_path, "ref")
    target = copy.deepcopy(tiny_llama)
    target.model.layers[k].mlp.register_forward_hook(lambda m, a, o: o * 1.5)
    tgt = _dump(target, input_ids, tmp_path, "target")
    res = ffdebug.compare(ref, tgt)
    first = res.first_divergence
    assert (first.layer, first.stage) == (k, "ffn_out")
    assert first.severity == "bug"  # pure scale: cos 1, rel 50%
    assert first.cos == pytest.approx(1.0, abs=1e-6) and first.rel == pytest.approx(0.5, rel=1e-5)
    assert all(s.severity == "ok" for s in res.stages if s.layer is not None and s.layer < k)


def _llama8():
    from helpers.tiny_models import tiny_llama

    return tiny_llama(num_layers=8, hidden=64)


@pytest.mark.numeric
def test_bf16_target_is_drift_not_bug(tmp_path, input_ids):
    """bf16 rounding (~0.4% per element) accumulates over 8 layers into the drift band."""
    model = _llama8()
    ref = _dump(model, input_ids, tmp_path, "ref")
    tgt = _dump(copy.deepcopy(model).to(torch.bfloat16), input_ids, tmp_path, "target")
    res = ffdebug.compare(ref, tgt)
    assert res.verdict == "drift", [(s.key, s.severity, s.rel) for s in res.stages if s.severity != "ok"]
    assert bool(res)  # default fail-on diverge passes


def test_input_ids_gate_exit_3(tmp_path, tiny_llama, input_ids):
    _dump(tiny_llama, input_ids, tmp_path, "ref")
    other = input_ids.clone()
    other[1, 5] += 1
    _dump(tiny_llama, other, tmp_path, "target")
    r = CliRunner().invoke(app, ["compare", "ref-vs-target", "--dir", str(tmp_path)])
    assert r.exit_code == 3
    assert "input ids (embed.input_ids) differ" in r.output and "position [1, 5]" in r.output


def test_cli_json_keys_and_exit_codes(tmp_path, tiny_llama, input_ids):
    _dump(tiny_llama, input_ids, tmp_path, "ref")
    target = copy.deepcopy(tiny_llama)
    target.model.layers[3].mlp.register_forward_hook(lambda m, a, o: o * 1.02)
    _dump(target, input_ids, tmp_path, "target")
    runner = CliRunner()
    r = runner.invoke(app, ["compare", "ref-vs-target", "--dir", str(tmp_path), "--json"])
    data = json.loads(r.output)
    assert set(data) >= {"verdict", "stages", "first_divergence"}
    assert set(data["stages"][0]) >= {
        "key",
        "layer",
        "layer_class",
        "severity",
        "cos",
        "rel",
        "rel_diff",
        "max_abs",
        "max_abs_at",
        "shape_ref",
        "shape_target",
    }
    assert data["verdict"] == "drift" and data["first_divergence"]["key"] == "L003.ffn_out"
    logits = data["stages"][-1]
    assert logits["key"] == "final.logits" and set(logits["logits"]) >= {
        "argmax_agree",
        "top5_overlap",
        "kl_mean",
    }
    assert 0 < logits["logits"]["kl_mean"] < 1e-3  # a 2% scale at the last MLP: tiny but non-zero KL
    assert r.exit_code == 0  # drift is below the default fail-on (diverge)
    r2 = runner.invoke(
        app, ["compare", str(tmp_path / "ref"), str(tmp_path / "target"), "--fail-on", "drift"]
    )
    assert r2.exit_code == 1 and "FAILED" in r2.output and "layer 3" in r2.output
    r3 = runner.invoke(app, ["compare", "ref-vs-target", "--dir", str(tmp_path), "--layers", "0-2"])
    assert r3.exit_code == 0 and "PASSED" in r3.output
    r4 = runner.invoke(app, ["compare", "ref-vs-target", "--dir", str(tmp_path), "--exact"])
    assert r4.exit_code == 1


def test_missing_side_lists_found(tmp_path, tiny_llama, input_ids):
    _dump(tiny_llama, input_ids, tmp_path, "ref")
    r = CliRunner().invoke(app, ["compare", "ref-vs-target", "--dir", str(tmp_path)])
    assert r.exit_code == 2 and "sides present: ref" in r.output


def test_warmup_call_set_aside(tmp_path, tiny_llama, input_ids):
    with ffdebug.capture(tiny_llama, dir=tmp_path, side="ref", stages="final.logits"), torch.no_grad():
        tiny_llama(input_ids=input_ids)
    with ffdebug.capture(tiny_llama, dir=tmp_path, side="target", stages="final.logits"), torch.no_grad():
        with ffdebug.step(phase="warmup"):
            tiny_llama(input_ids=torch.zeros_like(input_ids))
        tiny_llama(input_ids=input_ids)
    res = ffdebug.compare(tmp_path / "ref", tmp_path / "target")
    assert res.verdict == "ok" and res.warmup_skipped == 1
    # the real call (call 0 of the untagged set, like the warm-up is call 0 of its own) was compared
    assert [(s.key, s.bit_equal) for s in res.stages] == [
        ("embed.input_ids", 1.0),
        ("final.logits", 1.0),
    ]


def test_shape_mismatch_reported(tmp_path):
    ffd = tmp_path
    with ffdebug.capture(None, dir=ffd, side="ref"):
        ffdebug.tap("x", torch.ones(2, 3))
    with ffdebug.capture(None, dir=ffd, side="target"):
        ffdebug.tap("x", torch.ones(3, 2))
    res = ffdebug.compare(ffd / "ref", ffd / "target")
    s = res.stages[0]
    assert s.finding == "shape_mismatch" and s.severity == "bug" and s.cos is None


@pytest.mark.parametrize("complex_side", ["ref", "target"])
def test_complex_against_real_is_a_dtype_kind_bug_not_a_traceback(tmp_path, complex_side):
    values = torch.linspace(-1, 1, 6)
    for side in ("ref", "target"):
        with ffdebug.capture(None, dir=tmp_path, side=side):
            ffdebug.tap("x", values.to(torch.complex64) if side == complex_side else values)
            ffdebug.tap("y", values)
    res = ffdebug.compare(tmp_path / "ref", tmp_path / "target")
    x, y = res.stages
    assert (x.finding, x.severity, x.cos) == ("dtype_kind", "bug", None) and res.failed()
    dtypes = ("complex64", "float32") if complex_side == "ref" else ("float32", "complex64")
    assert f"dtype kinds differ: ref {dtypes[0]} vs target {dtypes[1]}" in x.notes[0]
    assert y.severity == "ok" and res.first_divergence.key == "x"


def test_stats_only_compared_on_stats(tmp_path, tiny_llama, input_ids):
    _dump(tiny_llama, input_ids, tmp_path, "ref", mode="stats")
    target = copy.deepcopy(tiny_llama)
    target.model.layers[2].mlp.register_forward_hook(lambda m, a, o: o * 2.0)
    _dump(target, input_ids, tmp_path, "target", mode="stats")
    res = ffdebug.compare(tmp_path / "ref", tmp_path / "target")
    assert res.stats_only
    assert res.first_divergence.key == "L002.ffn_out"
    from ffdebug.report.text import compare_conclusion

    assert "on statistics only" in compare_conclusion(res)  # the verdict sentence says so


@pytest.mark.numeric
def test_noise_calibration(tmp_path, input_ids):
    model = _llama8()
    ref = _dump(model, input_ids, tmp_path, "ref")
    bf = copy.deepcopy(model).to(torch.bfloat16)
    noise = _dump(bf, input_ids, tmp_path, "noise")
    tgt = _dump(copy.deepcopy(bf), input_ids, tmp_path, "target")
    assert ffdebug.compare(ref, tgt).verdict == "drift"
    res = ffdebug.compare(ref, tgt, noise=noise)
    assert res.verdict == "ok"  # the target is exactly as far from ref as the noise run
    assert any(s.within_noise for s in res.stages)


def _taps(directory, side, calls):
    """One call group per (tags, ids, value): ids tagged as input ids, then a stage `h`."""
    with ffdebug.capture(None, dir=directory, side=side):
        for tags, ids, value in calls:
            with ffdebug.step(**tags):
                ffdebug.tap("tokens", torch.tensor(ids), input_ids=True)
                ffdebug.tap("h", torch.full((4,), value))
    return directory / side


def test_calls_pair_by_tags_and_input_ids_not_order(tmp_path):
    ref = _taps(tmp_path, "ref", [({"request": "a"}, [1, 2], 1.0), ({"request": "b"}, [3, 4], 2.0)])
    tgt = _taps(tmp_path, "target", [({"request": "b"}, [3, 4], 2.0), ({"request": "a"}, [1, 2], 1.0)])
    res = ffdebug.compare(ref, tgt)
    assert res.verdict == "ok" and len(res.stages) == 4


def test_tensor_tagged_as_input_ids_gates_exit_3(tmp_path):
    _taps(tmp_path, "ref", [({}, [1, 2, 3], 1.0)])
    _taps(tmp_path, "target", [({}, [1, 2, 4], 1.0)])
    r = CliRunner().invoke(app, ["compare", "ref-vs-target", "--dir", str(tmp_path)])
    assert (
        r.exit_code == 3 and "input ids (embed.input_ids) differ" in r.output and "position [2]" in r.output
    )


@pytest.mark.parametrize(
    "args,needle",
    [
        ([], "calls do not pair"),  # different step tags: nothing pairs, which is no PASS
        (["--stages", "zzz*"], "no stage matches"),
        (["--layers", "7"], "selects none of the dumped layers"),
    ],
)
def test_nothing_to_compare_is_exit_2(tmp_path, tiny_llama, input_ids, args, needle):
    with ffdebug.capture(tiny_llama, dir=tmp_path, side="ref"), torch.no_grad():
        with ffdebug.step(optimizer_step=0 if args else 1):
            tiny_llama(input_ids=input_ids)
    with ffdebug.capture(tiny_llama, dir=tmp_path, side="target"), torch.no_grad():
        with ffdebug.step(optimizer_step=0):
            tiny_llama(input_ids=input_ids)
    r = CliRunner().invoke(app, ["compare", "ref-vs-target", "--dir", str(tmp_path), *args])
    assert r.exit_code == 2 and needle in r.output and "PASSED" not in r.output


def test_noise_factor_two_for_fp32_three_for_bf16(tmp_path):
    """Target error 2.5x the noise run's: beyond k=2 (fp32: the beyond-noise rule makes the 5%
    drift-band stage diverge), within k=3 (bf16: ok)."""
    x = torch.linspace(1.0, 2.0, 64)
    e = 0.02 * torch.where(torch.arange(64) % 2 == 0, 1.0, -1.0) * x  # noise rel 2%, target 5%
    for dtype, within in ((torch.float32, False), (torch.bfloat16, True)):
        d = tmp_path / str(dtype)
        for side, value in (("ref", x), ("noise", x + e), ("target", x + 2.5 * e)):
            with ffdebug.capture(None, dir=d, side=side):
                ffdebug.tap("h", value.to(dtype))
        stage = ffdebug.compare(d / "ref", d / "target", noise=d / "noise").stages[0]
        assert stage.within_noise is within and stage.severity == ("ok" if within else "diverge"), stage
        assert stage.beyond_noise is (None if within else True)


def test_a_stage_the_noise_run_cannot_be_compared_at_is_judged_without_it_and_says_so(tmp_path):
    """The noise run has stage `a` but not `b`; the target is 5 % off at both (the drift band).
    `a` is within the noise run's error (ok); `b` keeps its drift grade with a note saying why
    noise was not applied, and the result's notes name it."""
    x = torch.linspace(1.0, 2.0, 64)
    e = 0.05 * torch.where(torch.arange(64) % 2 == 0, 1.0, -1.0) * x
    sides = {"ref": {"a": x, "b": x}, "noise": {"a": x + e}, "target": {"a": x + e, "b": x + e}}
    for side, taps in sides.items():
        with ffdebug.capture(None, dir=tmp_path, side=side):
            for key, value in taps.items():
                ffdebug.tap(key, value)
    res = ffdebug.compare(tmp_path / "ref", tmp_path / "target", noise=tmp_path / "noise")
    a, b = (next(s for s in res.stages if s.key == key) for key in ("a", "b"))
    assert a.noise_measured and a.within_noise and a.severity == "ok"
    assert b.noise_given and not b.noise_measured and b.severity == "drift" and b.within_noise is None
    assert b.notes == [
        "noise not comparable: the noise run has no record of this stage; judged without the noise run"
    ]
    assert "noise not comparable at 1 stage(s) (b): judged without the noise run" in res.notes
    assert res.verdict == "drift"


def test_json_budget_note(tmp_path, tiny_llama, input_ids):
    """The store says when FFDEBUG_FWD_DUMP_MAX_BYTES turned captures into statistics, and so does
    compare: which side, and that those stages were compared on statistics."""
    _dump(tiny_llama, input_ids, tmp_path, "ref")
    _dump(tiny_llama, input_ids, tmp_path, "target", max_bytes=20_000)
    r = CliRunner().invoke(app, ["compare", "ref-vs-target", "--dir", str(tmp_path), "--json"])
    data = json.loads(r.output)
    assert any("byte budget" in n and "target" in n for n in data["notes"])
    over = [s for s in data["stages"] if s.get("stats_only")]
    assert over and over[-1]["key"] == "final.logits" and over[-1]["severity"] == "ok"


def test_text_table_keeps_stage_keys_and_says_why(tmp_path):
    """An 80-column terminal never cuts a stage key; a NaN row says NaN."""
    from rich.console import Console

    from ffdebug.report.text import print_compare

    long_key = "L012.self_attn.rotary_emb.out.cos_cached"
    for side, v in (("ref", 1.0), ("target", float("nan"))):
        with ffdebug.capture(None, dir=tmp_path, side=side):
            ffdebug.tap(
                long_key, torch.tensor([1.0, v]), layer=12, layer_class="Qwen3MoeDecoderLayer[mlp=Sparse]"
            )
    console = Console(width=80, record=True)
    print_compare(ffdebug.compare(tmp_path / "ref", tmp_path / "target"), console=console)
    text = console.export_text()
    assert "self_attn.rotary_emb.out.cos_cached" in text and "NaN differs at 1" in text
    assert text.rstrip().endswith("FAILED") and "First divergence at layer 12" in text


def test_one_side_all_zeros_is_bug_not_scramble(tmp_path):
    """A stage that is all zeros on one side only has no direction to compare: graded bug."""
    for side, x, y in (("ref", torch.zeros(8), torch.ones(8)), ("target", torch.ones(8), torch.zeros(8))):
        d = tmp_path / side
        with ffdebug.capture(None, dir=d, side="ref"):
            ffdebug.tap("x", x)
        with ffdebug.capture(None, dir=d, side="target"):
            ffdebug.tap("x", y)
        s = ffdebug.compare(d / "ref", d / "target").stages[0]
        assert (s.severity, s.cos) == ("bug", 0.0), side


def test_exact_classifies_first_non_invariant_stage(tmp_path, tiny_llama, input_ids):
    """Run-to-run determinism (`compare --exact`): a rounding-level difference at layer 2 is
    `numerical`; a real change at layer 1 is `divergent`; identical runs pass."""
    _dump(tiny_llama, input_ids, tmp_path, "run1")
    same = _dump(copy.deepcopy(tiny_llama), input_ids, tmp_path, "run2")
    assert ffdebug.compare(tmp_path / "run1", same, exact=True, fail_on="drift").first_non_invariant is None

    wobbly = copy.deepcopy(tiny_llama)  # one ulp-scale change at layer 2: the bits differ, the band is ok
    wobbly.model.layers[2].mlp.register_forward_hook(lambda m, a, o: o * (1 + 2**-20))
    _dump(wobbly, input_ids, tmp_path, "run3")
    r = CliRunner().invoke(
        app, ["compare", str(tmp_path / "run1"), str(tmp_path / "run3"), "--exact", "--json"]
    )
    data = json.loads(r.stdout)
    assert r.exit_code == 1
    inv = data["first_non_invariant"]
    assert (inv["key"], inv["invariance"]) == ("L002.ffn_out", "numerical")

    broken = copy.deepcopy(tiny_llama)
    broken.model.layers[1].mlp.register_forward_hook(lambda m, a, o: o * 1.5)
    _dump(broken, input_ids, tmp_path, "run4")
    res = ffdebug.compare(tmp_path / "run1", tmp_path / "run4", exact=True)
    assert (res.first_non_invariant.key, res.first_non_invariant.invariance) == (
        "L001.ffn_out",
        "divergent",
    )
    from ffdebug.report.text import compare_conclusion

    assert "First non-invariant stage: layer 1, ffn_out (divergent" in compare_conclusion(res)
