"""Role sub-stages: q / k / v, context, o, gate / up / act / down pair across codebases."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.llama_ports import CONVENTIONAL, OPAQUE, make_port, rope
from helpers.tiny_models import block_stack, tiny_llama

import ffdebug
from ffdebug.arrays import to_torch
from ffdebug.store.reader import open_side

pytestmark = pytest.mark.integration  # every test here spawns a process, runs a trainer or kills one

SUB = (
    "attn.q.out",
    "attn.k.out",
    "attn.v.out",
    "attn.context.out",
    "attn.o.out",
    "mlp.gate.out",
    "mlp.up.out",
    "mlp.act.out",
    "mlp.down.out",
)
# the inputs: one record per tensor read (q / k / v share theirs, fused or not; gate / up too)
INS = ("attn.qkv.in", "attn.o.in", "mlp.gate_up.in", "mlp.down.in")
# tiny_llama: hidden 32, 4 heads of 8, 2 KV heads, MLP width 64; batch 2, 12 tokens
SHAPES = {
    "attn.q.out": [2, 12, 4, 8],
    "attn.k.out": [2, 12, 2, 8],
    "attn.v.out": [2, 12, 2, 8],
    "attn.context.out": [2, 12, 4, 8],
    "attn.o.out": [2, 12, 32],
    "mlp.gate.out": [2, 12, 64],
    "mlp.act.out": [2, 12, 64],
}


@pytest.fixture(scope="module")
def hf():
    return tiny_llama(num_layers=2)


def ids():
    return torch.randint(3, 1000, (2, 12), generator=torch.Generator().manual_seed(11))


def dump(model, directory, side, tap=None):
    with ffdebug.capture(model, dir=directory, side=side, substages=True), torch.no_grad():
        if tap is None:
            model(input_ids=ids())
        else:
            with ffdebug.tap_function(tap, ("attn.q_rot", "attn.k_rot")):
                model(ids())
    return {r.key: r for r in open_side(directory / side).records}


@pytest.mark.parametrize("names", [CONVENTIONAL, OPAQUE], ids=["conventional", "opaque-names"])
def test_fused_port_sub_stages_pair_with_hf_llama_split_by_head_counts(hf, tmp_path, names):
    """The port fuses q/k/v and gate/up and has no config: its projections are split by the head
    counts its own reshapes show, and every sub-stage pairs with HF's separate projections."""
    ref = dump(hf, tmp_path, "ref")
    tgt = dump(make_port(hf, names), tmp_path, "target", tap="helpers.llama_ports:rope")
    for layer in range(2):
        for kind in SUB + INS:
            assert f"L{layer:03d}.{kind}" in ref and f"L{layer:03d}.{kind}" in tgt
    for side in (ref, tgt):  # what each projection read, named in argument order by its reader
        assert side["L001.attn.k.out"].extra["inputs"] == ["L001.attn.qkv.in"]
        assert side["L001.mlp.act.out"].extra["inputs"] == ["L001.mlp.gate.out", "L001.mlp.up.out"]
        assert torch.equal(
            to_torch(side["L001.attn.qkv.in"].load()), to_torch(side["L001.attn_norm_out"].load())
        )
        assert torch.equal(
            to_torch(side["L001.mlp.down.in"].load()), to_torch(side["L001.mlp.act.out"].load())
        )
    for kind, shape in SHAPES.items():
        assert list(ref[f"L000.{kind}"].shape) == shape == list(tgt[f"L000.{kind}"].shape), kind
    k_ref, k_tgt = ref["L001.attn.k.out"], tgt["L001.attn.k.out"]
    assert k_ref.module_path == "model.layers.1.self_attn.k_proj" and k_ref.extra["orig_shape"] == [2, 12, 16]
    assert k_tgt.module_path.endswith(f"{names['attrs'][1]}.wqkv")  # the module path is kept
    assert k_tgt.extra["split"] == [32, 48] and k_tgt.extra["orig_shape"] == [2, 12, 64]
    # k before GQA repetition equals HF's k_proj output viewed as heads
    assert torch.equal(to_torch(k_ref.load()), to_torch(k_ref.load()).reshape(2, 12, 16).reshape(2, 12, 2, 8))
    res = ffdebug.compare(tmp_path / "ref", tmp_path / "target")
    assert res.exit_code() == 0, [(s.key, s.cos) for s in res.stages if not s.ok]
    assert {f"L001.{k}" for k in SUB + INS} <= {s.key for s in res.stages}
    assert all(s.ok for s in res.stages)


def test_the_gate_is_the_half_the_activation_reads(hf, tmp_path):
    """A fused [up | gate] weight: the gate is found by the activation applied to it, not its place."""
    dump(hf, tmp_path, "ref")
    tgt = dump(make_port(hf, OPAQUE, up_first=True), tmp_path, "target", tap="helpers.llama_ports:rope")
    assert tgt["L000.mlp.gate.out"].extra["split"] == [64, 128]
    res = ffdebug.compare(tmp_path / "ref", tmp_path / "target")
    assert res.exit_code() == 0 and all(s.ok for s in res.stages)


def test_a_bad_v_slice_of_a_fused_projection_is_located_at_attn_v(hf, tmp_path):
    """Layer 1's v rows of the fused weight scaled: bisect names layer 1 and attn.v (not q / k)."""
    dump(hf, tmp_path, "ref")
    port = make_port(hf, OPAQUE)
    with torch.no_grad():
        port.stages[1].mix.wqkv.weight[48:].mul_(1.5)
    dump(port, tmp_path, "target", tap="helpers.llama_ports:rope")
    r = ffdebug.bisect(tmp_path / "ref", tmp_path / "target")
    assert r.exit_code() == 1
    assert (r.first_divergence.layer, r.sub_stage.key) == (1, "L001.attn.v.out")


def test_sub_stages_are_off_by_default(hf, tmp_path):
    with ffdebug.capture(hf, dir=tmp_path, side="s"), torch.no_grad():
        hf(input_ids=ids())
    assert not [k for k in open_side(tmp_path / "s").keys() if k.endswith(SUB)]


def test_inputs_of_gives_a_stages_input_records_in_argument_order(hf, tmp_path):
    """`SideStore.inputs_of`: a role sub-stage's named inputs, a block stage's hidden_in."""
    from ffdebug.errors import FFDebugError

    dump(hf, tmp_path, "s")
    side = open_side(tmp_path / "s")
    recs = {r.key: r for r in side.records}
    assert [r.key for r in side.inputs_of(recs["L001.mlp.act.out"])] == [
        "L001.mlp.gate.out",
        "L001.mlp.up.out",
    ]
    assert [r.key for r in side.inputs_of(recs["L001.attn.v.out"])] == ["L001.attn.qkv.in"]
    assert [r.key for r in side.inputs_of(recs["L001.hidden_out"])] == ["L001.hidden_in"]
    with pytest.raises(FFDebugError, match="no input record L000.attn.context.in"):
        side.inputs_of(recs["L000.attn.context.out"])


# --- fused projections split as the branch splits them -----------------------------------------


def tiny_neox():
    """A seeded GPT-NeoX: hidden 32, 4 heads of 8, `query_key_value` laid out per head [q_h | k_h | v_h]."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    cfg = dict(hidden_size=32, num_attention_heads=4, intermediate_size=64, rotary_pct=0.5)
    return GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=1000, num_hidden_layers=2, **cfg)).eval()


def test_a_per_head_interleaved_qkv_is_split_per_head_and_a_bad_v_slice_is_found(tmp_path):
    """GPT-NeoX views its fused output as [B, S, heads, 3·D] and chunks the last dim: q / k / v
    are read from the columns those views hold (head h's q is columns 24h..24h+8), and layer 1's
    v rows scaled are located at attn.v (a contiguous [q | k | v] split would blame q)."""
    model = tiny_neox()
    ref = dump(model, tmp_path, "ref")
    fused = model.gpt_neox.layers[0].attention.query_key_value(to_torch(ref["L000.attn.qkv.in"].load()))
    per_head = fused.view(2, 12, 4, 3, 8)  # [B, S, head, (q, k, v), D]
    for i, kind in enumerate(("q", "k", "v")):
        assert torch.equal(to_torch(ref[f"L000.attn.{kind}.out"].load()), per_head[..., i, :]), kind
    assert ref["L000.attn.v.out"].extra["split_cols"] == [[16, 24], [40, 48], [64, 72], [88, 96]]
    with torch.no_grad():
        w = model.gpt_neox.layers[1].attention.query_key_value.weight.view(4, 3, 8, 32)
        w[:, 2].mul_(1.5)  # every head's v rows
    dump(model, tmp_path, "target")
    r = ffdebug.bisect(tmp_path / "ref", tmp_path / "target")
    assert (r.exit_code(), r.first_divergence.layer, r.sub_stage.key) == (1, 1, "L001.attn.v.out")


def test_per_group_qkv_and_even_odd_gate_up_are_read_from_the_ports_views(hf, tmp_path):
    """Other layouts, no names or special cases: q / k / v fused per KV group ([q of the group's 2
    heads | k | v], viewed as [B, S, groups, 4·D] and split), gate / up interleaved by column
    (even / odd). Rows permuted to match, the port pairs with HF's separate projections."""
    import types

    def attn_forward(self, x, cos, sin):
        b, s, _ = x.shape
        rep, d = self.heads // self.kv_heads, self.dim
        q, k, v = self.wqkv(x).view(b, s, self.kv_heads, (rep + 2) * d).split([rep * d, d, d], -1)
        q, k = (t.reshape(b, s, -1, d).transpose(1, 2) for t in (q, k))
        q, k = rope(q, k, cos, sin)
        k, v = k.repeat_interleave(rep, 1), v.transpose(1, 2).repeat_interleave(rep, 1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))

    def mlp_forward(self, x):
        y = self.w13(x)
        return self.w2(F.silu(y[..., ::2]) * y[..., 1::2])

    port = make_port(hf, OPAQUE)
    port.config = {"n_heads": 4, "n_kv_heads": 2, "dim": 32}  # its [B, S, groups, 4·D] view is no head view
    with torch.no_grad():
        for stage in port.stages:
            w = stage.mix.wqkv.weight  # [q (4 heads) | k (2) | v (2)] x 8 rows each
            q, k, v = w[:32].view(2, 16, 32), w[32:48].view(2, 8, 32), w[48:].view(2, 8, 32)
            w.copy_(torch.cat((q, k, v), 1).reshape(64, 32))
            g = stage.proj.w13.weight  # [gate | up] -> gate and up rows interleaved
            g.copy_(torch.stack((g[:64], g[64:]), 1).reshape(128, 32))
            stage.mix.forward = types.MethodType(attn_forward, stage.mix)
            stage.proj.forward = types.MethodType(mlp_forward, stage.proj)
    dump(hf, tmp_path, "ref")
    tgt = dump(port, tmp_path, "target", tap="helpers.llama_ports:rope")
    assert tgt["L000.attn.k.out"].extra["split_cols"] == [[16, 24], [48, 56]]
    assert tgt["L000.mlp.up.out"].extra["split_cols"][:2] == [[1, 2], [3, 4]]
    res = ffdebug.compare(tmp_path / "ref", tmp_path / "target")
    assert res.exit_code() == 0, [(s.key, s.cos) for s in res.stages if not s.ok]
    assert {f"L001.{k}" for k in SUB + INS} <= {s.key for s in res.stages} and all(s.ok for s in res.stages)


def test_a_fused_qkv_whose_split_is_not_seen_is_not_split_but_named(hf, tmp_path, caplog):
    """The port copies its fused output (permute + contiguous) before taking q / k / v apart: the
    layout is not visible, so nothing is guessed. The projection keeps its module path, the
    warning says why, run.json lists it, and compare reports attn.q / k / v missing."""
    import types

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        qkv = self.wqkv(x).view(b, s, -1, self.dim).permute(2, 0, 1, 3).contiguous()
        q, k, v = (t.permute(1, 0, 2, 3) for t in qkv.split([self.heads, self.kv_heads, self.kv_heads]))
        q, k = rope(q, k, cos, sin)
        rep = self.heads // self.kv_heads
        out = F.scaled_dot_product_attention(
            q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))

    port = make_port(hf, OPAQUE)
    for stage in port.stages:
        stage.mix.forward = types.MethodType(forward, stage.mix)
    dump(hf, tmp_path, "ref")
    tgt = dump(port, tmp_path, "target", tap="helpers.llama_ports:rope")
    assert "L000.attn.q.out" not in tgt and {"L000.mix.wqkv.in", "L000.mix.wqkv.out"} <= set(tgt)
    assert "L000.attn.o.out" in tgt  # the rest of the branch still has its roles
    assert "mix.wqkv is a fused q / k / v projection (64 outputs) whose layout" in caplog.text
    assert open_side(tmp_path / "target").run["unplaced_stages"]["Stack.mix"] == ["mix.wqkv"]
    res = ffdebug.compare(tmp_path / "ref", tmp_path / "target")
    assert res.exit_code() != 0 and "reference only: attn.k.out, attn.q.out" in str(res.coverage.missing)


def test_sub_stage_classes_do_not_write_a_tensor_a_role_key_holds(hf, tmp_path):
    """Extra classes in the block-class list (`Linear`, the MLP class) would dump q_proj, mlp and
    the rest by module path too: the projections and branches with role keys are written once,
    under their role key."""
    with ffdebug.capture(hf, dir=tmp_path, side="s", classes=("LlamaDecoderLayer", "Linear", "LlamaMLP")):
        with torch.no_grad():
            hf(input_ids=ids())
    keys = open_side(tmp_path / "s").keys()
    assert len(keys) == len(set(keys))
    assert {"L000.attn.q.out", "L000.attn.qkv.in", "L000.mlp.down.in", "L000.ffn_out"} <= set(keys)
    assert not [k for k in keys if ".q_proj." in k or ".down_proj." in k]
    assert "L000.mlp.in" not in keys and "L000.mlp.out" not in keys


# --- MoE: a port with stacked expert weights against HF Qwen3-MoE -------------------------------

MOE = ("moe.router.out", "moe.topk_ids.out", "moe.topk_weights.out")


@pytest.fixture(scope="module")
def hf_moe():
    from helpers.moe_port import tiny_qwen3_moe

    return tiny_qwen3_moe(num_layers=2)


@pytest.mark.parametrize("expert_list", [False, True], ids=["stacked", "expert-list"])
def test_moe_port_router_topk_and_expert_sub_stages_pair_with_hf(hf_moe, tmp_path, expert_list):
    """HF stacks its expert weights ([E, 2I, H]); the port stacks them too, or keeps a list of
    expert modules. HF loops experts in (slot, token) order, the port in (token, slot) order:
    expert rows are matched to tokens and sorted, so they pair."""
    from helpers.moe_port import make_moe_port

    ref = dump(hf_moe, tmp_path, "ref")
    tgt = dump(make_moe_port(hf_moe, expert_list), tmp_path, "target", tap="helpers.moe_port:rope")
    experts = sorted(k for k in ref if k.startswith("L001.moe.expert"))
    assert experts and set(experts) == {k for k in tgt if k.startswith("L001.moe.expert")}
    for kind in (*MOE, "attn.q.out", "attn.k.out"):
        assert f"L001.{kind}" in ref and f"L001.{kind}" in tgt
    assert list(ref["L000.moe.router.out"].shape) == [2, 12, 8] == list(tgt["L000.moe.router.out"].shape)
    assert list(tgt["L000.moe.topk_ids.out"].shape) == [2, 12, 2]
    e = experts[0]
    assert ref[e].extra["tokens"] == tgt[e].extra["tokens"] and len(ref[e].extra["tokens"]) == ref[e].shape[0]
    assert e.endswith(".in")  # the rows the expert read: the branch input's rows of its tokens
    rows = tgt["L001.ffn_norm_out"].load().reshape(-1, 32)[tgt[e].extra["tokens"]]
    assert (
        np.array_equal(tgt[e].load(), rows) and tgt[e].extra["tokens"] == tgt[e[:-3] + ".out"].extra["tokens"]
    )
    res = ffdebug.compare(tmp_path / "ref", tmp_path / "target")
    assert res.exit_code() == 0, res.coverage.missing
    assert all(s.ok for s in res.stages)


def test_a_bug_in_one_expert_is_located_at_that_layer_and_expert(hf_moe, tmp_path):
    from helpers.moe_port import make_moe_port

    ref = dump(hf_moe, tmp_path, "ref")
    used = sorted(int(k[15:18]) for k in ref if k.startswith("L001.moe.expert") and k.endswith(".out"))
    bad = used[len(used) // 2]
    port = make_moe_port(hf_moe)
    with torch.no_grad():
        port.trunk[1].route.w_out[bad].mul_(1.3)  # one expert's down projection mis-scaled
    dump(port, tmp_path, "target", tap="helpers.moe_port:rope")
    r = ffdebug.bisect(tmp_path / "ref", tmp_path / "target")
    assert r.exit_code() == 1
    assert (r.first_divergence.layer, r.sub_stage.key) == (1, f"L001.moe.expert{bad:03d}.out")
    res = ffdebug.compare(tmp_path / "ref", tmp_path / "target")
    wrong = {s.key for s in res.stages if not s.ok and ".moe.expert" in s.key}
    assert wrong == {f"L001.moe.expert{bad:03d}.out"}  # the other experts still match


def test_projections_no_rule_takes_keep_their_module_path_and_are_named(tmp_path, caplog):
    """An MLP with three input projections fits no rule: each keeps `L{NNN}.<module path>.out`,
    the warning and run.json name them; the rest of the block still gets its roles."""

    class Tri(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.p, self.q, self.r = (torch.nn.Linear(8, 16) for _ in range(3))
            self.o = torch.nn.Linear(16, 8)

        def forward(self, x):
            return self.o(self.p(x) * self.q(x) + self.r(x))

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = torch.nn.LayerNorm(8), torch.nn.LayerNorm(8)
            self.a = torch.nn.Linear(8, 8)
            self.m = Tri()

        def forward(self, x):
            x = x + self.a(self.n1(x))
            return x + self.m(self.n2(x))

    model = block_stack(Block)
    with ffdebug.capture(model, dir=tmp_path, side="s", substages=True), torch.no_grad():
        model(torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0)))
    keys = set(open_side(tmp_path / "s").keys())
    assert {"L000.m.p.out", "L000.m.q.out", "L000.m.r.out", "L001.m.r.out"} <= keys
    assert {"L000.mlp.act.out", "L000.mlp.down.out", "L000.ffn_out"} <= keys  # o: the down projection
    assert "no role sub-stage for m.p, m.q, m.r" in caplog.text  # the ffdebug.capture logger
    assert open_side(tmp_path / "s").run["unplaced_stages"]["Block.m"] == ["m.p", "m.q", "m.r"]


def _mixer_net(shared: bool) -> torch.nn.Module:
    """Blocks whose attention-like mixer makes its k / v / r inputs itself (RWKV's time mixing),
    each a new tensor at one address, as an allocator hands a freed input's address to the next
    one; `shared`: one such input read by all three."""
    buf = bytearray(2 * 3 * 8 * 4)

    def at_one_address(t):
        return torch.frombuffer(buf, dtype=torch.float32).view(t.shape).copy_(t)

    class Mix(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.k, self.v, self.r, self.o = (torch.nn.Linear(8, 8) for _ in range(4))

        def forward(self, x):
            if shared:
                h = at_one_address(x * 2)
                k, v, r = self.k(h), self.v(h), self.r(h)
            else:  # each input dropped after its projection: the next one takes its address
                k = self.k(at_one_address(x * 2))
                v = self.v(at_one_address(x * 3))
                r = self.r(at_one_address(x * 4))
            return self.o(torch.sigmoid(r) * k * v)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = torch.nn.LayerNorm(8), torch.nn.LayerNorm(8)
            self.mix = Mix()
            self.mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))

        def forward(self, x):
            x = x + self.mix(self.n1(x))
            return x + self.mlp(self.n2(x))

    return block_stack(Block)


@pytest.mark.parametrize("shared", [False, True])
def test_inputs_that_held_one_address_in_turn_are_not_one_tensor(tmp_path, caplog, shared):
    """Projections whose inputs the branch made one after another at one address read different
    tensors: not q / k / v of one input (a CI machine's allocator reused the address, a laptop's
    did not, and RWKV's roles came out differently on each). One input read by all three is."""
    model = _mixer_net(shared)
    with ffdebug.capture(model, dir=tmp_path, side="s", substages=True), torch.no_grad():
        model(torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0)))
    keys = set(open_side(tmp_path / "s").keys())
    roles = {"L000.attn.q.out", "L000.attn.k.out", "L000.attn.v.out"}
    assert {"L000.attn.context.out", "L000.attn.o.out"} <= keys
    if shared:
        assert roles <= keys
    else:
        assert not roles & keys
        assert {"L000.mix.k.out", "L000.mix.v.out", "L000.mix.r.out"} <= keys
        assert "no role sub-stage for mix.k, mix.v, mix.r" in caplog.text
        assert "fused" not in caplog.text  # one projection of a made input is no fused q / k / v


# --- packed [T, ...] against padded [B, S, ...] --------------------------------------------------


def _padded_and_packed(
    tmp_path, mask_on_ref=True, bad_row=None, lens=(5, 3), lens_on_target=False, **compare_opts
):
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(2, 5, dtype=torch.long)
    for b, n in enumerate(lens):
        mask[b, :n] = 1
    ids = torch.randint(3, 50, (2, 5), generator=g) * mask
    h = torch.randn(2, 5, 4, 2, generator=g)
    packed_h = h[mask.bool()].clone()  # [T, 4, 2]: batch 0's tokens, then batch 1's
    if bad_row is not None:
        packed_h[bad_row] *= -1
    with ffdebug.capture(None, dir=tmp_path, side="ref"):
        ffdebug.tap("embed.input_ids", ids)
        if mask_on_ref:
            ffdebug.tap("embed.attention_mask", mask)
        ffdebug.tap("L000.attn.q.out", h)
    with ffdebug.capture(None, dir=tmp_path, side="target"):
        ffdebug.tap("embed.input_ids", ids[mask.bool()])
        if lens_on_target:
            ffdebug.tap("embed.seq_lens", torch.tensor(lens))
        ffdebug.tap("L000.attn.q.out", packed_h)
    return ffdebug.compare(tmp_path / "ref", tmp_path / "target", **compare_opts)


def test_a_packed_side_is_aligned_with_a_padded_one_by_its_attention_mask(tmp_path):
    res = _padded_and_packed(tmp_path)
    q = next(s for s in res.stages if s.key == "L000.attn.q.out")
    assert q.ok and q.bit_equal == 1.0 and any("padded -> [8, 4, 2] packed" in n for n in q.notes)
    assert res.exit_code() == 0


@pytest.mark.parametrize("opts", [{"stages": ("L000.*",)}, {"exclude": ("embed.attention_mask",)}])
def test_stage_filters_keep_the_mask_the_alignment_needs(tmp_path, opts):
    """--stages / --exclude select stages to report; the mask and lengths are still read."""
    res = _padded_and_packed(tmp_path, **opts)
    q = next(s for s in res.stages if s.key == "L000.attn.q.out")
    assert q.ok and q.bit_equal == 1.0


def test_or_by_the_packed_sides_sequence_lengths(tmp_path):
    res = _padded_and_packed(tmp_path, mask_on_ref=False, lens_on_target=True)
    q = next(s for s in res.stages if s.key == "L000.attn.q.out")
    assert q.ok and q.bit_equal == 1.0 and res.exit_code() == 0


def test_an_aligned_packed_row_that_differs_is_found(tmp_path):
    res = _padded_and_packed(tmp_path, bad_row=6)  # batch 1, position 1
    q = next(s for s in res.stages if s.key == "L000.attn.q.out")
    assert not q.ok and res.exit_code() == 1


def test_without_a_mask_that_explains_the_shapes_it_is_a_shape_mismatch(tmp_path):
    from ffdebug.errors import InputIdsMismatch

    with pytest.raises(InputIdsMismatch, match="shape"):
        _padded_and_packed(tmp_path / "a", mask_on_ref=False)
    from ffdebug.comparison.align import packed_view

    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    padded = torch.randn(2, 4, 3)
    got = packed_view(padded.numpy(), np.zeros((5, 3), np.float32), mask.numpy())
    assert np.array_equal(got, padded[mask.bool()].numpy())
    assert packed_view(padded, torch.zeros(6, 3), mask) is None  # 5 tokens by the mask, 6 rows
    assert packed_view(padded, torch.zeros(5, 2), mask) is None  # trailing dims differ


def test_hf_records_the_attention_mask_of_its_first_call(hf, tmp_path):
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 9:] = 0
    with ffdebug.capture(hf, dir=tmp_path, side="s"), torch.no_grad():
        hf(input_ids=ids(), attention_mask=mask)
    recs = {r.key: r for r in open_side(tmp_path / "s").records}
    assert torch.equal(to_torch(recs["embed.attention_mask"].load()), mask)


def test_the_env_switch_is_read_and_checked():
    from ffdebug._env import read_dump_config
    from ffdebug.errors import FFDebugError

    assert read_dump_config({"FFDEBUG_FWD_DUMP_DIR": "d", "FFDEBUG_FWD_DUMP_SUBSTAGES": "1"}).substages
    assert not read_dump_config({"FFDEBUG_FWD_DUMP_DIR": "d"}).substages
    with pytest.raises(FFDebugError, match="FFDEBUG_FWD_DUMP_SUBSTAGES='yes please' is invalid"):
        read_dump_config({"FFDEBUG_FWD_DUMP_DIR": "d", "FFDEBUG_FWD_DUMP_SUBSTAGES": "yes please"})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_projection_reading_a_norm_computed_in_fp32_records_the_norms_output(tmp_path, dtype):
    """T5's norm casts the branch input to fp32 and its result back: the cast is freed before
    the projection runs, and a tensor later allocated at its address is not the branch input
    (the zoo's T5 family in bf16 / fp16 recorded the residual stream as `mlp.up.in`)."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(
        vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=4, num_heads=4, decoder_start_token_id=0
    )
    model = T5ForConditionalGeneration(cfg).eval().to(dtype)
    normed: dict[int, torch.Tensor] = {}  # the FF norm's output of each block, execution order
    blocks = [*model.encoder.block, *model.decoder.block]
    for i, block in enumerate(blocks):
        block.layer[-1].layer_norm.register_forward_hook(
            lambda mod, a, out, i=i: normed.setdefault(i, out.detach().clone())
        )
    x = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    with ffdebug.capture(model, dir=tmp_path, side="ref", substages=True), torch.no_grad():
        model(input_ids=x, decoder_input_ids=x)
    records = {r.key: r for r in open_side(tmp_path / "ref").records}
    for i in range(len(blocks)):
        key = next(k for k in records if k.startswith(f"L{i:03d}.") and k.endswith(("up.in", "wi.in")))
        got = to_torch(records[key].load())
        assert torch.equal(got.reshape(normed[i].shape), normed[i]), key


def test_grouped_matmul_experts_record_what_the_per_expert_loop_records(hf_moe, tmp_path):
    """transformers runs stacked experts through one grouped matmul by default (`grouped_mm`); the
    capture takes it apart by its offsets into one projection per expert, so its records are those
    of the eager per-expert loop (the independent reading: the same model, run expert by expert),
    and an expert no token reached has an empty record on both sides."""
    import copy

    def idle_seven(module, args, kwargs):  # no token reaches expert 7 of layer 1: its slots go to 6
        hidden, ids, weights = args
        return (hidden, torch.where(ids == 7, 6, ids), weights), kwargs

    eager = copy.deepcopy(hf_moe)
    eager.model.layers[1].mlp.experts.register_forward_pre_hook(idle_seven, with_kwargs=True)
    grouped = copy.deepcopy(eager)
    grouped.config._experts_implementation = "grouped_mm"
    assert eager.config._experts_implementation == "eager"
    ref, tgt = dump(eager, tmp_path, "ref"), dump(grouped, tmp_path, "target")
    experts = {f"L001.moe.expert{e:03d}.{io}" for e in range(8) for io in ("in", "out")}
    assert experts <= set(ref) and experts <= set(tgt)
    assert (
        list(tgt["L001.moe.expert007.out"].shape) == [0, 32]
        and tgt["L001.moe.expert007.out"].extra["tokens"] == []
    )
    for e in range(7):
        key = f"L001.moe.expert{e:03d}.out"
        assert tgt[key].extra["tokens"] == ref[key].extra["tokens"]
        torch.testing.assert_close(to_torch(tgt[key].load()), to_torch(ref[key].load()), rtol=1e-5, atol=1e-6)
    res = ffdebug.compare(tmp_path / "ref", tmp_path / "target")
    assert res.exit_code() == 0, (res.coverage.missing, [s.key for s in res.stages if not s.ok])


def test_a_sequence_mixer_is_compared_as_a_whole(tmp_path):
    """A Mamba block's mixer convolves over the sequence: no role sub-stage (its silu gate is no
    MLP's) and no module-path one (a port's would never pair); run.json and the coverage say so."""
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(0)
    model = MambaForCausalLM(
        MambaConfig(vocab_size=100, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2)
    ).eval()
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    for side in ("ref", "target"):
        with ffdebug.capture(model, dir=tmp_path, side=side, substages=True), torch.no_grad():
            model(input_ids=ids)
    store = open_side(tmp_path / "ref")
    assert {k.split(".", 1)[1] for k in store.keys() if k.startswith("L000.")} == {
        "hidden_in", "branch_norm_out", "branch_out", "hidden_out",
    }  # fmt: skip
    assert "compared as a whole" in store.run["compared_whole"]["MambaBlock.mixer"]
    res = ffdebug.compare(tmp_path / "ref", tmp_path / "target")
    assert res.exit_code() == 0
    assert any("MambaBlock.mixer is a sequence mixer" in s for s in res.coverage.selected_out)


def test_an_activation_before_a_projection_never_marks_it_the_gate():
    """A shared expert runs after the routed experts; an expert's activation input, freed, may have
    had the address the shared up-projection's output gets. Only an activation that ran after a
    projection read its output: the gate stays the one activated after it (the first here), as a
    live run of the same branch at other addresses reads it."""
    from ffdebug.models.subroles import BranchTrace, LinearCall, mlp_substages

    x = torch.randn(2, 3, 8)

    def call(index, path, fan_out, y_ptr, from_input=True):
        y = torch.randn(2, 3, fan_out)
        return LinearCall(
            index, path, None, from_input, x.shape[-1] if from_input else 4, fan_out, x, y, y_ptr, 4
        )

    gate, up = call(0, "shared.gate_proj", 4, 1000), call(1, "shared.up_proj", 4, 2000)
    down = LinearCall(
        2, "shared.down_proj", None, False, 4, 8, torch.randn(2, 3, 4), torch.randn(2, 3, 8), 3000, 4
    )
    freed_expert_act = (0, 2000)  # an expert's activation, before any shared projection ran
    shared_act = (2, 5000)  # the shared gate, clamped (a new tensor) before its activation
    trace = BranchTrace((2, 3), 8, [gate, up, down], act_ptrs=[freed_expert_act, shared_act])
    kinds = {s.kind: s.module_path for s in mlp_substages(trace)}
    assert kinds["mlp.gate"] == "shared.gate_proj" and kinds["mlp.up"] == "shared.up_proj"
    trace.act_ptrs = [freed_expert_act, (2, 2000)]  # the activation read the second output: the gate
    kinds = {s.kind: s.module_path for s in mlp_substages(trace)}
    assert kinds["mlp.gate"] == "shared.up_proj" and kinds["mlp.up"] == "shared.gate_proj"
