"""`ffdebug trace` names the module output a tap is: same storage, a view, a bit-equal copy, none."""

from __future__ import annotations

import json

import pytest
from helpers import TESTS
from typer.testing import CliRunner

from ffdebug.cli.app import app
from ffdebug.trace import trace
from ffdebug.trace_sources import OutputIndex

TARGET = str(TESTS / "helpers" / "review" / "trace_sources_target.py")


def _sources(result) -> dict[str, tuple]:
    return {r.name: (r.source.relation, r.source.modules) for r in result.rows if r.source is not None}


def test_each_tap_is_named_by_its_relation_to_the_module_outputs():
    result = trace(f"{TARGET}:one_step")
    assert result.error is None
    got = _sources(result)
    assert got["features.layer1"] == ("same", ("Stack.layers.1", "Stack[1]"))
    # the producer first, then the parent that returned it in its tuple
    assert got["features.last"] == ("same", ("Stack.norm", "Stack[3]"))
    assert got["features.first_token"][0] == "view"
    assert got["features.first_token"][1][0] == "Stack.layers.0"
    assert got["features.copy"] == ("equal", ("Stack.layers.2", "Stack[2]"))
    assert got["features.sum"] == (None, ())
    assert got["return.last"] == ("same", ("Stack.norm", "Stack[3]"))
    row = next(r for r in result.rows if r.name == "features.last")
    assert row.source.describe() == "the output of Stack.norm (also Stack[3])"
    none = next(r for r in result.rows if r.name == "features.sum")
    assert none.source.describe().startswith("no module output equals it (")
    assert 0 < result.held_peak_mib < 1


def test_the_budget_bounds_what_is_held_and_says_what_it_dropped():
    off = trace(f"{TARGET}:one_step", match_budget_mib=0)
    assert {relation for relation, _ in _sources(off).values()} == {None}
    assert off.held_peak_mib == 0
    # room for about two of the 320-byte outputs: the early ones are dropped, counted
    small = trace(f"{TARGET}:one_step", match_budget_mib=700 / 2**20)
    assert small.held_peak_mib * 2**20 <= 700
    layer1 = next(r for r in small.rows if r.name == "features.layer1")
    assert layer1.source.relation is None and layer1.source.dropped > 0
    assert "dropped by the memory budget" in layer1.source.describe()


def test_index_counts_a_shared_storage_once():
    import torch

    index = OutputIndex(10_000)
    x = torch.zeros(100)  # 400 bytes
    index.add("a", x)
    index.add("b", x[:10])  # the same storage
    assert index.held_bytes == 400
    index.add("c", torch.ones(100))
    assert index.held_bytes == 800
    with pytest.raises(ValueError, match="budget_bytes"):
        OutputIndex(-1)


def test_cli_prints_where_taps_come_from_and_json_keeps_it():
    runner = CliRunner()
    r = runner.invoke(app, ["trace", f"{TARGET}:one_step"])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "where the taps come from" in text
    assert "features.last the output of Stack.norm (also Stack[3])" in text
    r = runner.invoke(app, ["trace", f"{TARGET}:one_step", "--json"])
    out = json.loads(r.output)
    rows = {row["name"]: row for row in out["rows"]}
    assert rows["features.copy"]["source"]["relation"] == "equal"
    assert rows["Stack.norm"]["source"] is None
    assert out["match_budget_mib"] == 512
    r = runner.invoke(app, ["trace", f"{TARGET}:one_step", "--match-memory", "-1"])
    assert r.exit_code == 2 and "--match-memory" in r.output


def test_equal_means_the_same_bits():
    import torch

    index = OutputIndex(10_000)
    out = torch.tensor([1.0, float("nan"), -0.0])
    index.add("m", out)
    assert index.match(out.clone()).relation == "equal"  # a NaN copy is its output's copy
    assert index.match(torch.tensor([1.0, float("nan"), 0.0])).relation is None  # -0.0 is not 0.0
    index.add("empty", torch.zeros(0, 4))
    assert index.match(torch.zeros(0, 4)).relation is None  # an empty tensor equals nothing


def test_tensors_without_a_plain_storage_are_skipped_not_raised(monkeypatch):
    import torch

    import ffdebug.trace_sources as ts

    index = OutputIndex(10_000)
    nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    index.add("nested", nested)
    assert index.match(nested).relation is None and index.match(torch.zeros(2)).relation is None
    monkeypatch.setattr(ts, "MAX_HELD", 3)
    for i in range(5):
        index.add(f"e{i}", torch.zeros(0))
    assert index.match(torch.zeros(1)).held == 3 and index.dropped == 2
