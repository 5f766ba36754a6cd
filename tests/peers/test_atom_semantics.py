"""ATOM's dump semantics, through ffdebug's ATOM_* aliases, with our expected results, and ATOM's
compare severity table against ffdebug's bands. Where we differ on purpose the test says so."""

from __future__ import annotations

import pytest
import torch
from helpers.peers.peer_layouts import atom_hook
from torch import nn

import ffdebug
from ffdebug.capture.state import active_session
from ffdebug.store.reader import open_side
from ffdebug.verdict import Severity, band


class Block(nn.Module):  # ATOM_FWD_DUMP_BLOCK_CLASS's default class name
    def __init__(self, idx):
        super().__init__()
        self.idx = 10 + idx  # a layer attribute that is not the position: LAYER_ATTR must be read
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return x + self.lin(x)


class Other(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block(i) for i in range(6))
        self.other = nn.ModuleList(Other() for _ in range(2))

    def forward(self, x):
        for m in [*self.layers, *self.other]:
            x = m(x)
        return x


def _dump(tmp_path, monkeypatch, **env):
    monkeypatch.setenv("ATOM_FWD_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("ATOM_FWD_DUMP_BLOCK_CLASS", "Block")
    monkeypatch.setenv("ATOM_FWD_DUMP_LAYER_ATTR", "idx")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    torch.manual_seed(0)
    model = Model()
    handle = ffdebug.install(model)
    with torch.no_grad():
        model(torch.randn(3, 4))  # call 0 (ATOM's one-shot keeps this one: usually the warm-up)
        model(torch.randn(5, 4))  # call 1
    handle.remove()
    active_session().close()
    return open_side(tmp_path / "target")


def test_layers_block_class_layer_attr_and_one_shot(tmp_path, monkeypatch):
    """ATOM_FWD_DUMP_LAYERS takes ranges and negatives here (ATOM's own parser takes a plain CSV:
    `2-3` or `-1` would raise there; we differ on purpose). Layer ids come from LAYER_ATTR (10..15),
    `-1` counts from the last of them; only BLOCK_CLASS modules are hooked; ONE_SHOT=1 keeps call 0."""
    store = _dump(tmp_path, monkeypatch, ATOM_FWD_DUMP_LAYERS="10,12-13,-1", ATOM_FWD_DUMP_ONE_SHOT="1")
    assert sorted({r.layer for r in store.records if r.layer is not None}) == [10, 12, 13, 15]
    assert {r.module_class for r in store.records if r.key.endswith(".hidden_out")} == {"Block"}
    assert len([r for r in store.records if r.key.endswith(".hidden_out")]) == 4  # `Other` is not hooked
    assert {r.call for r in store.records} == {0}
    assert all(r.shape[0] == 3 for r in store.records if r.layer is not None)


def test_one_shot_0_dumps_every_call_and_stats_only_writes_statistics(tmp_path, monkeypatch):
    store = _dump(tmp_path, monkeypatch, ATOM_FWD_DUMP_ONE_SHOT="0", ATOM_FWD_DUMP_STATS_ONLY="1")
    assert {r.call for r in store.records} == {0, 1}
    blocks = [r for r in store.records if r.layer is not None]
    assert blocks and all(not r.has_payload and r.stats for r in blocks)


def test_atom_stats_only_files_are_read_as_statistics(tmp_path):
    """ATOM_FWD_DUMP_STATS_ONLY files ({shape, dtype, numel, ..., mean, std, min, max}) are
    records with statistics and no payload, compared on their statistics."""
    d = tmp_path / "atom"
    d.mkdir()
    atom_hook(d, 1, "Block", 0, torch.ones(2, 3))
    torch.save(
        {
            "shape": (2, 3),
            "dtype": "torch.float32",
            "numel": 6,
            "finite_ratio": 1.0,
            "zero_ratio": 0.0,
            "mean": 0.5,
            "std": 0.1,
            "min": 0.0,
            "max": 1.0,
        },
        d / "layer02_Block_rank0.pt",
    )
    recs = {r.key: r for r in open_side(str(d)).records}
    assert recs["L001.hidden_out"].has_payload
    stats = recs["L002.hidden_out"]
    assert not stats.has_payload and stats.stats["mean"] == 0.5 and stats.shape == (2, 3)


# ATOM compare.py `flag_for(cos, rel)` (rel = max|a-b| / max|b|): ✓ cos > 0.9999 and rel < 0.01;
# ? cos > 0.999; ✗ cos > 0.99; ✗✗ otherwise. ffdebug's bands use rel = ‖t-r‖/‖r‖ and fail at
# `diverge`, so ATOM's ? and ✗ (both exit 0 in ATOM, which never fails) are drift here, and ATOM's
# ✗✗ splits into diverge / bug / scramble.
@pytest.mark.parametrize(
    "cos, rel, atom_flag, ours",
    [
        (0.99995, 0.005, "✓", Severity.OK),
        (0.9995, 0.02, "?", Severity.DRIFT),
        (0.995, 0.05, "✗", Severity.DRIFT),
        (0.95, 0.2, "✗✗", Severity.DIVERGE),
        (0.7, 0.6, "✗✗", Severity.BUG),
        (-1.0, 2.0, "✗✗", Severity.SCRAMBLE),
    ],
)
def test_atom_severity_table_against_our_bands(cos, rel, atom_flag, ours):
    assert band(cos, rel) == ours
