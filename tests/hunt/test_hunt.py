"""`ffdebug hunt` on tiny Llamas from configs (docs/hunt.md "Hunt: from symptom to root cause").

Each planted bug is at a known layer and module; the hunt must name both in at most three forward
rounds while writing a small fraction of what one full dump of every block stage and sub-stage
writes for the same inputs. Most hunts run their sides as functions in this process (hunt's Python
API, `hunt_scripts.in_process`): no interpreter nor torch start per round. The kill-and-resume
test drives the real CLI with shell commands, each round a fresh `python` process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import hang_timeout, subprocess_env
from helpers.hunt.hunt_scripts import in_process, runs, write_script

from ffdebug.errors import FFDebugError
from ffdebug.hunt.engine import hunt
from ffdebug.hunt.rounds import HuntConfig
from ffdebug.hunt.runner import run_side, tree_bytes


@pytest.fixture(autouse=True)
def _helpers_on_pythonpath(monkeypatch):
    """The run scripts import ``helpers`` (tests/helpers/__init__.py): ``tests/`` on their PYTHONPATH."""
    monkeypatch.setenv("PYTHONPATH", subprocess_env()["PYTHONPATH"])


# the role sub-stage each planted bug must be found at (docs/dumping.md "Role sub-stages")
EXPECTED = {
    "q_proj": {"attn.q.out"},
    "mlp_gate": {"mlp.gate.out"},
    "norm": {"ffn_norm_out"},
    "rotary": {"attn.q_rot", "attn.k_rot"},
}
STATE_KEYS = {"rounds", "layer", "layer_class", "sub_stage", "local", "budget", "complete"}
ROUND_KEYS = {"round", "env", "command_ref", "command_target", "bytes", "decision", "evidence"}

_FULL: dict[int, int] = {}  # layers -> bytes: the reference is the same for every plant


def full_dump_bytes(tmp_path, layers: int = 8) -> int:
    """Bytes of one side's full dump of every block stage and every role sub-stage of every layer
    (measured once per layer count, the same accounting as the hunt's: `tree_bytes`)."""
    if layers not in _FULL:
        root = str(tmp_path / f"full{layers}")
        env = {
            "FFDEBUG_FWD_DUMP_DIR": root,
            "FFDEBUG_FWD_DUMP_SIDE": "ref",
            "FFDEBUG_FWD_DUMP_SUBSTAGES": "1",
        }
        run_side(in_process(layers=layers), env, str(tmp_path / "full.log"), "full dump")
        _FULL[layers] = tree_bytes(root)
    return _FULL[layers]


def _forward_rounds(state) -> int:
    return sum(1 for r in state.rounds if r.round > 0)


GRID = [(p, layer) for p in ("q_proj", "mlp_gate", "norm") for layer in (2, 5)] + [("rotary", 5)]


@pytest.mark.parametrize(("plant", "layer"), GRID)
def test_hunt_names_layer_and_sub_stage(tmp_path, plant, layer):
    """Three sites over two layers plus a rotary swap on 8 layers: layer and sub-stage named in
    <= 3 forward rounds, the error local, under 30 % of a full dump's bytes (both sides against
    both sides)."""
    d = tmp_path / "h"
    state = hunt(HuntConfig(ref=in_process(), target=in_process(plant, layer), dir=str(d)))
    assert state.complete and _forward_rounds(state) <= 3
    assert state.layer == layer and state.layer_class == "LlamaDecoderLayer"
    assert state.sub_stage in EXPECTED[plant], state.rounds[-1].evidence
    assert state.local is True
    # the layers before are bit-equal: round 2 settles local without a replay
    assert [r.round for r in state.rounds] == [1, 2]
    assert any("bit-equal on both sides" in e for e in state.rounds[-1].evidence)
    # the planted stage is where the error starts: what its step is measured against is exact
    stepped = [e for e in state.rounds[-1].evidence if e.startswith("its step measured against")]
    assert len(stepped) == 1 and stepped[0].endswith("bit-equal"), state.rounds[-1].evidence
    ratio = state.used / (2 * full_dump_bytes(tmp_path))
    print(f"hunt {plant}@{layer}: {state.used} bytes, {ratio:.1%} of a full dump")
    assert ratio < 0.30
    saved = json.loads((d / "hunt.json").read_text())
    assert set(saved) == STATE_KEYS and set(saved["rounds"][0]) == ROUND_KEYS
    assert saved["budget"] == {"limit": None, "used": state.used}
    assert (
        saved["rounds"][0]["command_target"]
        == f"python:helpers.hunt.hunt_scripts:torch_llama[8 layers, {plant}@{layer}, float32]"
    )


def test_hunt_32_layers_under_ten_percent(tmp_path):
    state = hunt(
        HuntConfig(
            ref=in_process(layers=32), target=in_process("q_proj", 20, layers=32), dir=str(tmp_path / "h")
        )
    )
    assert (state.layer, state.sub_stage in EXPECTED["q_proj"], _forward_rounds(state)) == (20, True, 2)
    ratio = state.used / (2 * full_dump_bytes(tmp_path, layers=32))
    print(f"hunt 32 layers: {state.used} bytes, {ratio:.1%} of a full dump")
    assert ratio < 0.10


def test_hunt_round3_replays_the_layer_on_the_reference_input(tmp_path):
    """A drift inside the ok band from layer 1 on leaves layer 5's input inexact: round 2 cannot
    tell local from inherited, so round 3 feeds the target's layer 5 the reference's hidden_in
    (FFDEBUG_FWD_FEED_DIR) and finds its q projection wrong on that input: local. Stopped after
    round 2, --resume runs round 3 alone (the target only)."""
    d = tmp_path / "h"
    ref_calls: list = []
    target_calls: list = []
    cfg = HuntConfig(
        ref=in_process(calls=ref_calls), target=in_process("drift+q_proj", 5, calls=target_calls), dir=str(d)
    )
    first = hunt(cfg, max_rounds=2)
    assert [r.round for r in first.rounds] == [1, 2] and not first.complete
    state = hunt(cfg, resume=True)
    assert (ref_calls, target_calls) == (["round1", "round2"], ["round1", "round2", "round3"])
    assert [r.round for r in state.rounds] == [1, 2, 3] and state.complete
    assert (state.layer, state.sub_stage, state.local) == (5, "attn.q.out", True)
    assert "replay it on the reference's input" in state.rounds[1].decision
    r3 = state.rounds[2]
    assert set(r3.env) == {"target"}  # the reference's round 2 dump is reused, not rerun
    assert r3.env["target"]["FFDEBUG_FWD_FEED_DIR"] == str(d / "round2" / "ref")
    assert "local to it (attribution)" in r3.decision
    fed = json.loads((d / "hunt.json").read_text())["rounds"][2]
    assert fed["round"] == 3 and any("fed the reference's L005.hidden_in" in e for e in fed["evidence"])
    ratio = state.used / (2 * full_dump_bytes(tmp_path))
    print(f"hunt with attribution: {state.used} bytes, {ratio:.1%} of a full dump")
    assert ratio < 0.30


def test_hunt_round3_says_inherited_when_the_layer_only_amplifies(tmp_path):
    """Both sides' layer 5 amplifies its input's error (sharp attention); the target's only
    difference is the drift from layer 1. Rounds 1-2 see layer 5 add most of the error; fed the
    reference's input it is bit-equal: inherited, not local."""
    d = tmp_path / "h"
    state = hunt(
        HuntConfig(ref=in_process("amplifier", 5), target=in_process("amplifier+drift", 5), dir=str(d))
    )
    assert [r.round for r in state.rounds] == [1, 2, 3] and state.complete
    assert (state.layer, state.local) == (5, False)
    assert "inherited" in state.rounds[2].decision
    assert any("rel out 0% on the reference's input" in e for e in state.rounds[2].evidence)
    assert json.loads((d / "hunt.json").read_text())["local"] is False


def test_feed_dir_makes_the_fed_layer_bit_equal_when_only_its_input_differs(tmp_path):
    """The drift alone, fed at layer 5: its input becomes the reference's and nothing in the layer
    differs any more (attribution's 'inherited' case: fed rel 0 -> not local)."""
    from ffdebug.bisection.engine import bisect
    from ffdebug.hunt.attribution_round import attribution_env, is_local

    root = tmp_path / "d"
    ref_env = {
        "FFDEBUG_FWD_DUMP_DIR": str(root),
        "FFDEBUG_FWD_DUMP_SIDE": "ref",
        "FFDEBUG_FWD_DUMP_SUBSTAGES": "1",
    }
    run_side(in_process(), ref_env, str(tmp_path / "r.log"), "ref")
    env = {"FFDEBUG_FWD_DUMP_DIR": str(root), "FFDEBUG_FWD_DUMP_SIDE": "target"}
    env.update(attribution_env(5, str(root / "ref")))
    run_side(in_process("drift"), env, str(tmp_path / "t.log"), "target")
    result = bisect(str(root / "ref"), str(root / "target"), allow_partial=True)
    row = next(r for r in result.layers if r.layer == 5)
    assert row.rel_in == 0.0 and row.rel_out == 0.0
    assert not is_local(row.rel_out, 1e-5)
    # the rule on hand-made numbers: a tenth of round 2's error is the line
    assert is_local(0.02, 0.05) and is_local(0.006, 0.05) and not is_local(0.004, 0.05)
    env["FFDEBUG_FWD_FEED_DIR"] = str(tmp_path / "nowhere")
    with pytest.raises(FFDebugError, match="FFDEBUG_FWD_FEED_DIR"):
        run_side(in_process("drift"), env, str(tmp_path / "t2.log"), "target")
    env["FFDEBUG_FWD_FEED_DIR"] = str(root / "ref")  # other inputs: 32 tokens against 64
    env["FFDEBUG_FWD_DUMP_OVERWRITE"] = "1"
    with pytest.raises(
        FFDebugError, match=r"L000.hidden_in is \[1, 64, 64\] there but the block received \[1, 32, 64\]"
    ):
        run_side(in_process("drift", seq=32), env, str(tmp_path / "t3.log"), "target")


def test_hunt_port_against_hf(tmp_path):
    """Two codebases: the HF model as reference, a port with fused q/k/v as target."""
    ref = in_process(hf=True)
    state = hunt(HuntConfig(ref=ref, target=in_process("port_q", 5, port=True), dir=str(tmp_path / "h")))
    assert state.complete and state.layer == 5 and state.local is True and _forward_rounds(state) <= 3
    # the port's fused q/k/v is split by role, so its q pairs with HF's q_proj
    assert state.sub_stage == "attn.q.out"


def test_hunt_port_with_an_unloaded_down_projection_ends_on_it_not_one_rounding_away(tmp_path):
    """HF against a port whose layer 2 down projection was never loaded: the port's layer inputs
    differ from HF's by rounding, so round 3 feeds layer 2 the reference's input; there its
    attention matches HF's to a few ulps (another summation order), which is no signal, and the
    hunt still ends on the down projection (verdict.above_rounding)."""
    state = hunt(
        HuntConfig(
            ref=in_process(hf=True), target=in_process("port_down", 2, port=True), dir=str(tmp_path / "h")
        )
    )
    assert [r.round for r in state.rounds] == [1, 2, 3], [r.decision for r in state.rounds]
    assert state.complete and state.layer == 2 and state.local is True, state.rounds[-1].evidence
    assert state.sub_stage == "mlp.down.out", state.rounds[-1].evidence


@pytest.mark.integration
def test_hunt_killed_between_rounds_resumes(tmp_path):
    """The real CLI and shell commands (a python process per side and round): SIGKILL once round 1
    is saved; --resume runs round 2 and never round 1 again."""
    ref, ref_log = write_script(tmp_path, "ref")
    target, _ = write_script(tmp_path, "target", "q_proj", 2)
    d = tmp_path / "h"
    args = [sys.executable, "-m", "ffdebug.cli.app", "hunt", "--ref", ref, "--target", target]
    args += ["--dir", str(d)]
    proc = subprocess.Popen(
        args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.time() + hang_timeout(300)
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
    out would be judged on statistics alone) and the hunt says so, incomplete (the CLI's exit 4:
    tests/hunt/test_hunt_state.py)."""
    d = tmp_path / "h"
    cfg = HuntConfig(
        ref=in_process(layers=2), target=in_process("q_proj", 1, layers=2), dir=str(d), budget=64 << 10
    )
    state = hunt(cfg)
    assert not state.complete and state.rounds == []
    assert any("byte budget was reached" in n for n in state.notes)
    saved = json.loads((d / "hunt.json").read_text())
    assert saved["rounds"] == [] and saved["budget"]["limit"] == 64 * 1024 and not saved["complete"]
    assert tree_bytes(str(d / "round1" / "ref")) <= 32 * 1024 + 16 * 1024  # payloads capped, manifests on top


def test_hunt_with_noise_names_the_bug_and_not_the_noise(tmp_path):
    """--noise: the reference in bfloat16 sets each stage's noise floor. A float16 target (less
    rounding than the noise side) is not blamed on any layer; a planted q bug still is."""
    noise_calls: list = []
    noise = in_process(dtype="bfloat16", calls=noise_calls)
    quiet = hunt(
        HuntConfig(ref=in_process(), target=in_process(dtype="float16"), noise=noise, dir=str(tmp_path / "q"))
    )
    assert quiet.complete and quiet.layer is None and quiet.sub_stage is None
    assert "nothing to hunt" in quiet.rounds[-1].decision
    state = hunt(
        HuntConfig(ref=in_process(), target=in_process("q_proj", 2), noise=noise, dir=str(tmp_path / "h"))
    )
    assert state.complete and state.layer == 2 and state.sub_stage in EXPECTED["q_proj"]
    assert noise_calls.count("round1") == 2  # the noise side ran in both hunts' round 1


def test_hunt_round0_from_the_commands_weight_dumps(tmp_path):
    """--dump-weights: each command's maybe_dump_weights_and_exit writes its weights and exits; the
    planted q weight is a weight bug, found before any forward. A command without the call is
    named."""
    calls: list = []
    ref = in_process(layers=2, weights=True, calls=calls)
    target = in_process("q_proj", 1, layers=2, weights=True)
    state = hunt(HuntConfig(ref=ref, target=target, dir=str(tmp_path / "h"), dump_weights=True))
    assert [r.round for r in state.rounds] == [0] and state.complete
    assert state.sub_stage == "weights" and state.rounds[0].decision.startswith("weight bug")
    assert any("layers.1.self_attn.q_proj.weight" in line for line in state.rounds[0].evidence)
    assert state.used == state.rounds[0].bytes > 0 and calls == [""]  # no forward dump dir
    with pytest.raises(FFDebugError, match="the target command .* wrote no weights"):
        hunt(HuntConfig(ref=ref, target=in_process(layers=2), dir=str(tmp_path / "h2"), dump_weights=True))


def test_in_process_command_failure_is_one_line_and_env_restored(tmp_path):
    os.environ["FFDEBUG_FWD_DUMP_SIDE"] = "outer"
    try:

        def broken() -> None:
            assert os.environ["FFDEBUG_FWD_DUMP_SIDE"] == "ref"
            raise RuntimeError("shape [3] is wrong")

        with pytest.raises(
            FFDebugError, match=r"round 1, ref: python:.*broken raised RuntimeError: shape \[3\]"
        ):
            run_side(broken, {"FFDEBUG_FWD_DUMP_SIDE": "ref"}, str(tmp_path / "x.log"), "round 1, ref")
        assert os.environ["FFDEBUG_FWD_DUMP_SIDE"] == "outer"
    finally:
        del os.environ["FFDEBUG_FWD_DUMP_SIDE"]
