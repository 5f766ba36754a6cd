"""An engine-style GPT-NeoX port (parallel residual, partial rotary, per-head interleaved fused
q / k / v read through its own view, no hint word in any name, logits inside a tuple;
tests/helpers/neox_port.py) against HF: the correct port passes with and without role sub-stages;
an attention bug in it is named inside attention, not at the norm before it."""

from __future__ import annotations

import pytest
import torch
from helpers.neox_port import make_neox_port, tiny_neox

import ffdebug

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def hf():
    return tiny_neox()


def _ids():
    return torch.randint(3, 1000, (2, 12), generator=torch.Generator().manual_seed(1))


def _pair(hf, port, root, substages):
    for side, model in (("ref", hf), ("target", port)):
        with ffdebug.capture(model, dir=root, side=side, substages=substages), torch.no_grad():
            model(input_ids=_ids()) if side == "ref" else model(_ids())
    return root / "ref", root / "target"


@pytest.mark.parametrize("substages", [False, True], ids=["blocks", "substages"])
def test_the_correct_port_passes(hf, tmp_path, substages):
    ref, tgt = _pair(hf, make_neox_port(hf), tmp_path, substages)
    res = ffdebug.compare(ref, tgt)
    assert res.exit_code() == 0 and res.coverage.final_compared, res.coverage.only_ref
    assert ffdebug.bisect(ref, tgt).exit_code() == 0


@pytest.mark.parametrize(
    "bug, role",
    [
        (dict(rotary_dims=8), "attn.q_rot"),  # rotary over the whole head, not its first 2 dims
        (dict(qkv_blocks=True), "attn.q"),  # the per-head interleaved weight read as [q | k | v]
    ],
    ids=["full-head-rotary", "qkv-layout"],
)
def test_an_attention_bug_is_named_inside_attention(hf, tmp_path, bug, role):
    ref, tgt = _pair(hf, make_neox_port(hf, **bug), tmp_path, substages=True)
    r = ffdebug.bisect(ref, tgt)
    assert r.exit_code() == 1 and r.first_divergence.layer == 0 and r.first_divergence.stage == "attn_out"
    assert r.sub_stage.stage.removesuffix(".out") == role, r.conclusion
