"""Stage names by role: two codebases of one model pair without a hand-written map."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from helpers.llama_ports import CONVENTIONAL, OPAQUE, make_port, rope_interleaved
from helpers.tiny_models import block_stack, tiny_llama
from typer.testing import CliRunner

import ffdebug
from ffdebug.arrays import to_torch
from ffdebug.cli.app import app
from ffdebug.models.roles import BRANCH, NORM, _sequence_roles, behaves_like_norm, place_children
from ffdebug.store.reader import open_side

runner = CliRunner()
BLOCK = (
    "hidden_in",
    "attn_norm_out",
    "attn.q_rot",
    "attn.k_rot",
    "attn_out",
    "ffn_norm_out",
    "ffn_out",
    "hidden_out",
)


@pytest.fixture(scope="module")
def hf():
    model = tiny_llama(num_layers=3)
    with torch.no_grad():  # norms that are not all ones, so a norm's scale matters
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(
                    torch.empty_like(p).uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(name)))
                )
    return model


def ids():
    return torch.randint(3, 1000, (2, 12), generator=torch.Generator().manual_seed(11))


def dump(model, directory, side, **options):
    with ffdebug.capture(model, dir=directory, side=side, **options), torch.no_grad():
        model(input_ids=ids())
    return directory / side


def dump_port(port, directory, side, rotary_fn="helpers.llama_ports:rope"):
    """One install per side, plus the one tap_function line for the port's own rotary code."""
    with ffdebug.tap_function(rotary_fn, ("attn.q_rot", "attn.k_rot")):
        return dump(port, directory, side)


def expected_keys(layers: int) -> set[str]:
    keys = {"embed.input_ids", "embed.out", "final.norm_out", "final.logits"}
    return keys | {f"L{i:03d}.{s}" for i in range(layers) for s in BLOCK}


@pytest.mark.integration
@pytest.mark.parametrize("names", [CONVENTIONAL, OPAQUE], ids=["conventional", "opaque-names"])
def test_a_correct_port_pairs_every_stage_with_hf_and_passes(hf, tmp_path, names):
    ref = dump(hf, tmp_path, "ref")
    tgt = dump_port(make_port(hf, names), tmp_path, "target")
    assert set(open_side(ref).keys()) == expected_keys(3)
    assert set(open_side(tgt).keys()) == expected_keys(3)  # the port's own names never appear
    r = runner.invoke(app, ["compare", str(ref), str(tgt), "--json"])
    data = json.loads(r.stdout)
    assert r.exit_code == 0, (data["coverage"]["missing"], data["first_divergence"])
    assert data["complete"] and data["coverage"]["final_compared"]
    assert {s["key"] for s in data["stages"]} == expected_keys(3)
    assert all(s["severity"] == "ok" for s in data["stages"])


@pytest.mark.integration
def test_an_unloaded_final_norm_is_found_at_final_norm_out(hf, tmp_path):
    """The port's final-norm scale left at 1: the blocks pass, final.norm_out and the logits do not."""
    ref = dump(hf, tmp_path, "ref")
    port = make_port(hf, OPAQUE)
    with torch.no_grad():
        port.s_end.scale.fill_(1.0)
    tgt = dump_port(port, tmp_path, "target")
    res = ffdebug.compare(ref, tgt)
    assert res.exit_code() == 1 and res.first_divergence.key == "final.norm_out"
    assert all(s.ok for s in res.stages if s.layer is not None)


@pytest.mark.integration
def test_a_rotary_convention_swap_is_located_at_layer_0_q_rot(hf, tmp_path):
    ref = dump(hf, tmp_path, "ref")
    tgt = dump_port(
        make_port(hf, OPAQUE, rotary=rope_interleaved),
        tmp_path,
        "target",
        "helpers.llama_ports:rope_interleaved",
    )
    r = ffdebug.bisect(ref, tgt)
    assert r.exit_code() == 1
    assert (r.first_divergence.layer, r.sub_stage.stage) == (0, "attn.q_rot")
    assert "layer 0" in r.conclusion and "attn.q_rot" in r.conclusion


@pytest.mark.integration
def test_without_the_tap_function_line_the_ports_rotary_q_k_are_read_at_the_kernel(hf, tmp_path):
    """The port calls its own rope function (no tap line): its q_rot / k_rot are the q / k its
    SDPA reads, with k's GQA repetition undone, and pair with HF's; a rotary bug in it is found."""
    ref = dump(hf, tmp_path, "ref")
    tgt = dump(make_port(hf, OPAQUE), tmp_path, "target")
    res = ffdebug.compare(ref, tgt)
    assert res.exit_code() == 0 and set(open_side(tgt).keys()) == expected_keys(3)
    k = next(r for r in open_side(tgt).records if r.key == "L000.attn.k_rot")
    assert tuple(k.shape) == (2, 12, hf.config.num_key_value_heads, 8)  # its own KV heads, seq-major
    assert k.extra["read_at"] == "attention kernel" and k.extra["kv_repeat"] == 2
    bad = dump(make_port(hf, OPAQUE, rotary=rope_interleaved), tmp_path, "bad")
    r = ffdebug.bisect(ref, bad)
    assert (r.exit_code(), r.first_divergence.layer, r.sub_stage.stage) == (1, 0, "attn.q_rot")


@pytest.mark.integration
def test_stage_map_on_compare_renames_either_side(tmp_path):
    for side, name in (("ref", "final.logits"), ("target", "final.out.0")):
        with ffdebug.capture(None, dir=tmp_path, side=side):
            ffdebug.tap("h", torch.ones(2))
            ffdebug.tap(name, torch.ones(3))
    assert ffdebug.compare(tmp_path / "ref", tmp_path / "target").exit_code() == 4
    res = ffdebug.compare(tmp_path / "ref", tmp_path / "target", maps=[r"final\.out\.0=final.logits"])
    assert res.exit_code() == 0 and [s.key for s in res.stages] == ["h", "final.logits"]
    res = ffdebug.compare(tmp_path / "ref", tmp_path / "target", maps=["nothing=here"])
    assert any("'nothing=here' renamed nothing" in n for n in res.notes)


@pytest.mark.integration
def test_install_stage_names_renames_at_capture(tmp_path):
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return (x,)

    model = Odd()
    with ffdebug.capture(model, dir=tmp_path, side="t", stage_names={r"final\.out\.0": "final.out"}):
        model(torch.ones(2, 4))
    assert "final.out" in open_side(tmp_path / "t").keys()


@pytest.mark.integration
def test_taps_inside_a_block_get_its_layer_prefix(tmp_path):
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            ffdebug.tap("inner.state", x * 2)
            return self.lin(x)

    model = block_stack(Block)
    with ffdebug.capture(model, dir=tmp_path, side="s"):
        model(torch.ones(1, 4))
        ffdebug.tap("outside", torch.ones(1))
    keys = set(open_side(tmp_path / "s").keys())
    assert {"L000.inner.state", "L001.inner.state", "outside"} <= keys


# --- the rules themselves ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kinds", "names"),
    [
        ("ncnc", ["attn_norm_out", "attn_out", "ffn_norm_out", "ffn_out"]),  # pre-norm (Llama)
        (
            "ncnncn",  # sandwich norms (Gemma 2)
            [
                "attn_norm_out",
                "attn_out",
                "attn_post_norm_out",
                "ffn_norm_out",
                "ffn_out",
                "ffn_post_norm_out",
            ],
        ),
        ("cncn", ["attn_out", "attn_norm_out", "ffn_out", "ffn_norm_out"]),  # post-norm (BERT)
        ("ncc", ["attn_norm_out", "attn_out", "ffn_out"]),  # parallel residual, one norm (GPT-J)
        ("nccc", None),  # three branches: no order decides
    ],
)
def test_order_around_the_residual_adds(kinds, names):
    seq = [NORM if k == "n" else BRANCH for k in kinds]
    assert _sequence_roles(seq) == names


def test_ambiguous_blocks_fall_back_to_name_hints_and_say_what_is_unplaced():
    called = [("norm1", BRANCH), ("attn", BRANCH), ("ff", BRANCH)]
    p = place_children(called, {"attn": "attn_out", "ff": "ffn_out"})
    assert p.names == {"norm1": "norm1.out", "attn": "attn_out", "ff": "ffn_out"}
    assert p.unplaced == ("norm1",) and not p.by_order


def test_norm_behaviour_is_read_from_the_output():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, generator=g) * 4 + 1
    w, b = torch.rand(16, generator=g) + 0.5, torch.randn(16, generator=g)

    class Affine(torch.nn.Module):
        def __init__(self, with_bias):
            super().__init__()
            self.w = torch.nn.Parameter(w.clone())
            self.b = torch.nn.Parameter(b.clone()) if with_bias else None

    rms = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    ln = torch.nn.functional.layer_norm(x, (16,)) * w + b
    assert behaves_like_norm(Affine(False), rms)
    assert behaves_like_norm(Affine(True), ln)
    assert not behaves_like_norm(Affine(False), x * w)  # a plain scale is no norm
    assert not behaves_like_norm(Affine(True), x * w + b)


def test_a_channels_first_batch_norm_child_is_captured_without_changing_the_forward(tmp_path):
    """A block whose direct child is a BatchNorm2d over [B, C, H, W] with W ≠ C (MobileNetV1's
    conv layers): its per-channel parameters are no row-wise norm's, and reading them against the
    last dim raised inside the model's forward (the capture must never change what runs)."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(32, 32, 3, padding=1)
            self.bn = torch.nn.BatchNorm2d(32)
            self.out = torch.nn.Conv2d(32, 32, 1)

        def forward(self, x):
            return x + self.out(torch.relu(self.bn(self.conv(x))))

    torch.manual_seed(0)
    net = block_stack(Block).eval()
    x = torch.randn(2, 32, 16, 16)
    with torch.no_grad():
        want = net(x)
        with ffdebug.capture(net, dir=tmp_path, side="ref"):
            got = net(x)
    assert torch.equal(got, want)
    files = (tmp_path / "ref").glob("rank*/*.safetensors")
    written = {f.name.split("_", 1)[1].removesuffix(".safetensors") for f in files}
    assert {"L000.hidden_in", "L001.hidden_out"} <= written


@pytest.mark.integration
def test_children_without_a_role_are_warned_recorded_and_listed_in_coverage(tmp_path, caplog):
    class Three(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = (torch.nn.Linear(4, 4) for _ in range(3))

        def forward(self, x):
            return x + self.c(self.b(self.a(x)))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(Three() for _ in range(2))

        def forward(self, x):
            for b in self.layers:
                x = b(x)
            return x

    model = Net()
    for side in ("ref", "target"):
        with ffdebug.capture(model, dir=tmp_path, side=side):
            model(torch.ones(1, 4))
    assert "could not place a, b, c by role" in caplog.text  # the ffdebug.capture logger
    assert open_side(tmp_path / "ref").run["unplaced_stages"] == {"Three": ["a", "b", "c"]}
    res = ffdebug.compare(tmp_path / "ref", tmp_path / "target")
    assert (
        "reference: Three children without a role, dumped by attribute name: a, b, c"
        in res.coverage.selected_out
    )
    assert "L000.a.out" in {s.key for s in res.stages}


@pytest.mark.integration
def test_first_call_records_keep_execution_order(hf, tmp_path):
    """The first call of a block is held until its roles are known; taps and children are then
    written in the order they ran, so a bad attention norm is the first lossy sub-stage (not the
    rotated q that comes after it)."""
    ref = dump(hf, tmp_path, "ref")
    bad = copy.deepcopy(hf)
    with torch.no_grad():
        bad.model.layers[0].input_layernorm.weight.mul_(1.5)
    tgt = dump(bad, tmp_path, "target")
    order = [r.key for r in open_side(tgt).records if r.key.startswith("L000.")]
    assert order == [f"L000.{s}" for s in BLOCK]
    r = ffdebug.bisect(ref, tgt)
    assert (r.first_divergence.key, r.sub_stage.key) == ("L000.attn_norm_out", "L000.attn_norm_out")


@pytest.mark.integration
def test_a_port_with_token_and_position_embeddings_finds_its_input_embedding(tmp_path):
    class Gpt(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wpe = torch.nn.Embedding(16, 8)  # registered first on purpose
            self.wte = torch.nn.Embedding(50, 8)
            self.h = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
            self.head = torch.nn.Linear(8, 50)

        def forward(self, input_ids):
            x = self.wte(input_ids) + self.wpe(torch.arange(input_ids.shape[1]))
            for b in self.h:
                x = b(x)
            return self.head(x)

    model = Gpt()
    with ffdebug.capture(model, dir=tmp_path, side="s"), torch.no_grad():
        model(input_ids=torch.randint(0, 50, (1, 6), generator=torch.Generator().manual_seed(0)))
    recs = {r.key: r for r in open_side(tmp_path / "s").records}
    assert "final.logits" in recs and recs["embed.out"].module_class == "Embedding"
    assert torch.equal(
        to_torch(recs["embed.out"].load()), model.wte(to_torch(recs["embed.input_ids"].load())).detach()
    )


def test_tap_function_restores_what_it_replaced(tmp_path):
    from helpers import llama_ports

    original = llama_ports.rope
    t1 = ffdebug.tap_function("helpers.llama_ports:rope", ("a", "b"))
    t2 = ffdebug.tap_function("helpers.llama_ports:rope", ("c", "d"))
    t2.remove()
    assert llama_ports.rope is not original and llama_ports.rope.__wrapped__ is original  # t1 still on
    t1.remove()
    assert llama_ports.rope is original


@pytest.mark.integration
@pytest.mark.parametrize("einsum", [False, True], ids=["sdpa", "einsum-attention"])
def test_rotary_taps_in_either_layout_pair_as_batch_seq_heads_dim(hf, tmp_path, einsum):
    """HF rotates [B, heads, S, D]; this port rotates [B, S, heads, D]: both are stored seq-major.
    With SDPA both are read at the kernel; with an einsum attention (a kernel ffdebug does not
    read) the port's tapped rope function stands in, seq-major as it returned it."""
    from helpers.llama_ports import rope_via_seq_major

    ref = dump(hf, tmp_path, "ref")
    port = make_port(hf, OPAQUE, rotary=rope_via_seq_major, einsum=einsum)
    tgt = dump_port(port, tmp_path, "target", "helpers.llama_ports:rope_seq_major")
    r_rec = next(r for r in open_side(ref).records if r.key == "L000.attn.k_rot")
    t_rec = next(r for r in open_side(tgt).records if r.key == "L000.attn.k_rot")
    assert list(r_rec.shape) == list(t_rec.shape) == [2, 12, 2, 8]
    assert r_rec.extra["orig_shape"] == [2, 2, 12, 8] and r_rec.extra["read_at"] == "attention kernel"
    if einsum:
        assert "orig_shape" not in t_rec.extra and "read_at" not in t_rec.extra
    else:
        assert t_rec.extra["read_at"] == "attention kernel"
    res = ffdebug.compare(ref, tgt)
    assert res.exit_code() == 0 and all(s.ok for s in res.stages)
    assert [r.key for r in open_side(tgt).records].count("L000.attn.q_rot") == 1


def test_a_one_branch_block_is_neither_attention_nor_mlp_by_order(tmp_path):
    """`x + mlp(norm(x))`: one branch, so order cannot say which it is. It is `branch_out` (never a
    guessed `attn_out`), its norm `branch_norm_out`, and its sub-stages are the MLP's (it reads an
    activation): a bug after the gate projection of layer 1 is located at that layer's `mlp.act`."""
    import torch
    from torch import nn

    import ffdebug

    class MLP(nn.Module):
        def __init__(self, bug: bool):
            super().__init__()
            self.gate, self.up = nn.Linear(16, 32, bias=False), nn.Linear(16, 32, bias=False)
            self.down, self.bug = nn.Linear(32, 16, bias=False), bug

        def forward(self, x):
            g = self.gate(x) * (1.5 if self.bug else 1.0)
            return self.down(nn.functional.silu(g) * self.up(x))

    class Layer(nn.Module):
        def __init__(self, bug: bool):
            super().__init__()
            self.norm, self.mlp = nn.RMSNorm(16), MLP(bug)

        def forward(self, x):
            return x + self.mlp(self.norm(x))

    class Net(nn.Module):
        def __init__(self, bug_layer):
            super().__init__()
            self.layers = nn.ModuleList([Layer(i == bug_layer) for i in range(3)])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    for side, bug_layer in (("ref", None), ("target", 1)):
        torch.manual_seed(0)
        model = Net(bug_layer)
        with ffdebug.capture(model, dir=tmp_path, side=side, substages=True):
            model(torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1)))
    result = ffdebug.bisect(tmp_path / "ref", tmp_path / "target")
    keys = {s.key for s in result.stages}
    assert {"L000.branch_norm_out", "L000.branch_out", "L000.mlp.gate.out", "L000.mlp.act.out"} <= keys
    assert not any(".attn" in k or "ffn_out" in k for k in keys), sorted(keys)
    first = result.first_divergence
    assert (first.layer, first.key) == (1, "L001.branch_out")
    assert result.sub_stage is not None and result.sub_stage.key == "L001.mlp.act.out"


@pytest.mark.integration
@pytest.mark.parametrize("form", ["tuple", "dataclass"])
def test_a_ports_logits_under_another_name_are_final_logits(hf, tmp_path, form):
    """The port returns (aux, logits) or a dataclass whose logits are called `scores`: the
    output whose last dim is the vocabulary is `final.logits` and pairs with HF's."""
    import dataclasses

    @dataclasses.dataclass
    class Out:
        hidden: torch.Tensor
        scores: torch.Tensor

    class Wrapped(torch.nn.Module):
        def __init__(self, port):
            super().__init__()
            self.inner = port

        def forward(self, input_ids):
            logits = self.inner(input_ids)
            hidden = logits[..., :8].sum(-1)  # another output, first, and not vocabulary-sized
            return (hidden, logits) if form == "tuple" else Out(hidden, logits)

    ref = dump(hf, tmp_path, "ref")
    tgt = dump(Wrapped(make_port(hf, OPAQUE)), tmp_path, "target")
    assert "final.logits" in open_side(tgt).keys() and "final.out" not in open_side(tgt).keys()
    res = ffdebug.compare(ref, tgt)
    assert res.exit_code() == 0 and res.coverage.final_compared


def test_mla_rope_part_is_the_key_columns_every_head_shares_or_what_follows_v():
    from ffdebug.capture.kernel_taps import _rope_part

    g = torch.Generator().manual_seed(0)
    nope, pe = torch.randn(1, 4, 3, 6, generator=g), torch.randn(1, 1, 3, 2, generator=g)
    k = torch.cat([nope, pe.expand(1, 4, 3, 2)], -1)  # unabsorbed: k_pe expanded to every head
    assert _rope_part(k, None) == 2
    assert _rope_part(torch.randn(1, 4, 3, 8, generator=g), None) == 0  # plain multi-head k
    assert _rope_part(k[:, :1].expand(1, 4, 3, 8), None) == 0  # one KV head repeated: GQA, not MLA
    padded = torch.cat([nope, torch.zeros(1, 4, 3, 2)], -1)
    assert _rope_part(padded, None) == 0  # a head dim padded with zeros for a kernel
    c = torch.randn(1, 1, 3, 5, generator=g)
    assert _rope_part(torch.cat([c, pe], -1), c) == 2  # absorbed: k = [c | k_pe] over v = c
    assert _rope_part(torch.cat([c, pe], -1), torch.randn(1, 1, 3, 5, generator=g)) == 0
