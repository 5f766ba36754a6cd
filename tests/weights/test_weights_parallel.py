"""weights-diff on forked worker processes (`--workers`): the same result at any count, the parts of
a stacked tensor kept on one worker, what the children found across ranks carried back."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from helpers.weights.tp_dumps import tp_split, write_dump
from helpers.weights.weights_utils import run_cli
from safetensors.torch import save_file

import ffdebug
from ffdebug.weights import diff as wdiff

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forked workers: Linux only")

GATE_UP = "experts.gate_up_proj=experts.{E}.gate_proj.weight+experts.{E}.up_proj.weight"
DOWN = "experts.down_proj=experts.{E}.down_proj.weight"


def _as_json(res) -> str:
    return json.dumps(res.to_json(), sort_keys=True)


@pytest.fixture
def forking(monkeypatch, tmp_path):
    """Workers fork whatever threads earlier tests left; each child notes its pid in a file."""
    pids = tmp_path / "pids"
    inner = wdiff.WeightsDiff._one

    def noted(self, name, comparable):
        with open(pids, "a") as f:
            f.write(f"{os.getpid()}\n")
        return inner(self, name, comparable)

    monkeypatch.setattr(wdiff, "fork_usable", lambda: True)
    monkeypatch.setattr(wdiff.WeightsDiff, "_one", noted)
    return pids


def test_stacked_experts_and_plain_tensors_same_at_any_worker_count(tmp_path, forking, monkeypatch):
    """The demo DeepSeek-V3 (8 stacked experts per MoE layer) against its per-expert checkpoint with
    expert 3's up_proj of layer 2 halved and one attention weight noisy: 1, 2 and 3 workers give
    the same JSON; the per-expert parts of each stacked tensor are compared by one worker (the
    stacked tensor is loaded once per run, not once per part)."""
    from ffdebug.demo import build_model

    model = build_model()
    model.save_pretrained(tmp_path / "ckpt")
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    state["model.layers.2.mlp.experts.gate_up_proj"][3, 16:] *= 0.5
    noisy = "model.layers.1.self_attn.o_proj.weight"
    state[noisy] = state[noisy] + 1e-3 * torch.randn(
        state[noisy].shape, generator=torch.Generator().manual_seed(0)
    )
    save_file(state, tmp_path / "stacked.safetensors")
    args = (tmp_path / "ckpt", tmp_path / "stacked.safetensors")
    loads = tmp_path / "loads"
    real = wdiff.TensorLoader.load_raw

    def counted(self, t, side):
        if t.name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # a whole stacked tensor
            with open(loads, "a") as f:
                f.write(f"{os.getpid()} {side} {t.name}\n")
        return real(self, t, side)

    def stacked_reads() -> list[str]:
        lines = loads.read_text().splitlines()
        loads.unlink()
        return lines

    monkeypatch.setattr(wdiff.TensorLoader, "load_raw", counted)
    one = ffdebug.weights_diff(*args, stack=(GATE_UP, DOWN), workers=1)
    assert set(forking.read_text().split()) == {str(os.getpid())}  # one worker: this process
    forking.unlink()
    stacked = sum(1 for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj")))
    assert stacked >= 4 and len(stacked_reads()) == stacked  # each stacked tensor read once
    for n in (2, 3):
        assert _as_json(ffdebug.weights_diff(*args, stack=(GATE_UP, DOWN), workers=n)) == _as_json(one)
        reads = stacked_reads()
        assert len(reads) == len({r.split(" ", 1)[1] for r in reads}) == stacked, reads  # once, by one worker
    assert len(set(forking.read_text().split()) - {str(os.getpid())}) >= 2  # children compared
    bad = {t.name for t in one.tensors if t.finding != "equal"}
    assert noisy in bad and any("layers.2.mlp.experts.3.up_proj" in n for n in bad)


def test_a_replica_differing_across_ranks_is_reported_from_a_worker(hf_dir, hf_state, tmp_path, forking):
    """The replica check runs where a child merges the ranks; its finding reaches the result, and
    the dump compared on two workers reads as on one."""
    shards = tp_split(hf_state)
    shards[1]["model.norm.weight"] = shards[1]["model.norm.weight"] + 1e-3
    write_dump(tmp_path / "weights", shards)
    one = ffdebug.weights_diff(hf_dir, tmp_path / "weights", workers=1)
    two = ffdebug.weights_diff(hf_dir, tmp_path / "weights", workers=2)
    assert _as_json(two) == _as_json(one)
    assert two.replica_mismatch == [{"name": "model.norm.weight", "side": "target", "ranks": [1]}]
    assert len(set(forking.read_text().split()) - {str(os.getpid())}) >= 2


def test_a_dead_worker_is_one_line_with_the_way_round_it(hf_dir, tmp_path, forking, monkeypatch):
    """A child killed while comparing (as the OOM killer would): exit 2 and one line naming the
    tensor and --workers 1, not a hang or a traceback."""
    import signal

    inner = wdiff.WeightsDiff._one

    def dies(self, name, comparable):
        if name == "model.layers.1.mlp.down_proj.weight":
            os.kill(os.getpid(), signal.SIGKILL)
        return inner(self, name, comparable)

    monkeypatch.setattr(wdiff.WeightsDiff, "_one", dies)
    r = run_cli("weights-diff", hf_dir, hf_dir, "--workers", "2", "--json")
    assert r.exit_code == 2 and "Traceback" not in r.output
    message = json.loads(r.stdout)["error"]["message"]
    assert "killed by SIGKILL while comparing 'model.layers.1.mlp.down_proj.weight'" in message
    assert "--workers 1" in message and len(r.stderr.strip().splitlines()) == 1
