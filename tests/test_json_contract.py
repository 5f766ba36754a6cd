"""The `--json` contract: every key the README documents for compare, bisect, weights-diff and
inspect is present with its type, on the demo's dumps. Keys beyond the documented ones are listed
here, so each addition is deliberate (and a removal fails)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from ffdebug.cli.app import app

NUM = (int, float)
OPT_NUM = (int, float, type(None))
OPT_STR = (str, type(None))
OPT_INT = (int, type(None))
SEVERITIES = {"ok", "drift", "diverge", "bug", "scramble"}

COMPARE_TOP = {
    # documented
    "verdict": str,
    "stages": list,
    "first_divergence": (dict, type(None)),
    # extras
    "first_non_invariant": (dict, type(None)),
    "ref": str,
    "target": str,
    "only_ref": list,
    "only_target": list,
    "warmup_skipped": int,
    "unpaired_calls": dict,
    "notes": list,
    "stats_only": bool,
    "fail_on": str,
    "passed": bool,
    "complete": bool,
    "coverage": dict,
    "allow_partial": bool,
    "shards": list,
}
COVERAGE = {
    "paired": int,
    "kinds": list,
    "only_ref": list,
    "only_target": list,
    "final_compared": bool,
    "sides": dict,
    "ranks": dict,
    "calls": dict,
    "stats_only": int,
    "selected_out": list,
    "unified_shapes": list,
    "missing": list,
}
STAGE_KEYS = {
    # documented
    "key": str,
    "layer": OPT_INT,
    "layer_class": OPT_STR,
    "severity": str,
    "cos": OPT_NUM,
    "rel": OPT_NUM,
    "rel_diff": OPT_NUM,
    "max_abs": OPT_NUM,
    "max_abs_at": (list, type(None)),
    "shape_ref": list,
    "shape_target": list,
    # extras, always present
    "stage": str,
    "io": OPT_STR,
    "call": OPT_INT,
    "invocation": (int, str),
    "rank": int,
    "step": dict,
    "phase": OPT_STR,
    "dtype_ref": OPT_STR,
    "dtype_target": OPT_STR,
    "elem": OPT_NUM,
    "mean_abs": OPT_NUM,
    "norm_ratio": OPT_NUM,
    "bit_equal": OPT_NUM,
    "notes": list,
}
# present only when they apply (logits metrics on final.logits, --exact, --noise, folded ranks …)
STAGE_OPTIONAL = {
    "logits",
    "invariance",
    "noise_rel",
    "within_noise",
    "beyond_noise",
    "unified_shape",
    "max_abs_where",
    "per_token_rel",
    "per_head_rel",
    "rise_from",
    "token_runs",
    "token_runs_left_out",
    "finding",
    "stats_only",
    "nan_mismatch",
    "inf_mismatch",
    "unsharded_ref",
    "unsharded_target",
    "severity_rank0",
}
BISECT_TOP = {
    # documented
    "verdict": str,
    "first_divergence": (dict, type(None)),
    "pattern": str,
    "per_class": list,
    "sub_stage": (dict, type(None)),
    "missing_inside": list,
    # extras
    "reason": str,
    "saturated_after": OPT_INT,
    "decided": bool,
    "signal": OPT_STR,
    "judgement": str,
    "layers": list,
    "call": dict,
    "calls": list,
    "shards": list,
    "attribution": (list, type(None)),
    "warmup_skipped": int,
    "stages": list,
    "ref": str,
    "target": str,
    "notes": list,
    "fail_on": str,
    "passed": bool,
    "complete": bool,
    "coverage": dict,
    "allow_partial": bool,
    "conclusion": str,
}
FIRST_DIVERGENCE = {
    "layer": OPT_INT,
    "layer_class": OPT_STR,
    "stage": str,
    "key": str,
    "severity": str,
    "cos": OPT_NUM,
    "rel": OPT_NUM,
}
SUB_STAGE = {"stage": str, "key": str, "severity": str, "cos": OPT_NUM, "rel": OPT_NUM, "why": str}
PER_CLASS = {
    "layer_class": str,
    "layers": list,
    "first_bad_layer": OPT_INT,
    "first_over_threshold": OPT_INT,
    "introducing": list,
    "max_added": OPT_NUM,
}
LAYER_ROW = {
    "layer": int,
    "layer_class": OPT_STR,
    "rel_in": OPT_NUM,
    "rel_out": OPT_NUM,
    "cos_in": OPT_NUM,
    "cos_out": OPT_NUM,
    "added": OPT_NUM,
    "severity": str,
    "exact_in": bool,
    "exact_out": bool,
    "noise_added": OPT_NUM,
    "noise_rel_out": OPT_NUM,
    "local": OPT_STR,
    "local_rel": OPT_NUM,
    "judged": bool,
    "introduces": bool,
    "beyond_precision": bool,
    "precision_budget": OPT_NUM,
    "max_step": OPT_NUM,
    "max_step_key": OPT_STR,
    "scale_step": OPT_NUM,
    "scale_step_key": OPT_STR,
    "scale_out": OPT_NUM,
    "notes": list,
}
WEIGHTS_TOP = {
    # documented
    "verdict": str,
    "only_ref": list,
    "only_target": list,
    "shape_mismatch": list,
    "dtype_mismatch": list,
    "renames": list,
    "tensors": list,
    # extras
    "passed": bool,
    "schema_clean": bool,
    "fail_on": str,
    "allow_dtype": bool,
    "apply": OPT_STR,
    "ref": dict,
    "target": dict,
    "skipped": list,
    "dequantized": list,
    "replica_mismatch": list,
    "schema_only": bool,
    "notes": list,
    "buffers_not_in_checkpoint": list,
    "restricted": list,
    "content": (dict, type(None)),  # content matching's plan (docs/weights-diff.md)
    "warnings": list,
}
TENSOR_KEYS = {
    "name": str,
    "severity": str,
    "finding": str,
    "byte_equal": bool,
    "cos": OPT_NUM,
    "rel": OPT_NUM,
    "max_abs": OPT_NUM,
    "shape_ref": list,
    "shape_target": list,
    "dtype_ref": str,
    "dtype_target": str,
}
TENSOR_OPTIONAL = {
    "rel_diff",
    "norm_ratio",
    "max_abs_at",
    "bit_equal",
    "notes",
    "after_transpose",
    "scale_factor",
    "transformed",
    "layer",
    "dequantized",
    "tp",
    "origin",
    "layout",
}
INSPECT_TOP = {
    "path": str,
    "kind": str,
    "side": str,
    "records": int,
    "complete": bool,
    "incomplete_lines": int,
    "status": dict,
    "manifest_only": bool,
    "disagreeing": int,
    "problems": list,  # what an importer could not take in (docs/peer-dumps.md "Peer dumps")
    "tensors": list,
}
INSPECT_TENSOR = {
    "key": str,
    "layer": OPT_INT,
    "io": OPT_STR,
    "call": OPT_INT,
    "step": dict,
    "rank": int,
    "dtype": str,
    "shape": list,
    "stats": (dict, type(None)),
    "payload": bool,
    "checked": bool,
    "disagreements": list,
}
# a failing --json run: the one document on stdout (docs/cli.md "CLI conventions")
ERROR_TOP = {"error": dict}
ERROR = {"exit_code": int, "message": str, "hint": OPT_STR, "where": OPT_STR}


def check(obj: dict, required: dict, optional: set = frozenset(), where: str = "") -> None:
    """`obj` has exactly the required keys (with their types) plus some of the optional ones."""
    missing = set(required) - set(obj)
    assert not missing, f"{where}: documented keys missing: {sorted(missing)}"
    extra = set(obj) - set(required) - set(optional)
    assert not extra, f"{where}: keys not in the contract (add them here on purpose): {sorted(extra)}"
    for key, types in required.items():
        assert isinstance(obj[key], types), f"{where}.{key}: {type(obj[key]).__name__}, expected {types}"


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    from ffdebug.demo import dump_both_sides

    d = tmp_path_factory.mktemp("demo")
    dump_both_sides(str(d))
    return d


def run_json(*args: str) -> tuple[int, dict]:
    r = CliRunner().invoke(app, list(args))
    return r.exit_code, json.loads(r.stdout)


@pytest.mark.integration
def test_compare_json_contract(demo_dir):
    code, data = run_json(
        "compare", "ref-vs-target", "--dir", str(demo_dir), "--json", "--noise", str(demo_dir / "ref")
    )
    assert code == 1
    check(data, COMPARE_TOP, optional={"generation_diverged"}, where="compare")
    assert data["verdict"] in SEVERITIES and data["stages"]
    for s in data["stages"]:
        check(s, STAGE_KEYS, STAGE_OPTIONAL, where=f"compare.stages[{s['key']}]")
        assert s["severity"] in SEVERITIES
    assert "noise_rel" in data["stages"][0]  # a noise run was given: every stage reports it
    check(data["first_divergence"], STAGE_KEYS, STAGE_OPTIONAL, where="compare.first_divergence")
    check(data["coverage"], COVERAGE, where="compare.coverage")
    for kind in data["coverage"]["kinds"]:
        check(kind, {"kind": str, "ref": int, "target": int, "paired": int}, where="coverage.kinds")
    for side in ("ref", "target"):
        check(
            data["coverage"]["sides"][side],
            {"finished": (bool, type(None)), "ranks": list, "over_budget": int, "problems": list},
        )
    check(data["coverage"]["ranks"], {"compared": list, "missing": list}, where="coverage.ranks")
    check(data["coverage"]["calls"], {"only_ref": list, "only_target": list}, where="coverage.calls")
    assert data["complete"] is True and data["coverage"]["missing"] == []


@pytest.mark.integration
def test_bisect_json_contract(demo_dir):
    code, data = run_json("bisect", "--dir", str(demo_dir), "--json")
    assert code == 1
    check(data, BISECT_TOP, optional={"generation_diverged"}, where="bisect")
    assert data["pattern"] in {"match", "drift", "jump", "layer_class", "undetermined"}
    assert data["verdict"] == data["judgement"]  # one rule: a bug signal raises both
    assert data["verdict"] in SEVERITIES and data["judgement"] in SEVERITIES
    check(data["first_divergence"], FIRST_DIVERGENCE, where="bisect.first_divergence")
    check(data["sub_stage"], SUB_STAGE, where="bisect.sub_stage")
    for c in data["per_class"]:
        check(c, PER_CLASS, where="bisect.per_class")
    for row in data["layers"]:
        check(row, LAYER_ROW, where="bisect.layers")
    for c in data["calls"]:
        check(c, {"call": OPT_INT, "step": dict, "pattern": str, "verdict": str}, where="bisect.calls")
    check(data["call"], {"call": OPT_INT, "step": dict}, where="bisect.call")
    check(data["coverage"], COVERAGE, where="bisect.coverage")
    assert data["conclusion"].endswith("FAILED")


def test_weights_diff_json_contract(tmp_path):
    import torch
    from safetensors.torch import save_file

    from ffdebug.demo import build_model

    state = {k: v.contiguous() for k, v in build_model().state_dict().items()}
    save_file(state, str(tmp_path / "a.safetensors"))
    name = next(k for k in state if k.endswith("down_proj.weight"))
    state[name] = state[name] * 0.5
    state[next(k for k in state if k.endswith("q_a_proj.weight") or k.endswith("q_proj.weight"))] += (
        1e-3 * torch.ones(())
    )
    save_file(state, str(tmp_path / "b.safetensors"))
    code, data = run_json(
        "weights-diff", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"), "--json"
    )
    assert code == 1
    check(data, WEIGHTS_TOP, where="weights-diff")
    for t in data["tensors"]:
        check(t, TENSOR_KEYS, TENSOR_OPTIONAL, where=f"weights-diff.tensors[{t['name']}]")
    assert {t["finding"] for t in data["tensors"]} >= {"equal", "scaled"}


@pytest.mark.integration
def test_inspect_json_contract(demo_dir):
    code, data = run_json("inspect", str(demo_dir / "ref"), "--json")
    assert code == 0
    check(data, INSPECT_TOP, where="inspect")
    for t in data["tensors"]:
        check(t, INSPECT_TENSOR, where=f"inspect.tensors[{t['key']}]")


@pytest.mark.parametrize(
    "args,code",
    [
        (("compare", "ref-vs-target", "--dir", "/nonexistent/dumps", "--json"), 2),
        (("weights-diff", "a.safetensors", "--json", "--fail-on", "nope"), 2),
    ],
    ids=["bad-input", "usage"],
)
def test_error_json_contract(args, code):
    r = CliRunner().invoke(app, list(args))
    data = json.loads(r.stdout)
    assert r.exit_code == code and r.stderr.startswith("ffdebug: error: ")
    check(data, ERROR_TOP, where="error")
    check(data["error"], ERROR, where="error.error")
    assert data["error"]["exit_code"] == code and data["error"]["message"] in r.stderr
