"""weights-diff / load-audit on bad input: exit 2 and one line naming the file and the fix."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from helpers.weights.weights_utils import run_cli


class NotATensor:
    """A class a weights-only unpickler must refuse to build."""

    def __init__(self):
        self.payload = torch.zeros(2)


def _one_line_error(r, *needles):
    assert r.exit_code == 2, (r.exit_code, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("ffdebug: error: ")
    for n in needles:
        assert str(n) in lines[0], (n, lines[0])
    assert "Traceback" not in r.stderr and not r.stdout.strip()


def test_truncated_safetensors(hf_dir, tmp_path):
    data = (hf_dir / "model.safetensors").read_bytes()
    bad = tmp_path / "truncated.safetensors"
    bad.write_bytes(data[: len(data) // 2])
    _one_line_error(run_cli("weights-diff", hf_dir, bad), bad, "truncated")


def test_garbage_safetensors_and_pt(hf_dir, tmp_path):
    bad = tmp_path / "garbage.safetensors"
    bad.write_bytes(b"\x00\x01not a safetensors file" * 10)
    _one_line_error(run_cli("weights-diff", bad, hf_dir), bad)
    pt = tmp_path / "garbage.pt"
    pt.write_bytes(b"PK\x03\x04 broken zip" * 10)
    _one_line_error(run_cli("weights-diff", hf_dir, pt), pt)


def test_non_weights_only_pickle_is_refused_not_run(hf_dir, tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"weight": torch.zeros(2), "obj": NotATensor()}, path)
    r = run_cli("weights-diff", hf_dir, path)
    # torch's message is many sentences with ANSI bold: keep the one naming the class, and our fix.
    _one_line_error(r, path, "weights-only", "NotATensor", "re-save it")
    assert "\x1b" not in r.stderr and "[1m" not in r.stderr and "do those steps" not in r.stderr

    legacy = tmp_path / "legacy.bin"
    with open(legacy, "wb") as f:
        pickle.dump(NotATensor(), f, protocol=2)
    r = run_cli("weights-diff", legacy, hf_dir)
    _one_line_error(r, legacy)


def test_index_with_missing_shard(hf_dir, tmp_path):
    from transformers import LlamaForCausalLM

    LlamaForCausalLM.from_pretrained(hf_dir).save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / "sharded" / victim).unlink()
    _one_line_error(run_cli("weights-diff", hf_dir, tmp_path / "sharded"), victim, "missing")


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--tp-merge", "rows"], "--tp-merge"),
        (["--dequant", "fp4"], "--dequant"),
        (["--map", "no-equals-sign"], "--map"),
        (["--map", "(=x"], "invalid regular expression"),
        (["--fuse", "qkv"], "--fuse"),
        (["--stack", "experts.w13=experts.w1+experts.w3"], "{E}"),
        (["--transform", "*.w=nosuchmodule_xyz:fn"], "cannot import"),
        (["--layers", "a-b"], "--layers"),
        (["--fail-on", "ok"], "--fail-on"),
    ],
)
def test_bad_options(hf_dir, extra, needle):
    _one_line_error(run_cli("weights-diff", hf_dir, hf_dir, *extra), needle)


def test_missing_paths_and_entries(hf_dir, tmp_path):
    _one_line_error(run_cli("weights-diff", hf_dir, tmp_path / "nope"), tmp_path / "nope")
    _one_line_error(run_cli("weights-diff", hf_dir, "no_such_module_xyz:build"), "cannot import")
    _one_line_error(run_cli("weights-diff", hf_dir, tmp_path), "no weights found")
    _one_line_error(run_cli("load-audit", "no_such_module_xyz:build", hf_dir), "cannot import")
    _one_line_error(run_cli("load-audit", "json:dumps", hf_dir), "return the loaded nn.Module")
    _one_line_error(run_cli("load-audit", "json:loads", hf_dir), "raised")


def test_short_reason_cleans_library_messages():
    from ffdebug.errors import short_reason

    torch_msg = (
        "Weights only load failed. This file can still be loaded, \x1b[1mdo those steps only if you "
        "trust the source\x1b[0m. \n\t(1) In PyTorch 2.6 ...\n\tWeightsUnpickler error: Unsupported "
        "global: GLOBAL m.C was not an allowed global by default. Please use add_safe_globals."
    )
    assert short_reason(torch_msg) == "Unsupported global: GLOBAL m.C was not an allowed global by default"
    assert short_reason("\x1b[31mHeader too large\x1b[0m.\nmore detail") == "Header too large"
    assert short_reason(ValueError()) == "ValueError"
    long = short_reason("word " * 80)
    assert len(long) <= 120 and long.endswith("…") and "\n" not in long
