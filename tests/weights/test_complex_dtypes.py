"""Complex tensors in weights-diff and load-audit: a complex tensor against a real one of the same name
is the finding ``dtype_kind`` (bug, both dtypes named, not measured), in either order, as text and as
JSON, never a traceback; complex against complex is compared on its real and imaginary parts."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.weights.weights_utils import run_cli
from safetensors.torch import save_file

AUDIT_MODULE = '''
import torch


def build(checkpoint):
    """A Linear whose weight the checkpoint stores as complex: the real tensor stays at its init."""
    torch.manual_seed(0)
    return torch.nn.Linear(4, 4)
'''


def _checkpoints(tmp_path):
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(4, 4, generator=g), torch.randn(4, generator=g)
    save_file({"weight": weight, "bias": bias}, tmp_path / "real.safetensors")
    save_file({"weight": weight.to(torch.complex64), "bias": bias}, tmp_path / "c64.safetensors")
    # safetensors has no complex128; a weights-only .pt has
    torch.save({"weight": weight.to(torch.complex128), "bias": bias}, tmp_path / "c128.pt")
    return tmp_path / "real.safetensors", {
        "complex64": tmp_path / "c64.safetensors",
        "complex128": tmp_path / "c128.pt",
    }


@pytest.mark.parametrize("kind", ["complex64", "complex128"])
@pytest.mark.parametrize("order", ["real_first", "complex_first"])
@pytest.mark.parametrize("as_json", [False, True])
def test_weights_diff_of_complex_against_real_is_a_dtype_kind_finding(
    tmp_path, monkeypatch, kind, order, as_json
):
    monkeypatch.setenv("COLUMNS", "200")  # the table's cells unwrapped
    real, complex_ = _checkpoints(tmp_path)
    a, b = (real, complex_[kind]) if order == "real_first" else (complex_[kind], real)
    r = run_cli("weights-diff", a, b, *(["--json"] if as_json else []))
    assert r.exit_code == 1, (r.exit_code, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr + r.stdout
    dtypes = ("float32", kind) if order == "real_first" else (kind, "float32")
    if as_json:
        rows = {t["name"]: t for t in json.loads(r.stdout)["tensors"]}
        weight = rows["weight"]
        assert (weight["finding"], weight["severity"]) == ("dtype_kind", "bug")
        assert (weight["dtype_ref"], weight["dtype_target"]) == dtypes and weight["cos"] is None
        assert f"{dtypes[0]} (ref) vs {dtypes[1]} (target)" in " ".join(weight["notes"])
        assert rows["bias"]["finding"] == "equal"
    else:
        assert "│ ✗ bug " in r.stdout and " dtype_kind │ weight │" in r.stdout and "FAILED" in r.stdout


def test_complex_against_complex_is_measured_on_both_parts(tmp_path):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(4, 4, dtype=torch.complex64, generator=g)
    save_file({"weight": w}, tmp_path / "a.safetensors")
    save_file({"weight": w}, tmp_path / "same.safetensors")
    save_file({"weight": w * 1j}, tmp_path / "rotated.safetensors")  # same |w|, other parts
    same = json.loads(
        run_cli("weights-diff", tmp_path / "a.safetensors", tmp_path / "same.safetensors", "--json").stdout
    )
    assert same["tensors"][0]["finding"] == "equal"
    r = run_cli("weights-diff", tmp_path / "a.safetensors", tmp_path / "rotated.safetensors", "--json")
    assert r.exit_code == 1 and json.loads(r.stdout)["tensors"][0]["severity"] != "ok"


@pytest.mark.parametrize("kind", ["complex64", "complex128"])
@pytest.mark.parametrize("as_json", [False, True])
def test_load_audit_of_a_complex_checkpoint_against_a_real_model_names_the_tensor(
    tmp_path, monkeypatch, kind, as_json
):
    monkeypatch.setenv("COLUMNS", "200")
    (tmp_path / "complex_model.py").write_text(AUDIT_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    _, complex_ = _checkpoints(tmp_path)
    r = run_cli("load-audit", "complex_model:build", complex_[kind], *(["--json"] if as_json else []))
    assert r.exit_code in (1, 2), (r.exit_code, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr + r.stdout
    out = r.stdout if r.exit_code == 1 else r.stderr
    if r.exit_code == 2:  # one line naming the tensor and both dtypes
        assert len(r.stderr.strip().splitlines()) == 1 and "weight" in out and kind in out
    elif as_json:
        rows = {t["name"]: t for t in json.loads(out)["value_mismatch"]}
        assert (rows["weight"]["finding"], rows["weight"]["severity"]) == ("dtype_kind", "bug")
        assert f"float32 (ref) vs {kind} (target)" in rows["weight"]["notes"][0]
    else:
        assert " dtype_kind │ weight │" in out and f"float32→{kind}" in out
