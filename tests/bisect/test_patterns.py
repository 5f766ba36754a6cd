"""Honest patterns on ports: a from-scratch port of HF Llama (tests/helpers/llama_ports.py) and a tiny
Qwen3-MoE, each with one planted bug, each found by one `bisect` (docs/bisect.md "Bisecting").

The noise run is the reference with every linear layer's reduction split in two partial GEMMs
(``helpers.bisect.noise.split_reduction``: what another thread count does where it changes any bit,
which depends on the CPU), so its bits differ from layer 0's attention projections on, on every
machine (checked below). Targets with a one-layer bug are dumped with the same split, so no exact
prefix helps: the jump is decided by the error budget alone.

Measured here (added error of the first introducing layer / the next introducing one): dropped
residual 0.9 / none after saturation; unloaded down projection 0.35 / none; eps outside the sqrt
1.0e-3 / 1.6e-4 (6.4x); q/k norm skipped 0.134 / none (the next adds 4% of what it inherits).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers.bisect.bisect_models import (
    bf16_router,
    input_ids,
    qk_norm_skipped,
    qwen3_moe,
    topk_not_renormalised,
)
from helpers.bisect.noise import split_reduction
from helpers.llama_ports import (
    down_proj_not_loaded,
    dropped_residual,
    eps_outside_sqrt,
    hf_for_ports,
    make_port,
    rope_interleaved,
)

import ffdebug
from ffdebug.verdict import Severity

pytestmark = pytest.mark.numeric  # CI runs these again at ATEN_CPU_CAPABILITY=default

BAD = 2  # the layer of the one-layer bugs


def _dump(model, directory, side, split=False, rotary="helpers.llama_ports:rope"):
    ids = input_ids(seq=24)
    with split_reduction(model) if split else contextlib.nullcontext():
        with ffdebug.tap_function(rotary, ("attn.q_rot", "attn.k_rot")):
            with ffdebug.capture(model, dir=directory, side=side), torch.no_grad():
                model(input_ids=ids)
    return f"{directory}/{side}"


@pytest.fixture(scope="module")
def ports(tmp_path_factory):
    d = tmp_path_factory.mktemp("ports")
    hf = hf_for_ports()
    port = make_port(hf)
    out = {"ref": _dump(hf, d, "ref"), "noise": _dump(hf, d, "noise", split=True)}
    out["port"] = _dump(port, d, "port")
    out["eps"] = _dump(eps_outside_sqrt(port), d, "eps")
    out["resid"] = _dump(dropped_residual(port, BAD), d, "resid", split=True)
    out["down"] = _dump(down_proj_not_loaded(port, BAD), d, "down", split=True)
    sharp = hf_for_ports(qk_scale=20.0)  # sharp attention: rotary positions matter
    out["ref_sharp"] = _dump(sharp, d, "ref_sharp")
    rot = "helpers.llama_ports:rope_interleaved"
    out["rope"] = _dump(make_port(sharp, rotary=rope_interleaved), d, "rope", rotary=rot)
    return out


def test_the_noise_run_differs_in_bits_but_not_in_value(ports):
    res = ffdebug.compare(ports["ref"], ports["noise"])
    assert min(s.bit_equal for s in res.stages) < 1.0
    assert max(s.rel for s in res.stages) < 1e-5 and res.verdict is Severity.OK


def test_a_split_reduction_is_the_same_linear_in_another_order_and_is_undone():
    layer = torch.nn.Linear(64, 8)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = layer(x)
        with split_reduction(layer, parts=3):
            split = layer(x)
    assert not torch.equal(split, plain)  # another summation order: other last bits
    torch.testing.assert_close(split, plain, rtol=0, atol=8 * float(plain.abs().max()) * 2**-24)
    assert "forward" not in vars(layer) and torch.equal(layer(x), plain)


def test_the_correct_port_passes_with_and_without_the_noise_run(ports):
    for noise in (None, ports["noise"]):
        r = ffdebug.bisect(ports["ref"], ports["port"], noise=noise)
        assert (r.pattern, r.judgement, r.failed()) == ("match", "ok", False), r.conclusion
        assert ffdebug.compare(ports["ref"], ports["port"], noise=noise).exit_code() == 0


def test_eps_outside_the_square_root_is_a_bug_at_layer_0_attention_norm_with_the_noise_run(ports):
    r = ffdebug.bisect(ports["ref"], ports["eps"], noise=ports["noise"])
    assert r.first_divergence.key == "L000.attn_norm_out"
    assert r.judgement == "bug" and r.signal and r.failed()
    c = ffdebug.compare(ports["ref"], ports["eps"], noise=ports["noise"])
    norm = next(s for s in c.stages if s.key == "L000.attn_norm_out")
    assert norm.rel < 0.01 and norm.beyond_noise  # inside the ok band, beyond the noise run
    assert norm.severity is Severity.DIVERGE and "exact-prefix rule" in " ".join(norm.notes)
    later = next(s for s in c.stages if s.key == "L001.attn_out")  # the noise run differs there
    assert later.noise_rel > 0 and later.rel >= 2 * later.noise_rel and later.beyond_noise
    assert c.failed()


def test_a_dropped_residual_in_one_layer_is_a_jump_at_that_layer(ports):
    r = ffdebug.bisect(ports["ref"], ports["resid"])
    assert (r.pattern, r.first_divergence.layer) == ("jump", BAD)
    assert [row.layer for row in r.layers if row.introduces] == [BAD]
    assert r.saturated_after == BAD and "cannot be judged" in r.reason and "only layer" not in r.reason


def test_an_unloaded_down_projection_is_a_jump_at_that_layers_mlp(ports):
    r = ffdebug.bisect(ports["ref"], ports["down"], noise=ports["noise"])
    assert (r.pattern, r.first_divergence.layer, r.first_divergence.stage) == ("jump", BAD, "ffn_out")
    assert [row.layer for row in r.layers if row.introduces] == [BAD]
    assert r.judgement.at_least(Severity.BUG)


def test_a_rotary_swap_in_every_layer_is_layer_0_attention_saturated_never_the_only_layer(ports):
    r = ffdebug.bisect(ports["ref_sharp"], ports["rope"])
    assert (r.first_divergence.layer, r.first_divergence.stage) == (0, "attn_out")
    assert r.sub_stage.stage == "attn.q_rot"
    assert r.saturated_after == 0 and r.to_json()["saturated_after"] == 0
    assert "only layer" not in r.reason and "cannot be judged" in r.reason
    assert all(not row.introduces for row in r.layers if row.layer > 0)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe")
    ids = input_ids(seq=24)
    ref = qwen3_moe()

    def dump(model, side):
        with ffdebug.capture(model, dir=d, side=side), torch.no_grad():
            model(input_ids=ids)
        return f"{d}/{side}"

    return {
        "ref": dump(ref, "ref"),
        "topk": dump(topk_not_renormalised(ref), "topk"),
        "bf16_router": dump(bf16_router(ref), "bf16_router"),
        "noise_bf16": dump(qwen3_moe().to(torch.bfloat16), "noise_bf16"),
        "qk": dump(qk_norm_skipped(ref, BAD), "qk"),
    }


def test_top_k_not_renormalised_is_a_layer_class_of_exactly_the_moe_layers(moe):
    r = ffdebug.bisect(moe["ref"], moe["topk"])
    assert r.pattern == "layer_class" and r.first_divergence.layer == 1
    classes = {c.layer_class: c for c in r.per_class}
    assert {k: c.introducing for k, c in classes.items()} == {"dense": [], "moe": [1, 3, 5]}


def test_a_bf16_router_with_a_bf16_noise_run_is_not_a_bug(moe):
    r = ffdebug.bisect(moe["ref"], moe["bf16_router"], noise=moe["noise_bf16"])
    assert r.judgement.rank < Severity.BUG.rank and not r.failed(), r.conclusion
    assert r.pattern == "match"


def test_a_qk_norm_skipped_in_one_layer_is_a_jump(moe):
    r = ffdebug.bisect(moe["ref"], moe["qk"])
    assert (r.pattern, r.first_divergence.layer) == ("jump", BAD)
    assert [row.layer for row in r.layers if row.introduces] == [BAD]
