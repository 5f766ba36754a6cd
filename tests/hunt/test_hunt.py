"""`ffdebug hunt` on tiny Llamas from configs (README "Hunt: from symptom to root cause").

Each planted bug is at a known layer and module; the hunt must name both in at most three forward
rounds while writing a small fraction of what one full dump of every block stage and sub-stage
writes for the same inputs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import subprocess_env
from helpers.hunt.hunt_scripts import runs, write_script

from ffdebug.errors import FFDebugError
from ffdebug.hunt.engine import hunt
from ffdebug.hunt.rounds import HuntConfig
from ffdebug.hunt.runner import run_side, tree_bytes

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _helpers_on_pythonpath(monkeypatch):
    """The run scripts import ``helpers`` (tests/helpers/__init__.py): ``tests/`` on their PYTHONPATH."""
    monkeypatch.setenv("PYTHONPATH", subprocess_env()["PYTHONPATH"])


# the role sub-stage each planted bug must be found at (README "Role sub-stages")
EXPECTED = {
    "q_proj": {"attn.q.out"},
    "mlp_gate": {"mlp.gate.out"},
    "norm": {"ffn_norm_out"},
    "rotary": {"attn.q_rot", "attn.k_rot"},
}


_FULL: dict[int, int] = {}  # layers -> bytes: the reference script is the same for every plant


def full_dump_bytes(tmp_path, command: str, layers: int = 8) -> int:
    """Bytes of one side's full dump of every block stage and every role sub-stage of every layer
    (measured once per layer count)."""
    if layers in _FULL:
        return _FULL[layers]
    root = str(tmp_path / "full")
    env = {
        "FFDEBUG_FWD_DUMP_DIR": root,
        "FFDEBUG_FWD_DUMP_SIDE": "ref",
        "FFDEBUG_FWD_DUMP_SUBSTAGES": "1",
    }
    run_side(command, env, str(tmp_path / "full.log"), "full dump")
    _FULL[layers] = tree_bytes(root)
    return _FULL[layers]


def _forward_rounds(state) -> int:
    return sum(1 for r in state.rounds if r.round > 0)


@pytest.mark.parametrize(("plant", "layer"), [("q_proj", 2), ("mlp_gate", 5), ("norm", 2), ("rotary", 5)])
def test_hunt_names_layer_and_sub_stage(tmp_path, plant, layer):
    """Three sites over two layers plus a rotary swap: layer and sub-stage named in <= 3 forward
    rounds, the error local, under 30 % of a full dump's bytes (both sides against both sides)."""
    ref, _ = write_script(tmp_path, "ref")
    target, _ = write_script(tmp_path, "target", plant, layer)
    state = hunt(HuntConfig(ref=ref, target=target, dir=str(tmp_path / "h")))
    assert state.complete and _forward_rounds(state) <= 3
    assert state.layer == layer and state.layer_class == "LlamaDecoderLayer"
    assert state.sub_stage in EXPECTED[plant], state.rounds[-1].evidence
    assert state.local is True
    ratio = state.used / (2 * full_dump_bytes(tmp_path, ref))
    print(f"hunt {plant}@{layer}: {state.used} bytes, {ratio:.1%} of a full dump")
    assert ratio < 0.30
    saved = json.loads((tmp_path / "h" / "hunt.json").read_text())
    assert set(saved) == {"rounds", "layer", "layer_class", "sub_stage", "local", "budget", "complete"}
    assert set(saved["rounds"][0]) == {
        "round",
        "env",
        "command_ref",
        "command_target",
        "bytes",
        "decision",
        "evidence",
    }
    assert saved["budget"] == {"limit": None, "used": state.used}


def test_hunt_32_layers_under_ten_percent(tmp_path):
    ref, _ = write_script(tmp_path, "ref", layers=32)
    target, _ = write_script(tmp_path, "target", "q_proj", 20, layers=32)
    state = hunt(HuntConfig(ref=ref, target=target, dir=str(tmp_path / "h")))
    assert (state.layer, state.sub_stage in EXPECTED["q_proj"]) == (20, True)
    ratio = state.used / (2 * full_dump_bytes(tmp_path, ref, layers=32))
    print(f"hunt 32 layers: {state.used} bytes, {ratio:.1%} of a full dump")
    assert ratio < 0.10


def test_hunt_port_against_hf(tmp_path):
    """Two codebases: the HF model as reference, a port with fused q/k/v as target."""
    ref, _ = write_script(tmp_path, "ref", hf=True)
    target, _ = write_script(tmp_path, "target", "port_q", 5, port=True)
    state = hunt(HuntConfig(ref=ref, target=target, dir=str(tmp_path / "h")))
    assert state.complete and state.layer == 5 and state.local is True
    # the port's fused q/k/v is split by role, so its q pairs with HF's q_proj
    assert state.sub_stage == "attn.q.out"


def test_hunt_killed_between_rounds_resumes(tmp_path):
    """SIGKILL once round 1 is saved; --resume runs round 2 and never round 1 again."""
    ref, ref_log = write_script(tmp_path, "ref")
    target, _ = write_script(tmp_path, "target", "q_proj", 2)
    d = tmp_path / "h"
    args = [
        sys.executable,
        "-m",
        "ffdebug.cli.app",
        "hunt",
        "--ref",
        ref,
        "--target",
        target,
        "--dir",
        str(d),
    ]
    proc = subprocess.Popen(
        args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if (d / "hunt.json").exists() and json.loads((d / "hunt.json").read_text())["rounds"]:
            break
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    saved = json.loads((d / "hunt.json").read_text())
    assert [r["round"] for r in saved["rounds"]] == [1] and not saved["complete"]
    html = tmp_path / "hunt.html"
    out = subprocess.run(args + ["--resume", "--json", "--html", str(html)], capture_output=True, text=True)
    assert out.returncode == 1, out.stderr
    final = json.loads(out.stdout)
    assert [r["round"] for r in final["rounds"]] == [1, 2] and final["complete"]
    assert final["layer"] == 2 and final["sub_stage"] in EXPECTED["q_proj"]
    assert runs(ref_log).count("round1") == 1  # round 1 was not redone
    assert "kept from the earlier run" in out.stderr
    page = html.read_text()
    assert "Round 1" in page and "Round 2" in page and "FFDEBUG_FWD_DUMP_MODE=sketch" in page


def test_hunt_respects_the_byte_budget(tmp_path):
    """A 64 KiB budget cannot hold round 1's sketches: the round is not kept (what the writers left
    out would be judged on statistics alone), the hunt says so and exits 4."""
    ref, _ = write_script(tmp_path, "ref", layers=2)
    target, _ = write_script(tmp_path, "target", "q_proj", 1, layers=2)
    d = tmp_path / "h"
    args = ["hunt", "--ref", ref, "--target", target, "--dir", str(d), "--budget", "64KiB"]
    out = subprocess.run([sys.executable, "-m", "ffdebug.cli.app", *args], capture_output=True, text=True)
    assert out.returncode == 4, out.stderr
    assert "byte budget was reached" in out.stdout and "INCOMPLETE" in out.stdout
    saved = json.loads((d / "hunt.json").read_text())
    assert saved["rounds"] == [] and saved["budget"]["limit"] == 64 * 1024 and not saved["complete"]
    assert tree_bytes(str(d / "round1" / "ref")) <= 32 * 1024 + 16 * 1024  # payloads capped, manifests on top


def test_hunt_with_noise_names_the_bug_and_not_the_noise(tmp_path):
    """--noise: the reference in bfloat16 sets each stage's noise floor. A float16 target (less
    rounding than the noise side) is not blamed on any layer; a planted q bug still is."""
    ref, _ = write_script(tmp_path, "ref")
    noise, noise_log = write_script(tmp_path, "noise", dtype="bfloat16")
    half, _ = write_script(tmp_path, "half", dtype="float16")
    quiet = hunt(HuntConfig(ref=ref, target=half, noise=noise, dir=str(tmp_path / "quiet")))
    assert quiet.complete and quiet.layer is None and quiet.sub_stage is None
    assert "nothing to hunt" in quiet.rounds[-1].decision
    target, _ = write_script(tmp_path, "target", "q_proj", 2)
    state = hunt(HuntConfig(ref=ref, target=target, noise=noise, dir=str(tmp_path / "h")))
    assert state.complete and state.layer == 2 and state.sub_stage in EXPECTED["q_proj"]
    assert runs(noise_log).count("round1") == 2  # the noise side ran in both hunts' round 1


def test_hunt_round0_from_the_commands_weight_dumps(tmp_path):
    """--dump-weights: each command's maybe_dump_weights_and_exit writes its weights and exits; the
    planted q weight is a weight bug, found before any forward. A command without the call is
    named."""
    ref, ref_log = write_script(tmp_path, "ref", layers=2, weights=True)
    target, _ = write_script(tmp_path, "target", "q_proj", 1, layers=2, weights=True)
    state = hunt(HuntConfig(ref=ref, target=target, dir=str(tmp_path / "h"), dump_weights=True))
    assert [r.round for r in state.rounds] == [0] and state.complete
    assert state.sub_stage == "weights" and state.rounds[0].decision.startswith("weight bug")
    assert any("layers.1.self_attn.q_proj.weight" in line for line in state.rounds[0].evidence)
    assert state.used == state.rounds[0].bytes > 0 and runs(ref_log) == []  # no forward dump dir
    plain, _ = write_script(tmp_path, "plain", layers=2)
    with pytest.raises(FFDebugError, match="the target command .* wrote no weights"):
        hunt(HuntConfig(ref=ref, target=plain, dir=str(tmp_path / "h2"), dump_weights=True))
