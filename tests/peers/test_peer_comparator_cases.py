"""SGLang's comparator test cases (its `test/registered/debug_utils/comparator/`: the tensor
comparator, the dump comparator and the e2e demo), each written as two SGLang dumper runs and
compared by ffdebug. `sglang` is what SGLang's own tests expect (pass = its exit 0); ffdebug
"passes" when `compare` exits 0 at the default `--fail-on`. The one-element offset, the
`max_abs` / `atol` threshold terms and the size-1-dim unification agree through the element-wise
criterion and shape unification (docs/comparing.md "Comparing"). docs/peer-dumps.md "Peer dumps" lists the agreement case
by case.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers.peers.peer_layouts import SGLangRun
from typer.testing import CliRunner

from ffdebug.cli.app import app


def _ones_offset():
    t = torch.ones(10, 10)
    t[3, 7] = 1.5
    return torch.ones(10, 10), t


def _seeded(fn):
    torch.manual_seed(0)
    return fn()


def _noise(n, scale):
    return lambda: (lambda x: (x, x + scale * torch.randn(*n)))(torch.randn(*n))


SIGN = torch.tensor([1e-5, -1e-5, 1e-5, -1e-5])
CASES = [
    ("identical", lambda: (torch.ones(10, 10), torch.ones(10, 10)), (), True),
    pytest.param("known_offset_1elem", _ones_offset, (), False),
    ("rel_diff_value_orthogonal", lambda: (torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])), (), False),
    ("near_zero_sign_flip", lambda: (SIGN, -SIGN), (), False),
    pytest.param("near_zero_sign_flip_atol", lambda: (SIGN, -SIGN), ("*:max_abs<=1e-4",), True),
    (
        "real_magnitude_1elem",
        lambda: (torch.ones(10), torch.ones(10).index_fill(0, torch.tensor([0]), 2.0)),
        (),
        False,
    ),
    ("small_both_1e-4", lambda: (torch.ones(10), torch.ones(10) + 1e-4), (), True),
    ("boundary_max_abs_0.5", lambda: (torch.ones(2), torch.full((2,), 1.5)), (), False),
    pytest.param(
        "boundary_max_abs_0.5_atol", lambda: (torch.ones(2), torch.full((2,), 1.5)), ("*:max_abs<=0.5",), True
    ),
    pytest.param(
        "shape_unify_1x1x4x8_vs_4x8",
        lambda: (lambda x: (x.reshape(1, 1, 4, 8), x))(torch.randn(4, 8)),
        (),
        True,
    ),
    ("shape_mismatch_3x4_vs_5x6", lambda: (torch.randn(3, 4), torch.randn(5, 6)), (), False),
    ("dtype_f32_vs_bf16_same_values", lambda: (lambda x: (x, x.bfloat16()))(torch.randn(8, 16)), (), True),
    ("e2e_good_1e-5_noise", _noise((4, 8), 1e-5), (), True),
    ("e2e_bad_unrelated_x100", lambda: (torch.randn(4, 8), 100 * torch.randn(4, 8)), (), False),
    ("old_ones_plus_0.5", lambda: (torch.ones(10, 10), torch.ones(10, 10) + 0.5), (), False),
    ("old_e2e_noise_0.01", _noise((10, 10), 0.01), (), True),
]


@pytest.mark.parametrize("case, make, thresholds, sglang_passes", CASES)
def test_sglang_comparator_case(tmp_path, case, make, thresholds, sglang_passes):
    ref, tgt = _seeded(make)
    SGLangRun(tmp_path / "baseline").dump("x", ref)
    SGLangRun(tmp_path / "target").dump("x", tgt)
    args = ["compare", str(tmp_path / "baseline"), str(tmp_path / "target"), "--json"]
    for t in thresholds:
        args += ["--threshold", t]
    r = CliRunner().invoke(app, args)
    assert (r.exit_code == 0) == sglang_passes, r.output
    if r.exit_code in (0, 1):
        stage = json.loads(r.stdout)["stages"][0]
        if case == "old_ones_plus_0.5":
            assert stage["max_abs"] == pytest.approx(0.5)  # SGLang's expected max_abs
        if case == "old_e2e_noise_0.01":
            assert stage["max_abs"] == pytest.approx(float((tgt - ref).abs().max()))
