"""`ffdebug demo` runs the main job end to end and locates the injected bug."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from ffdebug.cli.app import app

pytestmark = pytest.mark.integration  # every test here spawns a process, runs a trainer or kills one


def test_demo_locates_injected_bug(tmp_path):
    r = CliRunner().invoke(app, ["demo", "--dir", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    first = data["first_divergence"]
    assert (first["layer"], first["layer_class"], first["stage"]) == (1, "moe", "ffn_out")
    assert data["demo"]["located"] is True
    # the dense layer and everything before the first MoE block match bit for bit
    before = [s for s in data["stages"] if s["layer"] == 0 or s["key"].startswith("embed.")]
    assert before and all(s["bit_equal"] == 1.0 for s in before)
    assert (tmp_path / "ref" / "run.json").exists() and (tmp_path / "target" / "run.json").exists()
