"""An engine-style MLA port (DeepSeek-V3: fused q_a | kv_a, kv_b split per head, grouped routing with
a correction bias, a shared expert, a dense first layer; tests/helpers/mla_port.py) against HF: the
correct port pairs every role sub-stage and passes; each planted bug is named at its layer and role."""

from __future__ import annotations

import copy
import types

import pytest
import torch
import torch.nn.functional as F
from helpers import mla_port
from helpers.mla_port import make_mla_port, tiny_deepseek_v3

import ffdebug
from ffdebug.store.reader import open_side

pytestmark = pytest.mark.integration

MLA_KEYS = {
    "attn.latent.in", "attn.q_latent.out", "attn.kv_latent.out", "attn.k_rope.out",
    "attn.q_latent_norm.out", "attn.q.out", "attn.kv_latent_norm.out", "attn.k_nope.out",
    "attn.v.out", "attn.q_rot", "attn.k_rot", "attn.context.out", "attn.o.in", "attn.o.out",
}  # fmt: skip
ROUTING_KEYS = {
    "moe.router.out",
    "moe.group_scores.out",
    "moe.group_topk_ids.out",
    "moe.topk_ids.out",
    "moe.topk_weights.out",
}


@pytest.fixture(scope="module")
def hf():
    return tiny_deepseek_v3()


@pytest.fixture(scope="module")
def ref(hf, tmp_path_factory):
    return _dump(hf, tmp_path_factory.mktemp("mla"), "ref")


def _ids():
    return torch.randint(3, 1000, (2, 12), generator=torch.Generator().manual_seed(1))


def _dump(model, root, side):
    with ffdebug.capture(model, dir=root, side=side, substages=True), torch.no_grad():
        if side == "ref":
            model(input_ids=_ids())
        else:
            model(_ids())
    return root / side


def test_the_correct_port_pairs_every_mla_role_and_passes(hf, ref, tmp_path):
    tgt = _dump(make_mla_port(hf), tmp_path, "target")
    res = ffdebug.compare(ref, tgt)
    assert res.exit_code() == 0 and not res.coverage.only_ref and not res.coverage.only_target
    keys = {k.split(".", 1)[1] for k in open_side(tgt).keys() if k.startswith("L001.")}
    assert MLA_KEYS <= keys and not any("kv_up" in k or "q_up" in k for k in keys)
    assert ROUTING_KEYS <= keys and "moe.shared.out" in keys
    assert ffdebug.bisect(ref, tgt).exit_code() == 0


def _attn(port, layer):
    return port.stack[layer].mix


def _no_kv_norm(port, layer):
    _attn(port, layer).c_norm.forward = lambda x: x  # the kv latent norm skipped


def _kv_swap(port, layer):
    a = _attn(port, layer)
    assert a.nope == a.dv  # the swap keeps shapes: k_nope and v read each other's columns
    w = a.kv_up.weight.data.view(a.h, a.nope + a.dv, -1)
    a.kv_up.weight.data = torch.cat([w[:, a.nope :], w[:, : a.nope]], dim=1).reshape(a.kv_up.weight.shape)


def _rope_on_nope(port, layer):
    a = _attn(port, layer)

    def forward(self, x, cos, sin, mask=None):  # rotates the first d_rope columns of q (nope), not the last
        b, s, _ = x.shape
        q_lat, c, k_pe = self.down(x).split([self.rq, self.rkv, self.rope], dim=-1)
        q = self.q_up(self.q_norm(q_lat)).view(b, s, self.h, self.nope + self.rope)
        q = torch.cat(
            [mla_port.rope_pairs(q[..., : self.rope], cos[:, :, None], sin[:, :, None]), q[..., self.rope :]],
            -1,
        )
        kv = self.kv_up(self.c_norm(c)).view(b, s, self.h, self.nope + self.dv)
        k_nope, v = kv.split([self.nope, self.dv], dim=-1)
        k_pe = mla_port.rope_pairs(k_pe[:, :, None], cos[:, :, None], sin[:, :, None])
        k = torch.cat([k_nope, k_pe.expand(b, s, self.h, self.rope)], dim=-1).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k, v.transpose(1, 2), is_causal=True, scale=self.scale
        )
        return self.out(o.transpose(1, 2).reshape(b, s, -1))

    a.forward = types.MethodType(forward, a)


def _bias_in_weights(port, layer):
    moe = port.stack[layer].ff
    plain = moe.route

    def route(flat):
        ids, _ = plain(flat)
        scores = F.linear(flat.float(), moe.score.weight.float()).sigmoid() + moe.bias  # bias kept
        w = scores.gather(1, ids)
        return ids, w / (w.sum(-1, keepdim=True) + 1e-20) * moe.factor

    moe.route = route


def _groups_ignored(port, layer):
    moe = port.stack[layer].ff
    moe.keep = moe.groups  # node-limited routing off: every group stays eligible


BUGS = [  # (plant, layer, the role sub-stage bisect must name)
    (_no_kv_norm, 1, "attn.kv_latent_norm"),
    (_kv_swap, 2, "attn.k_nope"),
    (_rope_on_nope, 0, "attn.q_rot"),
    (_bias_in_weights, 2, "moe.topk_weights"),
    (_groups_ignored, 2, "moe.group_topk_ids"),
]


@pytest.mark.parametrize("plant, layer, role", BUGS, ids=[b[0].__name__.strip("_") for b in BUGS])
def test_a_planted_port_bug_is_named_at_its_layer_and_role(hf, ref, tmp_path, plant, layer, role):
    port = copy.deepcopy(make_mla_port(hf))
    plant(port, layer)
    r = ffdebug.bisect(ref, _dump(port, tmp_path, "target"))
    assert r.exit_code() == 1
    assert (r.first_divergence.layer, r.sub_stage.stage.removesuffix(".out")) == (layer, role), r.conclusion


@pytest.mark.parametrize("substages", [False, True], ids=["blocks", "substages"])
def test_the_absorbed_port_passes_with_its_form_declared(hf, ref, tmp_path, substages):
    """kv_b folded into W_kc / W_vc (per-head batched matmuls; the kernel attends over the latent,
    one kv head): no per-head k_nope / v exist there. The side declares its form and coverage
    excuses exactly those kinds; the rope parts read at the kernel pair with the unabsorbed ones."""
    port = make_mla_port(hf, absorbed=True)
    with ffdebug.capture(port, dir=tmp_path, side="target", substages=substages), torch.no_grad():
        port(_ids())
    if not substages:
        with ffdebug.capture(hf, dir=tmp_path, side="ref"), torch.no_grad():
            hf(input_ids=_ids())
        ref = tmp_path / "ref"
    res = ffdebug.compare(ref, tmp_path / "target")
    assert res.exit_code() == 0 and res.complete, res.coverage.missing
    rot = next(r for r in open_side(tmp_path / "target").records if r.key == "L000.attn.k_rot")
    assert tuple(rot.shape) == (2, 12, 1, 4) and rot.extra["rope_part"] == [16, 20]  # [c | k_pe], one head
    if substages:
        said = [s for s in res.coverage.selected_out if "absorbed low-rank attention" in s]
        assert said and "attn.k_nope.out" in said[0] and "attn.q_absorbed.out" in said[0]
        assert ffdebug.bisect(ref, tmp_path / "target").exit_code() == 0


def test_a_bug_in_the_absorbed_value_projection_is_named_after_the_kernel(hf, ref, tmp_path):
    port = make_mla_port(hf, absorbed=True)
    with torch.no_grad():
        port.stack[1].mix.w_vc.mul_(1.5)
    r = ffdebug.bisect(ref, _dump(port, tmp_path, "target"))
    assert r.exit_code() == 1 and r.first_divergence.layer == 1
    assert r.sub_stage.stage == "attn.context.out", r.conclusion  # W_vc's output: the context


def test_a_shared_expert_the_port_never_runs_is_named(hf, ref, tmp_path):
    port = make_mla_port(hf)
    port.stack[2].ff.common.forward = lambda x: torch.zeros_like(x)  # dropped: no projection runs
    r = ffdebug.bisect(ref, _dump(port, tmp_path, "target"))
    assert r.exit_code() == 1 and (r.first_divergence.layer, r.first_divergence.stage) == (2, "ffn_out")
    assert "moe.shared.out" in r.missing_inside and not any(k.startswith("attn") for k in r.missing_inside)
    assert "the target wrote none of moe.shared.* (6 stages) there" in r.conclusion


@pytest.mark.parametrize("substages", [False, True], ids=["blocks", "substages"])
def test_a_packed_port_pairs_with_a_padded_reference_through_its_cu_seqlens(hf, tmp_path, substages):
    """The port runs `[T, hidden]` tokens of two sequences (12 and 7) with `cu_seqlens`; HF runs
    them right-padded with an attention mask. The layout comes from the forward's own `cu_seqlens`
    (no tap): every stage, routing and per-expert rows included, pairs through it and passes."""
    from helpers.mla_port import pack

    ids = _ids()
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 7:] = 0
    packed, cu = pack(ids, mask)
    port = make_mla_port(hf, packed=True)
    with ffdebug.capture(hf, dir=tmp_path, side="ref", substages=substages), torch.no_grad():
        hf(input_ids=ids, attention_mask=mask)
    with ffdebug.capture(port, dir=tmp_path, side="target", substages=substages), torch.no_grad():
        port(packed, cu)
    lens = next(r for r in open_side(tmp_path / "target").records if r.key == "embed.seq_lens")
    assert lens.load().tolist() == [12, 7]
    res = ffdebug.compare(tmp_path / "ref", tmp_path / "target")
    assert res.exit_code() == 0 and res.complete, (
        res.coverage.missing,
        [s.key for s in res.stages if not s.ok],
    )
    routed = [s for s in res.stages if s.key.startswith("L002.moe.")]
    assert not substages or {"L002.moe.topk_ids.out", "L002.moe.group_topk_ids.out"} <= {
        s.key for s in routed
    }


def test_a_leak_across_packed_sequences_names_the_sequence_and_its_tokens(hf, tmp_path):
    """Causal attention over the whole pack: sequence 0 is untouched, sequence 1 (7 tokens) reads
    sequence 0. Bisect names layer 0's attention and, in the reference's coordinates, which
    sequence and tokens are wrong."""
    from helpers.mla_port import pack

    ids = _ids()
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 7:] = 0
    port = make_mla_port(hf, packed=True)
    port.leak = True
    with ffdebug.capture(hf, dir=tmp_path, side="ref"), torch.no_grad():
        hf(input_ids=ids, attention_mask=mask)
    with ffdebug.capture(port, dir=tmp_path, side="target"), torch.no_grad():
        port(*pack(ids, mask))
    r = ffdebug.bisect(tmp_path / "ref", tmp_path / "target")
    assert r.exit_code() == 1 and (r.first_divergence.layer, r.first_divergence.stage) == (0, "attn_out")
    runs = r.first_divergence.token_runs
    assert [x for x in runs if x["state"] == "wrong"] == [{"sequence": 1, "tokens": [0, 6], "state": "wrong"}]
    assert "sequence 1, tokens 0-6 wrong; sequence 0 " in r.conclusion


def test_weights_diff_relates_an_absorbed_ports_per_head_split_and_names_a_swapped_layer(hf):
    """kv_b is cut per head into W_kc [H, d_nope, r_kv] and W_vc [H, r_kv, d_v] (transposed): with
    no map, every tensor relates by content, slot by slot; a k_nope / v swap in one layer is named
    per head against the convention the other layers show."""
    port = make_mla_port(hf, absorbed=True)
    res = ffdebug.weights_diff(hf, port)
    assert not res.failed() and not res.content["unmatched_ref"] and not res.content["unmatched_target"]
    kv_b = "ref model.layers.#.self_attn.kv_b_proj.weight = stack.{0}.mix.w_kc[0] + stack.{0}.mix.w_vc[0].T"
    assert any(rule.startswith(kv_b) for rule in res.content["rules"])
    a = port.stack[1].mix
    with torch.no_grad():
        kc, vc = a.w_kc.detach().clone(), a.w_vc.detach().clone()
        a.w_kc.copy_(vc.transpose(1, 2))
        a.w_vc.copy_(kc.transpose(1, 2))
    res = ffdebug.weights_diff(hf, port)
    swapped = {t.name for t in res.tensors if t.finding == "swapped"}
    assert res.failed() and swapped == {f"stack.1.mix.w_{x}c[{h}]" for x in "kv" for h in range(4)}


def test_weights_diff_names_kv_b_of_every_layer_for_a_k_nope_v_swap(hf):
    """A converter that wrote each head's `[k_nope | v]` rows of kv_b as `[v | k_nope]` in every
    layer, under HF's names: kv_b of every layer is `permuted`, its rows named; nothing else."""
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    heads, nope, dv = 4, 8, 8
    kv_b = [k for k in sd if k.endswith("kv_b_proj.weight")]
    for k in kv_b:
        w = sd[k].view(heads, nope + dv, -1)
        sd[k] = torch.cat([w[:, nope:], w[:, :nope]], 1).reshape(sd[k].shape)
    res = ffdebug.weights_diff(hf, sd)
    probs = {t.name: t for t in res.tensors if t.finding != "equal"}
    assert res.failed() and set(probs) == set(kv_b) and len(kv_b) == 3
    # reference rows 0:8 (head 0's k_nope) are the port's rows 8:16, 8:16 are 0:8, per head of 16
    assert {(t.finding, t.layout["rows"]) for t in probs.values()} == {("permuted", "8:16, 0:8 +16k (k<4)")}


def test_the_low_rank_reading_holds_in_bf16_as_in_fp32(hf, tmp_path):
    """A bf16 model is read with the same role sub-stages as its fp32 original: the rules that
    find the kv latent (the piece an up-projection reads normalised) allow bf16's rounding, so a
    precision-only comparison pairs every stage (it once lost the low-rank reading in bf16 and
    ended incomplete on every MLA family)."""
    ids = torch.randint(0, hf.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    low = copy.deepcopy(hf).to(torch.bfloat16)
    for side, model in (("ref", hf), ("bf16", low)):
        with ffdebug.capture(model, dir=tmp_path, side=side, substages=True), torch.no_grad():
            model(input_ids=ids)
    keys = {side: {r.key for r in open_side(tmp_path / side).records} for side in ("ref", "bf16")}
    assert {f"L001.{k}" for k in MLA_KEYS} <= keys["bf16"] and keys["ref"] == keys["bf16"]
    res = ffdebug.compare(tmp_path / "ref", tmp_path / "bf16")
    assert res.complete and res.exit_code() == 0
