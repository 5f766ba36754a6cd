"""`FFDEBUG_FWD_DUMP_MODE=sketch`: the count sketch, its rel / cos estimates, and compare on
sketch dumps (`ffdebug/count_sketch.py`, `ffdebug/comparison/sketch.py`)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import ffdebug
from ffdebug._env import read_dump_config
from ffdebug.comparison.sketch import estimate
from ffdebug.count_sketch import SKETCH_BUCKETS, sketch
from ffdebug.errors import FFDebugError


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_sketch_is_linear_and_seeded():
    a, b = _x(64, 96), _x(64, 96, seed=1)
    s = sketch(a + 3 * b)
    np.testing.assert_allclose(s, sketch(a) + 3 * sketch(b), rtol=0, atol=1e-9)
    assert s.shape == (SKETCH_BUCKETS,)
    assert not np.array_equal(sketch(a, seed=0), sketch(a, seed=1))
    # each element lands in exactly one bucket with sign ±1: a one-hot tensor's sketch is ±1 once
    one = torch.zeros(5000, dtype=torch.float64)
    one[4321] = 1.0
    hot = sketch(one)
    assert sorted(np.abs(hot).tolist())[-2:] == [0.0, 1.0]


@pytest.mark.parametrize("scale", [1e-3, 0.05, 0.5])
def test_estimate_recovers_rel_and_cos(scale):
    """t = r + scale · noise: rel = scale · ‖noise‖ / ‖r‖ exactly; the sketch estimate is within
    4 standard spreads (√(2/1024) ≈ 4.4 % relative on ‖d‖², so ~2.2 % on ‖d‖)."""
    r, d = _x(128, 256), _x(128, 256, seed=7)
    t = r + scale * d
    true_rel = float((t - r).norm() / r.norm())
    true_cos = float((r * t).sum() / (r.norm() * t.norm()))
    est = estimate(sketch(r), sketch(t), float(r.norm()), float(t.norm()))
    assert abs(est.rel / true_rel - 1) < 4 * math.sqrt(2 / SKETCH_BUCKETS) / 2
    assert abs(est.cos - true_cos) <= 2 * (1 - true_cos) * 0.1 + 1e-12
    assert not est.equal


def test_permutation_with_equal_statistics_is_seen():
    """A rotary-style swap of halves keeps mean, std and norm exactly; the sketch sees rel ~ √2."""
    r = _x(8, 64)
    t = torch.cat([r[:, 32:], r[:, :32]], dim=1)
    assert float(t.norm()) == pytest.approx(float(r.norm()), rel=1e-12)
    est = estimate(sketch(r), sketch(t), float(r.norm()), float(t.norm()))
    true_rel = float((t - r).norm() / r.norm())
    assert est.rel == pytest.approx(true_rel, rel=0.15) and est.rel > 1.0
    assert est.cos < 0.5


def test_capture_and_compare_sketch_dumps(tmp_path, monkeypatch):
    """A sketch dump keeps the tensor's shape and statistics and a 4 KiB payload; compare grades
    the estimate: a permuted tensor with equal statistics is not ok."""
    r = _x(16, 512).float()
    t = torch.cat([r[:, 256:], r[:, :256]], dim=1)
    for side, tensor in (("ref", r), ("target", t)):
        with ffdebug.capture(dir=str(tmp_path), side=side, mode="sketch"):
            ffdebug.tap("L000.hidden_out", tensor, layer=0)
    from ffdebug.store.reader import open_side

    rec = next(x for x in open_side(str(tmp_path / "ref")).records if x.key == "L000.hidden_out")
    assert list(rec.shape) == [16, 512] and rec.extra["sketch"] == {"seed": 0, "buckets": 1024}
    assert tuple(rec.load().shape) == (1024,) and rec.load().dtype == np.float32
    result = ffdebug.compare(str(tmp_path / "ref"), str(tmp_path / "target"))
    stage = next(e for e in result.stages if e.key == "L000.hidden_out")
    assert stage.rel > 1.0 and stage.severity == "scramble"
    assert any("1024-bucket sketch" in n for n in stage.notes)


def test_sketch_mode_env(monkeypatch):
    cfg = read_dump_config(
        {
            "FFDEBUG_FWD_DUMP_DIR": "/tmp/x",
            "FFDEBUG_FWD_DUMP_MODE": "sketch",
            "FFDEBUG_FWD_DUMP_SKETCH_SEED": "7",
        }
    )
    assert (cfg.mode, cfg.sketch_seed) == ("sketch", 7)
    with pytest.raises(
        FFDebugError, match="FFDEBUG_FWD_DUMP_MODE='fast' is invalid: use 'full', 'stats' or 'sketch'"
    ):
        read_dump_config({"FFDEBUG_FWD_DUMP_DIR": "/tmp/x", "FFDEBUG_FWD_DUMP_MODE": "fast"})
