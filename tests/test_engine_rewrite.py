"""The engine-style rewrite selftest --engine compares against (ffdebug/selftest/rewrite.py), and
what it needs of the comparison: a packed `[1, T, ...]` side and its attention probabilities align
with a padded reference, a packed pair's worst head and max-error coordinate read in the
reference's terms, a norm is a norm whatever its eps."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

import ffdebug
from ffdebug.selftest.families import inputs
from ffdebug.selftest.models import build, resolve
from ffdebug.selftest.rewrite import engine_rewrite
from ffdebug.selftest.shrink import Sizes
from ffdebug.store.reader import open_side


def _align(padded, packed, *layouts):
    """`comparison.align.align` on numpy arrays (what records load), its arrays back as tensors."""
    from ffdebug.comparison.align import align

    out = align(padded.numpy(), packed.numpy(), *layouts)
    if out is None:
        return None
    return tuple(torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x for x in out)


@pytest.fixture(scope="module")
def llama():
    spec = resolve("llama")
    model = build(spec, Sizes(), 0)
    return model, inputs(spec.family, model, 2, 16, 0, 128)


def test_the_rewrite_fuses_renames_and_packs_without_changing_the_logits(llama):
    model, feed = llama
    layers = model.config.num_hidden_layers
    rw = engine_rewrite(model, feed, causal_lm=True)
    # q / k / v and gate / up of every layer: found by what they read, not by their names
    assert len(rw.fused) == 2 * layers
    assert sorted({f.split(": ")[1] for f in rw.fused}) == ["gate_proj + up_proj", "q_proj + k_proj + v_proj"]
    names = [n for n, _ in rw.module.named_modules()]
    assert not any(word in n for n in names for word in ("layers", "self_attn", "q_proj", "mlp", "norm"))
    linears = [m for m in rw.module.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 4 * layers + 1  # qkv, o, gate_up, down per layer; the head
    assert rw.packing.startswith("packed") and set(rw.feed) == {"input_ids", "cu_seqlens"}
    assert rw.feed["input_ids"].shape == (32,) and rw.feed["cu_seqlens"].tolist() == [0, 16, 32]
    with torch.no_grad():
        want = model(**feed).logits
        got = rw.module(**rw.feed).logits
    assert got.shape == (1, 32, want.shape[-1])
    torch.testing.assert_close(got.reshape(want.shape), want, rtol=1e-5, atol=1e-5)
    assert len(list(model.named_modules())) > len(names) - 3  # the original is left as it was
    assert any("q_proj" in n for n, _ in model.named_modules())


def test_a_planted_projection_patch_is_not_fused_away(llama):
    """A Linear with a hook (a planted mutation) keeps its own call: it is left out of its group."""
    model, feed = llama
    import copy

    patched = copy.deepcopy(model)
    patched.model.layers[1].self_attn.k_proj.register_forward_hook(lambda m, a, o: o * 2)
    rw = engine_rewrite(patched, feed, causal_lm=False)
    assert rw.fused.count("LlamaAttention: q_proj + v_proj") == 1  # layer 1's k_proj stays apart
    assert rw.fused.count("LlamaAttention: q_proj + k_proj + v_proj") == model.config.num_hidden_layers - 1
    with torch.no_grad():
        torch.testing.assert_close(rw.module(**rw.feed).logits, patched(**feed).logits)


def test_the_rewrite_keeps_the_keys_a_forward_indexes_a_module_dict_with():
    """Experts held in a `ModuleDict` and looked up by key (`experts[f"expert_{i}"]`, NLLB-MoE and
    Switch Transformers) run as before; the modules around them are renamed."""

    class Routed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(8, 2)
            self.experts = torch.nn.ModuleDict({f"expert_{i}": torch.nn.Linear(8, 8) for i in range(2)})

        def forward(self, x):
            pick = self.gate(x).argmax(-1, keepdim=True)
            outs = [self.experts[f"expert_{i}"](x) for i in range(2)]
            return torch.where(pick == 0, outs[0], outs[1])

    torch.manual_seed(0)
    model, x = Routed().eval(), torch.randn(3, 8)
    rw = engine_rewrite(model, {"x": x}, causal_lm=False)
    names = {n for n, _ in rw.module.named_modules()}
    assert "experts.expert_0" not in names and any(n.endswith(".expert_0") for n in names)
    with torch.no_grad():
        torch.testing.assert_close(rw.module(x), model(x))


@pytest.mark.integration
def test_the_rewrite_of_a_correct_model_passes_and_a_head_bug_is_named_in_reference_terms(llama, tmp_path):
    """Padded HF reference vs its packed, fused, renamed rewrite: exit 0, coverage complete; with
    head 2 of layer 1's attention context zeroed, bisect names layer 1, attn.context, head 2, and
    the largest error's sequence and token in the reference's batch."""
    model, feed = llama
    with ffdebug.capture(model, dir=tmp_path, side="ref", substages=True), torch.no_grad():
        model(**feed)
    rw = engine_rewrite(model, feed, causal_lm=True)
    with ffdebug.capture(rw.module, dir=tmp_path, side="engine", substages=True), torch.no_grad():
        rw.module(**rw.feed)
    res = ffdebug.compare(tmp_path / "ref", tmp_path / "engine")
    assert res.exit_code() == 0 and res.complete, [s.key for s in res.stages if not s.ok]
    probs = [s for s in res.stages if s.key == "L001.attn_out.1"]
    assert probs and any("diagonal block" in n for n in probs[0].notes)

    head_dim = model.config.head_dim
    o_proj = model.model.layers[1].self_attn.o_proj

    def zero_head(m, args):
        x = args[0].clone()
        x[..., 2 * head_dim : 3 * head_dim] = 0
        return (x,)

    handle = o_proj.register_forward_pre_hook(zero_head)
    try:
        bad = engine_rewrite(model, feed, causal_lm=True)
    finally:
        handle.remove()
    with ffdebug.capture(bad.module, dir=tmp_path, side="bad", substages=True), torch.no_grad():
        bad.module(**bad.feed)
    r = ffdebug.bisect(tmp_path / "ref", tmp_path / "bad")
    assert r.exit_code() == 1 and r.first_divergence.layer == 1
    sub = r.sub_stage
    assert sub.stage.startswith("attn.context")
    rels = sub.per_head_rel
    assert max(range(len(rels)), key=lambda h: rels[h]) == 2 and sum(x > 0 for x in rels) == 1
    seq, token = sub.max_abs_at[:2]  # the reference's [batch, token], not the packed row
    assert 0 <= seq < 2 and 0 <= token < 16
    assert sub.max_abs_where is not None


@pytest.mark.integration
def test_attribution_re_runs_a_packed_target_on_the_padded_references_inputs(llama, tmp_path):
    """bisect --model-target on a packed rewrite: each block gets the reference's hidden_in as
    packed rows; a bug planted in layer 1 is local there and inherited after it."""
    model, feed = llama
    with ffdebug.capture(model, dir=tmp_path, side="ref"), torch.no_grad():
        model(**feed)
    import copy

    broken = copy.deepcopy(model)
    broken.model.layers[1].mlp.down_proj.register_forward_hook(lambda m, a, o: o * 1.5)
    rw = engine_rewrite(broken, feed, causal_lm=True)
    assert rw.packing.startswith("packed")
    with ffdebug.capture(rw.module, dir=tmp_path, side="engine"), torch.no_grad():
        rw.module(**rw.feed)
    r = ffdebug.bisect(
        tmp_path / "ref", tmp_path / "engine", model_ref=(model, feed), model_target=(rw.module, rw.feed)
    )
    rows = {a["layer"]: a["verdict"] for a in r.attribution}
    assert rows == {0: "clean", 1: "local", 2: "inherited", 3: "inherited"}, r.attribution


@pytest.mark.integration
def test_attribution_does_not_call_a_block_local_for_its_rounding(llama, tmp_path):
    """A block whose output differs from the reference's in the last bits only (an engine computing
    it in another order; here one ulp-level scale) is not local; a real bug two layers on is."""
    model, feed = llama
    with ffdebug.capture(model, dir=tmp_path, side="ref"), torch.no_grad():
        model(**feed)
    import copy

    target = copy.deepcopy(model)
    target.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, a, o: o * (1 + 2**-22))
    target.model.layers[2].mlp.down_proj.register_forward_hook(lambda m, a, o: o * 1.5)
    with ffdebug.capture(target, dir=tmp_path, side="target"), torch.no_grad():
        target(**feed)
    r = ffdebug.bisect(
        tmp_path / "ref", tmp_path / "target", model_ref=(model, feed), model_target=(target, feed)
    )
    rows = {a["layer"]: a for a in r.attribution}
    assert 0 < rows[0]["local_rel"] < 1e-6 and rows[0]["verdict"] != "local", rows[0]
    assert rows[2]["verdict"] == "local" and r.first_divergence.layer == 2, r.attribution


def test_a_padded_reference_input_is_laid_out_as_the_packed_blocks():
    from ffdebug.bisection.attribution import as_packed

    padded = torch.arange(2 * 3 * 4.0).reshape(2, 3, 4)
    assert as_packed(padded, torch.zeros(1, 6, 4)).reshape(6, 4).tolist() == padded.reshape(6, 4).tolist()
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    rows = as_packed(padded, torch.zeros(5, 4), mask)
    assert rows.tolist() == padded.reshape(6, 4)[:5].tolist()
    assert as_packed(padded, torch.zeros(1, 5, 4)) is None  # padding and no mask: no guess


def test_packed_attention_probabilities_compare_on_each_sequences_diagonal_block():
    """[B, H, S, S] with padding against a packed [1, H, T, T]: each sequence's block is compared;
    a query that reads another sequence's keys changes its block and fails."""
    from ffdebug.comparison.align import TokenLayout

    class Lens:
        has_payload = True

        def load(self):
            return np.array([5, 3])

    g = torch.Generator().manual_seed(0)
    blocks = [torch.softmax(torch.randn(4, n, n, generator=g), -1) for n in (5, 3)]
    padded = torch.zeros(2, 4, 6, 6)
    packed = torch.zeros(1, 4, 8, 8)
    padded[0, :, :5, :5], packed[0, :, :5, :5] = blocks[0], blocks[0]
    padded[1, :, :3, :3], packed[0, :, 5:, 5:] = blocks[1], blocks[1]
    ref, tgt, note, coords = _align(padded, packed, TokenLayout(peer_lens=Lens()), TokenLayout())
    assert torch.equal(ref, tgt) and ref.shape == (4, 25 + 9) and coords is None and "diagonal block" in note
    leak = packed.clone()
    leak[0, :, 5:, :] = torch.softmax(torch.randn(4, 3, 8, generator=g), -1)  # sequence 1 reads sequence 0
    ref, tgt, _, _ = _align(padded, leak, TokenLayout(peer_lens=Lens()), TokenLayout())
    assert torch.equal(ref[:, :25], tgt[:, :25]) and not torch.allclose(ref[:, 25:], tgt[:, 25:])


def test_a_norm_with_a_large_eps_is_still_a_norm_and_a_channel_scale_is_not():
    from ffdebug.models.roles import is_norm

    class Rms(torch.nn.Module):
        def __init__(self, eps):
            super().__init__()
            self.weight, self.eps = torch.nn.Parameter(torch.rand(16) + 0.5), eps

        def forward(self, x):
            return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gamma = torch.nn.Parameter(torch.rand(16) + 0.5)

        def forward(self, x):
            return self.gamma * x

    x = 0.02 * torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))  # rms 0.02 << sqrt(eps)
    norm = Rms(eps=0.1)
    with torch.no_grad():
        y = norm(x)
        assert y.pow(2).mean(-1).sqrt().mean() < 0.5  # far from unit rows: behaviour alone says no
        assert is_norm(norm, y, x) and not is_norm(norm, y)
        scale = Scale()
        assert not is_norm(scale, scale(x), x)


def test_a_packed_row_with_heads_flattened_aligns_token_by_token():
    """[1, T, H·D] (one packed row, heads not split) against [B, S, H, D]: each token's features in
    the padded side's grouping; a different element count stays a mismatch."""
    from ffdebug.comparison.align import TokenLayout

    class Lens:
        has_payload = True

        def load(self):
            return np.array([3, 3])

    padded = torch.randn(2, 3, 2, 4, generator=torch.Generator().manual_seed(1))
    packed = padded.reshape(1, 6, 8).clone()
    ref, tgt, note, coords = _align(padded, packed, TokenLayout(peer_lens=Lens()), TokenLayout())
    assert torch.equal(ref, tgt) and tgt.shape == (6, 2, 4) and coords.tolist()[3] == [1, 0]  # heads kept
    assert _align(padded, packed[..., :6], TokenLayout(peer_lens=Lens()), TokenLayout()) is None


def test_heads_first_layouts_align_with_token_first_ones():
    """A packed `[1, H, T, D]` (the layout a kernel reads) against a padded `[B, S, H, D]` or
    `[B, H, S, D]`: token by token in the reference's coordinates; a changed head of one sequence
    stays a difference."""
    from ffdebug.comparison.align import TokenLayout

    class Lens:
        has_payload = True

        def load(self):
            return np.array([3, 2])

    g = torch.Generator().manual_seed(2)
    tokens = torch.randn(5, 4, 8, generator=g)  # [T, H, D]
    padded = torch.zeros(2, 3, 4, 8)
    padded[0], padded[1, :2] = tokens[:3], tokens[3:]
    packed = tokens.transpose(0, 1).unsqueeze(0).contiguous()  # [1, H, T, D]
    for ref in (padded, padded.transpose(1, 2).contiguous()):  # token first, heads first
        r, t, note, coords = _align(ref, packed, TokenLayout(peer_lens=Lens()), TokenLayout())
        assert torch.equal(r, t) and r.shape == (5, 4, 8) and "heads first" in note
        assert coords.tolist()[3] == [1, 0]
    broken = packed.clone()
    broken[0, 2, 4] += 1.0  # head 2 of sequence 1's second token
    r, t, _, _ = _align(padded, broken, TokenLayout(peer_lens=Lens()), TokenLayout())
    assert (r != t).nonzero()[:, :2].unique(dim=0).tolist() == [[4, 2]]


def test_a_block_no_hint_places_reads_around_its_attending_child():
    """Renamed children (no name hint): the norm right before the attending child and the first
    norm-then-branch pair after it are the four pre-norm roles, a norm-led child (a gated norm)
    standing as a norm; extra children keep their own names. Without an attention kernel only
    norms may be left over. A block the hints placed keeps the hints' reading."""
    from ffdebug.models.roles import ATTENTION, BRANCH, NORM, NORM_LED, place_children

    hc = [("a4", BRANCH), ("i2", NORM), ("s0", ATTENTION), ("f5", BRANCH), ("p3", NORM), ("m1", BRANCH)]
    got = place_children(hc, {})
    assert got.names == {
        "i2": "attn_norm_out",
        "s0": "attn_out",
        "p3": "ffn_norm_out",
        "m1": "ffn_out",
        "a4": "a4.out",
        "f5": "f5.out",
    }
    assert set(got.unplaced) == {"a4", "f5"}
    gated = [("i2", NORM_LED), ("s0", ATTENTION), ("p3", NORM_LED), ("m1", BRANCH)]
    assert place_children(gated, {}).names == {
        "i2": "attn_norm_out",
        "s0": "attn_out",
        "p3": "ffn_norm_out",
        "m1": "ffn_out",
    }
    linear = [("p0", NORM), ("l1", NORM), ("a3", BRANCH), ("l2", NORM), ("f4", BRANCH)]
    assert place_children(linear, {}).names["l1"] == "attn_norm_out"
    assert place_children(
        [*linear[:3], ("x9", BRANCH), *linear[3:]], {}
    ).unplaced  # a branch left: no reading
    hinted = place_children(
        [("attn_hc", BRANCH), ("input_layernorm", NORM), ("self_attn", ATTENTION), ("mlp", BRANCH)],
        {"input_layernorm": "attn_norm_out", "self_attn": "attn_out", "mlp": "ffn_out"},
    )
    assert hinted.names["mlp"] == "ffn_out" and hinted.unplaced == ("attn_hc",)


def test_a_renamed_denoiser_block_reads_as_its_names_place_it():
    """diffusers' blocks that no order form reads, renamed (no name hint left), read as the names
    place the original: a joint block's one attention over both streams is `attn_out` and the
    branch after it on the hidden stream (its token count) `ffn_out`, the context stream's MLP
    and the adaptive norms by path; a single-stream block's one attention is `attn_out`; pre-norm
    pairs with two self-attentions are the first and last pairs. Names that place some children
    give way to the reading without them where it places more and agrees with each name placed."""
    from ffdebug.models.roles import ATTENTION, BRANCH, CROSS, NORM, NORM_LED, place_children

    # SD3 / Flux joint block: norm1, norm1_context, attn, norm2, ff, norm2_context, ff_context
    joint = [("n0", BRANCH), ("n1", NORM), ("a2", CROSS), ("n3", NORM), ("f4", BRANCH)]
    joint += [("n5", NORM), ("f6", BRANCH)]
    got = place_children(joint, {}, hidden_stream=frozenset({"f4", "n3"}), attended=frozenset({"a2"}))
    assert {k: v for k, v in got.names.items() if not v.endswith(".out")} == {
        "a2": "attn_out",
        "f4": "ffn_out",
    }
    assert set(got.unplaced) == {"n0", "n1", "n3", "n5", "f6"}
    # the context stream's MLP first: still the hidden stream's that is ffn_out
    swapped = place_children(joint, {}, hidden_stream=frozenset({"f6"}), attended=frozenset({"a2"}))
    assert swapped.names["f6"] == "ffn_out" and swapped.names["f4"] == "f4.out"
    # both streams of one token count: no MLP is told, the attention alone is placed
    same = place_children(joint, {}, hidden_stream=frozenset({"f4", "f6"}), attended=frozenset({"a2"}))
    assert same.names["a2"] == "attn_out" and "ffn_out" not in same.names.values()
    # a branch fed the encoder's states that never attended is no attention
    assert place_children(joint, {}, hidden_stream=frozenset({"f4"})).names["a2"] == "a2.out"
    # Flux's single-stream block: norm, proj_mlp, attn, proj_out
    single = [("n0", NORM), ("p1", BRANCH), ("a4", ATTENTION), ("p3", BRANCH)]
    got = place_children(single, {}, attended=frozenset({"a4"}))
    assert got.names == {"a4": "attn_out", "n0": "n0.out", "p1": "p1.out", "p3": "p3.out"}
    # UNet3D's BasicTransformerBlock: norm1 attn1 norm2 attn2 norm3 ff, both attentions self
    pairs = [("n0", NORM), ("a1", ATTENTION), ("n2", NORM), ("a3", ATTENTION), ("n4", NORM), ("f5", BRANCH)]
    assert place_children(pairs, {}).names == {
        "n0": "attn_norm_out",
        "a1": "attn_out",
        "n2": "n2.out",
        "a3": "a3.out",
        "n4": "ffn_norm_out",
        "f5": "ffn_out",
    }
    # DiT: the hints place `ff` only; the reading without them agrees and places the rest
    dit = [("norm1", NORM_LED), ("attn1", ATTENTION), ("norm3", NORM), ("ff", BRANCH)]
    assert place_children(dit, {"ff": "ffn_out"}).names == {
        "norm1": "attn_norm_out",
        "attn1": "attn_out",
        "norm3": "ffn_norm_out",
        "ff": "ffn_out",
    }
    # a hint the reading without names contradicts keeps the hints' reading
    contra = place_children(dit, {"ff": "attn_out"})
    assert contra.names["ff"] == "attn_out" and contra.names["attn1"] == "attn1.out"


def test_post_norm_decoders_read_by_order_without_a_kernel_or_with_a_normed_cross_attention():
    """LED's encoder layer (longformer attention: no kernel seen) is post-norm with the MLP in two
    parts; ProphetNet's decoder layer is post-norm with a cross-attention and its own norm after
    it. Order reads both, named or renamed alike."""
    from ffdebug.models.roles import BRANCH, CROSS, NORM, place_children

    led = [("s0", BRANCH), ("n1", NORM), ("f2", BRANCH), ("f3", BRANCH), ("n4", NORM)]
    assert place_children(led, {}).names == {
        "s0": "attn_out",
        "n1": "attn_norm_out",
        "f2": "f2.out",
        "f3": "ffn_out",
        "n4": "ffn_norm_out",
    }
    named = [("self_attn", BRANCH), ("ln", NORM), ("fc1", BRANCH), ("fc2", BRANCH), ("final", NORM)]
    assert place_children(named, {"self_attn": "attn_out"}).names == {
        "self_attn": "attn_out",
        "ln": "attn_norm_out",
        "fc1": "fc1.out",
        "fc2": "ffn_out",
        "final": "ffn_norm_out",
    }
    prophet = [("s0", BRANCH), ("n1", NORM), ("c2", CROSS), ("n3", NORM), ("f4", BRANCH), ("n5", NORM)]
    got = place_children(prophet, {})
    assert got.names == {
        "s0": "attn_out",
        "n1": "attn_norm_out",
        "c2": "cross_attn_out",
        "n3": "n3.out",
        "f4": "ffn_out",
        "n5": "ffn_norm_out",
    }
    assert got.by_order and got.unplaced == ("n3",)
    # pre-norm: the cross-attention's norm is the one before it
    pre = [
        ("n0", NORM),
        ("s1", BRANCH),
        ("n2", NORM),
        ("n3", NORM),
        ("c4", CROSS),
        ("n5", NORM),
        ("f6", BRANCH),
    ]
    assert place_children(pre, {}).names["n3"] == "n3.out"


def _compare_with_its_rewrite(spec: str, tmp_path, causal_lm: bool):
    """`spec` built tiny, dumped as the reference and as its engine rewrite, compared."""
    s = resolve(spec)
    model = build(s, Sizes(), 0)
    feed = inputs(s.family, model, 2, 16, 0, 128)
    rw = engine_rewrite(model, feed, causal_lm=causal_lm)
    for side, module, values in (("ref", model, feed), ("engine", rw.module, rw.feed)):
        with ffdebug.capture(module, dir=tmp_path, side=side, substages=True), torch.no_grad():
            module(**values)
        # one tensor under one key once (a key taken twice in a call, e.g. by two attention
        # kernels, is numbered by the comparison: those records differ)
        records = Counter(
            (r.key, r.call, r.invocation, r.shape, tuple(sorted(r.stats.items())))
            for r in open_side(tmp_path / side).records
        )
        twice = [k[:3] for k, n in records.items() if n > 1]
        assert not twice, (side, twice[:4])
    return ffdebug.compare(tmp_path / "ref", tmp_path / "engine")


@pytest.mark.integration
@pytest.mark.parametrize(
    "spec",
    [
        "bert-generation",  # attention / intermediate / output children: placed by the attending one
        "bart",  # post-norm, the MLP as two Linear children (fc1, fc2)
        "trocr",  # heads folded into the batch (bmm attention), q / k / v defined k, v, q
        "megatron-bert",  # q / k / v of the attention's own norm, one of them fused on the target
        "rwkv",  # no attention kernel, an embedding norm in block 0; a fused key | receptance
        "axk2",  # gated norms (a norm child and a gate MLP), q_a fused with kv_a but read by no role
        "bailing_hybrid",  # MLA without a q latent, the head gate fused after kv_a: [q | kv | k_rope | g]
        "minimax",  # a role's q fused with a gate named by path
        "gpt_neox_japanese",  # the rotary tap heads-first on the packed side only
        "xlm",  # an attention module standing as the block, its children bare projections
        "longcat_flash",  # lists of like sublayers by path; q_a | kv_a fused around q_b; identity experts
        "deepseek_v4",  # a q latent fused with one plain kv projection: [q_latent | kv], no kv latent
        "FSMTForConditionalGeneration",  # a cross-attention fed the block's encoder states as `key=`
        "inkling2_text",  # an input mixer that attends before the norm-led attention
        "MarianMTModel",  # a decoder's self-attention beside its cross-attention, post-norm
        "LEDForConditionalGeneration",  # longformer attention: no kernel seen, post-norm, fc1 / fc2
        "ProphetNetForConditionalGeneration",  # post-norm decoder, a cross-attention with its own norm
    ],
)
def test_the_rewrite_of_a_renamed_family_pairs_completely(spec, tmp_path):
    """Families whose reference is named by attribute names: their renamed rewrite (nothing of
    those names left) pairs every stage and passes."""
    res = _compare_with_its_rewrite(spec, tmp_path, causal_lm=True)
    assert res.exit_code() == 0 and res.complete, (
        res.coverage.missing,
        [x.key for x in res.stages if not x.ok],
    )
    if spec == "megatron-bert":  # q / k / v read the attention's own norm: role sub-stages on both sides
        keys = {x.key for x in res.stages}
        assert {"L000.attn.q.out", "L000.attn.k.out", "L000.attn.v.out"} <= keys


@pytest.mark.integration
@pytest.mark.parametrize(
    "spec",
    [
        "MochiTransformer3DModel",  # a SwiGLU whose gate is the second half of one projection
        "Flux2Transformer2DModel",  # a joint block: one attention over both streams, an MLP per stream
        "FluxTransformer2DModel",  # single-stream blocks: one attention beside parallel projections
        "DiTTransformer2DModel",  # the names place `ff` alone; the order places the adaptive norm too
        "UNet3DConditionModel",  # two self-attentions in one block of pre-norm pairs
        "HunyuanImageTransformer2DModel",  # q / k / v of [image | text] tokens the attention concatenates
        "MobileViTForImageClassification",  # inner layers by path: a fused qkv and an up-projection of
        # q + k's width, every layer's input alike (one token per patch): the whole q / k / v first
    ],
)
def test_the_rewrite_of_a_denoiser_pairs_completely(spec, tmp_path):
    """Renamed denoisers (and MobileViT) whose blocks no order form reads pair every stage and pass. Mochi's
    renamed projection pairs with the reference's gate and up by the columns each was split from
    (gate as the first half was a false `scramble`); Flux2's two MLPs around its joint attention are
    not read as an attention and an MLP (its `ff` was the target's `attn_out`: a false `bug`); the
    MLP on the hidden stream is its `ff`."""
    res = _compare_with_its_rewrite(spec, tmp_path, causal_lm=False)
    assert res.exit_code() == 0 and res.complete, (
        res.coverage.missing,
        [x.key for x in res.stages if not x.ok],
    )
    if spec == "MochiTransformer3DModel":
        gate = [x for x in res.stages if x.key == "L000.mlp.gate.out"]
        assert gate and gate[0].bit_equal == 1.0
