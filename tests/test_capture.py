"""Capturing an HF LlamaForCausalLM through env vars and through ffdebug.capture."""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest
import torch

import ffdebug
from ffdebug.arrays import to_torch
from ffdebug.store.reader import open_side

CANONICAL = (
    "hidden_in",
    "attn_norm_out",
    "attn.q_rot",
    "attn.k_rot",
    "attn_out",
    "ffn_norm_out",
    "ffn_out",
    "hidden_out",
)


def _expected_keys(num_layers: int) -> set[str]:
    keys = {"embed.input_ids", "embed.out", "final.norm_out", "final.logits"}
    keys |= {f"L{i:03d}.{s}" for i in range(num_layers) for s in CANONICAL}
    return keys


@pytest.mark.integration
def test_env_dump_one_line_install(tmp_path, monkeypatch, tiny_llama, input_ids):
    monkeypatch.setenv("FFDEBUG_FWD_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("FFDEBUG_FWD_DUMP_SIDE", "ref")
    handle = ffdebug.install(tiny_llama)
    with torch.no_grad():
        out = tiny_llama(input_ids=input_ids)
    handle.remove()
    from ffdebug.capture.state import active_session

    active_session().close()
    store = open_side(tmp_path / "ref")
    assert set(store.keys()) == _expected_keys(4)
    recs = {r.key: r for r in store.records}
    assert torch.equal(to_torch(recs["embed.input_ids"].load()), input_ids)
    assert torch.equal(to_torch(recs["final.logits"].load()), out.logits)
    assert recs["L002.ffn_out"].layer == 2 and recs["L002.ffn_out"].module_class == "LlamaMLP"
    assert recs["L000.hidden_in"].io == "in" and recs["L000.hidden_out"].io == "out"
    run = json.loads((tmp_path / "ref" / "run.json").read_text())
    assert run["side"] == "ref" and run["threads"] == 1 and run["format_version"] == 1
    assert run["env"]["FFDEBUG_FWD_DUMP_SIDE"] == "ref"
    status = json.loads((tmp_path / "ref" / "rank000" / "status.json").read_text())
    assert status["complete"] and status["written"] == len(store.records)


@pytest.mark.integration
def test_capture_api_same_stages_and_layer_filter(tmp_path, tiny_llama, input_ids):
    with ffdebug.capture(tiny_llama, dir=tmp_path, side="target"), torch.no_grad():
        tiny_llama(input_ids=input_ids)
    assert set(open_side(tmp_path / "target").keys()) == _expected_keys(4)
    with ffdebug.capture(tiny_llama, dir=tmp_path, side="sub", layers="1,-1", stages="L*"), torch.no_grad():
        tiny_llama(input_ids=input_ids)
    keys = set(open_side(tmp_path / "sub").keys())
    assert keys == {f"L{i:03d}.{s}" for i in (1, 3) for s in CANONICAL} | {"embed.input_ids"}
    assert not tiny_llama._forward_hooks and not tiny_llama._forward_pre_hooks  # removed on exit


@pytest.mark.integration
def test_clone_on_capture(tmp_path):
    lin = torch.nn.Linear(4, 4)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
                x.mul_(0)  # in-place op after the block returned
            return x

    m = M()
    x = torch.ones(1, 4)
    with ffdebug.capture(m, dir=tmp_path, side="s"), torch.no_grad():
        m(x)
    rec = {r.key: r for r in open_side(tmp_path / "s").records}
    assert float(to_torch(rec["L000.hidden_out"].load()).abs().sum()) > 0  # not zeroed by the later mul_
    del lin


def test_disabled_installs_no_hooks_and_tap_is_noop(tiny_llama, input_ids, tmp_path, monkeypatch):
    """No FFDEBUG_* variable: no hook on any module (nor a global one), no session, and a tap writes
    nothing — not even relative to the working directory, which is tmp_path here."""
    from torch.nn.modules import module as nn_module

    from ffdebug.capture.state import active_session

    monkeypatch.chdir(tmp_path)
    global_hooks = (nn_module._global_forward_hooks, nn_module._global_forward_pre_hooks)
    before = [dict(h) for h in global_hooks]
    sigterm = signal.getsignal(signal.SIGTERM)
    assert ffdebug.install(tiny_llama) is None
    for m in tiny_llama.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
        assert not m._forward_hooks_with_kwargs and not m._backward_hooks
    assert [dict(h) for h in global_hooks] == before
    x = torch.ones(3)
    assert ffdebug.tap("anything", x) is x
    with ffdebug.step(optimizer_step=1), torch.no_grad():
        ffdebug.tap("anything", x)
        tiny_llama(input_ids=input_ids)
    assert active_session() is None
    assert not any(tmp_path.iterdir())
    # no SIGTERM handler and no background writer thread either
    assert signal.getsignal(signal.SIGTERM) is sigterm
    assert not [t for t in threading.enumerate() if t.name == "ffdebug-dump-writer"]


@pytest.mark.integration
def test_calls_steps_taps_and_first_real(tmp_path, tiny_llama, input_ids):
    dummy = torch.zeros_like(input_ids)
    with ffdebug.capture(tiny_llama, dir=tmp_path, side="s", calls="first-real", stages="final.logits"):
        with torch.no_grad():
            tiny_llama(input_ids=dummy)  # untagged dummy batch: a warm-up guess, skipped
            tiny_llama(input_ids=input_ids)  # captured
            tiny_llama(input_ids=input_ids)  # not: first-real takes one call
    recs = [r for r in open_side(tmp_path / "s").records if r.key == "final.logits"]
    assert len(recs) == 1 and recs[0].call == 1

    with ffdebug.capture(tiny_llama, dir=tmp_path, side="t", stages="final.logits,reward"):
        for k in range(2):
            with ffdebug.step(optimizer_step=k, phase="rollout"), torch.no_grad():
                tiny_llama(input_ids=input_ids)
                tiny_llama(input_ids=input_ids)
                ffdebug.tap("reward", torch.tensor([1.0 * k]), role="policy")
    recs = open_side(tmp_path / "t").records
    logits = [(r.step["optimizer_step"], r.call, r.phase) for r in recs if r.key == "final.logits"]
    assert logits == [(0, 0, "rollout"), (0, 1, "rollout"), (1, 0, "rollout"), (1, 1, "rollout")]
    reward = [r for r in recs if r.key == "reward"]
    assert [r.step["role"] for r in reward] == ["policy", "policy"] and reward[1].load().item() == 1.0


@pytest.mark.integration
def test_stats_mode_and_budget(tmp_path, tiny_llama, input_ids):
    with ffdebug.capture(tiny_llama, dir=tmp_path, side="s", mode="stats"), torch.no_grad():
        tiny_llama(input_ids=input_ids)
    store = open_side(tmp_path / "s")
    assert store.records and all(not r.has_payload for r in store.records if r.key != "embed.input_ids")
    st = store.records[-1].stats
    assert set(st) >= {"mean", "std", "min", "max", "absmax", "l2", "nan", "inf", "zero"}
    # only the input ids (needed by the input-ids gate) keep a payload
    assert len(list((tmp_path / "s" / "rank000").glob("*.safetensors"))) == 1
    with ffdebug.capture(tiny_llama, dir=tmp_path, side="b", max_bytes=3000), torch.no_grad():
        tiny_llama(input_ids=input_ids)
    status = json.loads((tmp_path / "b" / "rank000" / "status.json").read_text())
    assert status["over_budget"] > 0 and status["bytes_written"] <= 3000


@pytest.mark.integration
def test_overwrite_guard(tmp_path, tiny_llama, input_ids, monkeypatch):
    from ffdebug.errors import FFDebugError

    for _ in range(2):
        with ffdebug.capture(tiny_llama, dir=tmp_path, side="s", overwrite=True), torch.no_grad():
            tiny_llama(input_ids=input_ids)
    try:
        with ffdebug.capture(tiny_llama, dir=tmp_path, side="s"), torch.no_grad():
            tiny_llama(input_ids=input_ids)
        raise AssertionError("expected FFDebugError")
    except FFDebugError as err:
        assert "FFDEBUG_FWD_DUMP_OVERWRITE=1" in str(err)


@pytest.mark.integration
def test_grads_dumped(tmp_path, tiny_llama, input_ids):
    with ffdebug.capture(tiny_llama, dir=tmp_path, side="g", grads=True, stages="L*.hidden_out*"):
        out = tiny_llama(input_ids=input_ids)
        out.logits.sum().backward()
    recs = open_side(tmp_path / "g").records
    grads = [r for r in recs if r.io == "grad"]
    assert {r.key for r in grads} == {f"L{i:03d}.hidden_out.grad" for i in range(4)}


@pytest.mark.integration
def test_patch_helpers_restore_and_dump(tmp_path, tiny_llama, input_ids):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

    original = LlamaDecoderLayer.forward
    with ffdebug.capture(None, dir=tmp_path, side="p"):
        with ffdebug.patch_block_forward(LlamaDecoderLayer, layer_attr="layer_idx"):
            with ffdebug.patch_module_dump(LlamaRMSNorm, stage="rms"), torch.no_grad():
                tiny_llama(input_ids=input_ids)
    assert LlamaDecoderLayer.forward is original
    keys = open_side(tmp_path / "p").keys()
    assert "L000.hidden_in" in keys and "L003.hidden_out" in keys and "L001.rms" in keys and "rms" in keys

    def boom(orig, self, *a, **k):
        raise RuntimeError("boom")

    norm_forward = LlamaRMSNorm.__dict__["forward"]
    with pytest.raises(RuntimeError, match="boom"), ffdebug.patch_method(LlamaRMSNorm, "forward", boom):
        tiny_llama(input_ids=input_ids)  # the replacement really runs
    assert LlamaRMSNorm.__dict__["forward"] is norm_forward  # restored after the exception

    class Child(LlamaRMSNorm):  # an inherited method: restored by removing the override
        pass

    with ffdebug.patch_method(Child, "forward", boom):
        assert "forward" in Child.__dict__
    assert "forward" not in Child.__dict__ and Child.forward is norm_forward
    with torch.no_grad():
        tiny_llama(input_ids=input_ids)  # restored: runs


@pytest.mark.integration
def test_weight_dump(tmp_path, monkeypatch, tiny_llama):
    monkeypatch.setenv("FFDEBUG_WEIGHT_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("FFDEBUG_WEIGHT_DUMP_LAYERS", "0")
    monkeypatch.setenv("FFDEBUG_WEIGHT_DUMP_EXIT", "0")
    side = ffdebug.maybe_dump_weights_and_exit(tiny_llama)
    store = open_side(side)
    keys = set(store.keys())
    assert "model.layers.0.mlp.up_proj.weight" in keys and "model.embed_tokens.weight" in keys
    assert not any(k.startswith("model.layers.1.") for k in keys)
    rec = next(r for r in store.records if r.key == "model.layers.0.mlp.up_proj.weight")
    assert torch.equal(to_torch(rec.load()), tiny_llama.model.layers[0].mlp.up_proj.weight)
    # non-persistent buffers (never in a checkpoint) are marked so weights-diff can set them aside
    persistent = {r.key: r.persistent for r in store.records}
    assert (
        persistent["model.rotary_emb.inv_freq"] is False and persistent["model.embed_tokens.weight"] is True
    )
    monkeypatch.setenv("FFDEBUG_WEIGHT_DUMP_EXIT", "1")
    monkeypatch.setenv("FFDEBUG_WEIGHT_DUMP_DIR", str(tmp_path / "w2"))
    try:
        ffdebug.maybe_dump_weights_and_exit(tiny_llama)
        raise AssertionError("expected SystemExit")
    except SystemExit as e:
        assert e.code == 0
    assert os.path.exists(tmp_path / "w2" / "weights" / "run.json")


def test_blocks_and_layer_classes_diffusers():
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    from ffdebug.models.blocks import find_blocks
    from reference_trainer.adapters.flux import FLUX_TINY
    from reference_trainer.adapters.sd3 import SD3_TINY

    sd3 = SD3Transformer2DModel(**SD3_TINY)
    blocks = find_blocks(sd3)
    assert [(b.layer, b.class_name) for b in blocks] == [
        (0, "JointTransformerBlock"),
        (1, "JointTransformerBlock"),
    ]
    flux = FluxTransformer2DModel(**FLUX_TINY)
    fb = find_blocks(flux)
    assert [(b.layer, b.class_name) for b in fb] == [
        (0, "FluxTransformerBlock"),
        (1, "FluxSingleTransformerBlock"),
    ]
    assert find_blocks(flux, declared="double:0,single:1-")[1].layer_class == "single"


@pytest.mark.integration
def test_first_real_per_step_tags_and_warmup_guess_recorded(tmp_path, tiny_llama, input_ids):
    """first-real takes the first non-warm-up call of each step-tag set; an untagged dummy batch is a
    warm-up guess whose input ids alone are written, marked phase=warmup_guess."""
    dummy = torch.zeros_like(input_ids)
    opts = dict(dir=tmp_path, side="s", calls="first-real", stages="final.logits")
    with ffdebug.capture(tiny_llama, **opts), torch.no_grad():
        tiny_llama(input_ids=dummy)
        for k in range(2):
            with ffdebug.step(optimizer_step=k):
                tiny_llama(input_ids=input_ids)
                tiny_llama(input_ids=input_ids)
    recs = open_side(tmp_path / "s").records
    logits = [(r.step, r.call) for r in recs if r.key == "final.logits"]
    assert logits == [({"optimizer_step": 0}, 0), ({"optimizer_step": 1}, 0)]
    guessed = [r for r in recs if r.phase == "warmup_guess"]
    assert [r.key for r in guessed] == ["embed.input_ids"] and torch.equal(to_torch(guessed[0].load()), dummy)


@pytest.mark.integration
def test_tap_tags_do_not_leak_and_input_ids_tag(tmp_path):
    """Per-tap tags tag that capture only; `input_ids=True` marks token ids (payload kept even in
    stats mode) instead of becoming a step tag."""
    with ffdebug.capture(None, dir=tmp_path, side="s", mode="stats"), ffdebug.step(optimizer_step=2):
        ffdebug.tap("reward", torch.ones(2), role="policy")
        ffdebug.tap("tokens", torch.tensor([[5, 6, 7]]), input_ids=True)
        ffdebug.tap("loss", torch.ones(1))
    recs = {r.key: r for r in open_side(tmp_path / "s").records}
    assert recs["reward"].step == {"optimizer_step": 2, "role": "policy"}
    assert recs["loss"].step == {"optimizer_step": 2}
    assert recs["tokens"].step == {"optimizer_step": 2} and recs["tokens"].extra == {"input_ids": True}
    assert recs["tokens"].has_payload and not recs["loss"].has_payload


@pytest.mark.integration
def test_stats_of_huge_float64_do_not_crash_capture(tmp_path):
    """Sums of squares of 1e300 overflow; the stat is null and the capture goes through."""
    with ffdebug.capture(None, dir=tmp_path, side="s"):
        ffdebug.tap("big", torch.tensor([1e300, -1e300], dtype=torch.float64))
    stats = open_side(tmp_path / "s").records[0].stats
    assert stats["l2"] is None and stats["max"] == 1e300 and stats["absmax"] == 1e300


@pytest.mark.integration
def test_run_json_has_input_ids_sha(tmp_path, tiny_llama, input_ids):
    from ffdebug.store.schema import sha256_of_tensor

    with ffdebug.capture(tiny_llama, dir=tmp_path, side="s", stages="final.logits"), torch.no_grad():
        tiny_llama(input_ids=input_ids)
    run = json.loads((tmp_path / "s" / "run.json").read_text())
    assert run["input_ids_sha256"] == sha256_of_tensor(input_ids)


@pytest.mark.integration
def test_grads_follow_call_selection_and_forward_tags(tmp_path, tiny_llama, input_ids):
    """Gradients of an unselected call are not written; a gradient keeps its forward's step tags."""
    with ffdebug.capture(
        tiny_llama, dir=tmp_path, side="g", grads=True, calls="1", stages="L000.hidden_out*"
    ):
        with ffdebug.step(optimizer_step=7):
            outs = [tiny_llama(input_ids=input_ids) for _ in range(2)]
        sum(o.logits.sum() for o in outs).backward()  # outside the step context
    grads = [r for r in open_side(tmp_path / "g").records if r.io == "grad"]
    assert [(r.key, r.call, r.step) for r in grads] == [("L000.hidden_out.grad", 1, {"optimizer_step": 7})]


@pytest.mark.integration
def test_no_blocks_found_is_reported(tmp_path, caplog):
    """Wrong block class names: the final output is still captured, but a warning says no blocks."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    with ffdebug.capture(model, dir=tmp_path, side="s", classes="NoSuchBlock"), torch.no_grad():
        model(torch.ones(1, 3))
    assert "final.out" in open_side(tmp_path / "s").keys()
    assert "no blocks were found" in caplog.text  # the ffdebug.capture logger


def test_capture_options_validated_like_env(tmp_path):
    """ffdebug.capture rejects what the env vars reject, and unknown options (a typo is not ignored)."""
    import pytest

    from ffdebug.errors import FFDebugError

    cases = [
        ({"side": "../elsewhere"}, FFDebugError),
        ({"mode": "everything"}, FFDebugError),
        ({"stage": "L*"}, TypeError),
    ]
    for kwargs, err in cases:
        with pytest.raises(err), ffdebug.capture(None, dir=tmp_path, **kwargs):
            pass
    assert not any(tmp_path.iterdir())


@pytest.mark.integration
def test_topk_of_logits(tmp_path, tiny_llama, input_ids):
    """FFDEBUG_DEBUG_TOPK / topk=k: the top-k ids and softmax probabilities of the final logits."""
    with ffdebug.capture(tiny_llama, dir=tmp_path, side="s", topk=3, stages="final.*"), torch.no_grad():
        logits = tiny_llama(input_ids=input_ids).logits
    recs = {r.key: r for r in open_side(tmp_path / "s").records}
    probs, ids = torch.softmax(logits, dim=-1).topk(3, dim=-1)
    assert torch.equal(to_torch(recs["final.topk_ids"].load()), ids)
    torch.testing.assert_close(to_torch(recs["final.topk_probs"].load()), probs)


@pytest.mark.integration
def test_patch_block_forward_layer_index(tmp_path):
    """The index attribute names the layer; without one, the order of first execution does."""

    class Block(torch.nn.Module):
        def forward(self, x):
            return x + 1

    blocks = [Block(), Block(), Block()]
    blocks[0].layer_id, blocks[1].layer_id = 7, 2
    with (
        ffdebug.capture(None, dir=tmp_path, side="p"),
        ffdebug.patch_block_forward(Block, layer_attr="layer_id"),
    ):
        for b in blocks:
            b(torch.zeros(2))
    keys = [r.key for r in open_side(tmp_path / "p").records]
    assert keys == [f"L{i:03d}.{s}" for i in (7, 2, 0) for s in ("hidden_in", "hidden_out")]


@pytest.mark.integration
def test_stats_only_record_holds_hand_derived_statistics(tmp_path):
    """x = [1, −2, 0, NaN, +Inf, 3]: the finite values 1, −2, 0, 3 give mean 2/4 = 0.5,
    E[x²] = (1 + 4 + 0 + 9)/4 = 3.5, population variance 3.5 − 0.25 = 3.25 → std √3.25;
    min −2, max 3, absmax 3, l2 √14; one NaN, one Inf, one zero, six elements."""
    import math

    x = torch.tensor([1.0, -2.0, 0.0, float("nan"), float("inf"), 3.0])
    with ffdebug.capture(None, dir=tmp_path, side="s", mode="stats"):
        ffdebug.tap("h", x)
    (rec,) = open_side(tmp_path / "s").records
    assert not rec.has_payload
    st = rec.stats
    assert st["mean"] == 0.5 and st["std"] == math.sqrt(3.25)
    assert (st["min"], st["max"], st["absmax"]) == (-2.0, 3.0, 3.0)
    assert st["l2"] == math.sqrt(14.0)
    assert (st["nan"], st["inf"], st["zero"], st["numel"]) == (1, 1, 1, 6)


def test_install_on_a_deep_copy_of_an_installed_model_installs_once(tmp_path, tiny_llama, input_ids):
    """One session: the model is installed, deep-copied, the copy installed; a forward of the copy
    writes each stage once (the copy's inherited hooks are dropped), the original keeps its hooks."""
    import copy

    with ffdebug.capture(tiny_llama, dir=tmp_path, side="copy") as original:
        clone = copy.deepcopy(tiny_llama)
        installed = ffdebug.install(clone)
        assert installed.num_hooks == original.num_hooks
        with torch.no_grad():
            clone(input_ids=input_ids)
        installed.remove()
    copied = open_side(tmp_path / "copy")
    assert len(copied.records) == len(_expected_keys(4)), "a stage of the copy was captured twice"
    assert set(copied.keys()) == _expected_keys(4)
    with ffdebug.capture(dir=tmp_path, side="orig"):
        ffdebug.install(tiny_llama)
        with torch.no_grad():
            tiny_llama(input_ids=input_ids)
    assert set(open_side(tmp_path / "orig").keys()) == _expected_keys(4)


@pytest.mark.parametrize("mode", ["stats", "sketch"])
def test_gated_inputs_keep_their_payload_in_stats_and_sketch_modes(tiny_llama, input_ids, tmp_path, mode):
    """The input gate reads position_ids / attention_mask values, so they are written in full in
    every mode (like the input ids); a run with equal inputs passes the gate."""
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    for side in ("ref", "target"):
        with ffdebug.capture(tiny_llama, dir=tmp_path, side=side, mode=mode):
            tiny_llama(input_ids, position_ids=positions)
    store = open_side(str(tmp_path / "ref"))
    pos = next(r for r in store.records if r.key == "embed.position_ids")
    assert pos.has_payload and torch.equal(to_torch(pos.load()), positions)
    res = ffdebug.compare(tmp_path / "ref", tmp_path / "target", allow_partial=True)
    assert not res.failed()


def test_gradient_keeps_the_forward_tags_not_the_backward_ones(tmp_path, tiny_llama, input_ids):
    """A tag set at forward and changed before backward is the forward's on the grad record; a tag
    that only the backward's context has does not reach it."""
    with ffdebug.capture(tiny_llama, dir=tmp_path, side="g", grads=True, stages="L001.hidden_out*"):
        with ffdebug.step(optimizer_step=3, phase="train"):
            out = tiny_llama(input_ids=input_ids)
        with ffdebug.step(optimizer_step=4, phase="eval", micro=1):
            out.logits.sum().backward()
    recs = {r.io: r for r in open_side(tmp_path / "g").records}
    assert (recs["grad"].key, recs["grad"].step, recs["grad"].phase) == (
        "L001.hidden_out.grad",
        {"optimizer_step": 3},
        "train",
    )
    assert (recs["out"].step, recs["out"].phase) == ({"optimizer_step": 3}, "train")


def test_step_tags_are_per_context(tmp_path):
    """Step tags are context variables: a thread started inside `ffdebug.step` does not see them,
    and they are gone after the block."""
    import threading

    from ffdebug.capture.state import current_tags

    seen: list = []
    with ffdebug.step(optimizer_step=1):
        t = threading.Thread(target=lambda: seen.append(current_tags()))
        t.start()
        t.join()
        assert current_tags() == {"optimizer_step": 1}
    assert seen == [{}] and current_tags() == {}


def test_a_module_two_installed_models_share_is_captured_by_the_one_running(tmp_path, tiny_llama, input_ids):
    """A drafter that reuses its target's embedding and one of its blocks (self-speculative style):
    each forward captures the shared modules once, under its own call and layer numbering."""
    target = tiny_llama

    class Drafter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = target.get_input_embeddings()  # shared
            self.layers = torch.nn.ModuleList([target.model.layers[1]])  # shared
            self.norm = torch.nn.LayerNorm(target.config.hidden_size)

        def forward(self, ids):
            h = self.embed(ids)
            pos = torch.arange(ids.shape[1])[None]
            rope = target.model.rotary_emb(h, pos)
            for layer in self.layers:
                h = layer(h, attention_mask=None, position_ids=pos, position_embeddings=rope)
                h = h[0] if isinstance(h, tuple) else h
            return self.norm(h)

    drafter = Drafter().eval()
    with ffdebug.capture(dir=str(tmp_path), side="s"), torch.no_grad():
        ffdebug.install(target)
        ffdebug.install(drafter)
        with ffdebug.step(optimizer_step=0, phase="train"):
            target(input_ids)
            drafter(input_ids)
    records = open_side(str(tmp_path / "s")).records
    keys = {call: [r.key for r in records if r.call == call] for call in (0, 1)}
    layers = target.config.num_hidden_layers
    for call, expected_layers in ((0, layers), (1, 1)):
        assert keys[call].count("embed.out") == 1, keys[call]
        hidden = [k for k in keys[call] if k.endswith(".hidden_in")]
        assert len(hidden) == expected_layers == len(set(hidden)), hidden
