"""From-scratch ports of HF Llama for the stage-role tests: other classes, other attribute names,
fused q/k/v and gate/up weights, their own rotary code, `forward(input_ids)` returning a plain
tensor. `make_port(hf, names)` builds one and loads the HF model's weights into it.

Imported as `from helpers.llama_ports import make_port` (`tests/helpers/__init__.py`).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

# attribute and class names of two ports: the second avoids every word a name heuristic could use
CONVENTIONAL = dict(
    norm_cls="RMSNormPort",
    attn_cls="AttentionPort",
    mlp_cls="FeedForwardPort",
    block_cls="DecoderBlockPort",
    attrs=("attn_norm", "attn", "ff_norm", "ff"),
    emb="tok_emb",
    blocks="blocks",
    final="norm_f",
    head="output",
)
OPAQUE = dict(
    norm_cls="Scale",
    attn_cls="Mix",
    mlp_cls="Proj",
    block_cls="Stack",
    attrs=("s1", "mix", "s2", "proj"),
    emb="tok",
    blocks="stages",
    final="s_end",
    head="readout",
)


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def rope(q, k, cos, sin):
    """The port's rotary embedding (HF's convention: halves rotated)."""
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rope_seq_major(q, k, cos, sin):
    """HF's convention on `[B, S, heads, D]` tensors (the layout many engines rotate in)."""
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rope_via_seq_major(q, k, cos, sin):
    """The port's attention hands `[B, heads, S, D]`; the rotation itself runs seq-major."""
    qs, ks = rope_seq_major(q.transpose(1, 2), k.transpose(1, 2), cos.transpose(1, 2), sin.transpose(1, 2))
    return qs.transpose(1, 2), ks.transpose(1, 2)


def rope_interleaved(q, k, cos, sin):
    """The rotary-convention bug: pairs (x0, x1), (x2, x3) rotated instead of the two halves."""

    def rot(x):
        x2 = x.reshape(*x.shape[:-1], -1, 2)
        return torch.stack((-x2[..., 1], x2[..., 0]), dim=-1).reshape(x.shape)

    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


class _Norm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.scale * h.to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, rotary) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.dim = heads, kv_heads, hidden // heads
        self.wqkv = nn.Linear(hidden, (heads + 2 * kv_heads) * self.dim, bias=False)
        self.wo = nn.Linear(heads * self.dim, hidden, bias=False)
        self.rotary = rotary.__name__  # called by its module-level name, as a port's code would
        self.einsum = False

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q, k, v = self.wqkv(x).split(
            [self.heads * self.dim, self.kv_heads * self.dim, self.kv_heads * self.dim], -1
        )
        q = q.view(b, s, self.heads, self.dim).transpose(1, 2)
        k = k.view(b, s, self.kv_heads, self.dim).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, self.dim).transpose(1, 2)
        q, k = globals()[self.rotary](q, k, cos, sin)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = (
            einsum_attention(q, k, v)
            if self.einsum
            else F.scaled_dot_product_attention(q, k, v, is_causal=True)
        )
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


def einsum_attention(q, k, v):
    """Causal attention written with einsum: a kernel ffdebug does not read q / k at."""
    s = q.shape[-2]
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), v)


class _FeedForward(nn.Module):
    up_first = False  # the fused weight's halves as [up | gate] (a layout some engines use)

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.w13 = nn.Linear(hidden, 2 * inner, bias=False)
        self.w2 = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        gate, up = self.w13(x).chunk(2, dim=-1)
        if self.up_first:
            gate, up = up, gate
        return self.w2(F.silu(gate) * up)


class _Block(nn.Module):
    def forward(self, x, cos, sin):
        n1, attn, n2, ff = (getattr(self, a) for a in self._attrs)
        x = x + attn(n1(x), cos, sin)
        return x + ff(n2(x))


class _Net(nn.Module):
    def forward(self, input_ids):
        emb, blocks, final, head = (getattr(self, a) for a in self._attrs)
        x = emb(input_ids)
        pos = torch.arange(input_ids.shape[1], dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq)
        table = torch.cat((freqs, freqs), dim=-1)
        cos, sin = table.cos()[None, None], table.sin()[None, None]
        for block in blocks:
            x = block(x, cos, sin)
        return head(final(x))


def make_port(hf, names: dict = CONVENTIONAL, rotary=rope, up_first: bool = False, einsum: bool = False):
    """A port of the HF Llama `hf` with its weights loaded (`rotary` computes the rotated q, k;
    `up_first` stores the fused gate-up weight as [up | gate]; `einsum`: attention by
    `einsum_attention`, not SDPA)."""
    cfg = hf.config
    hidden, heads, kv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    eps = cfg.rms_norm_eps
    norm_cls = type(names["norm_cls"], (_Norm,), {})
    attn_cls = type(names["attn_cls"], (_Attention,), {})
    mlp_cls = type(names["mlp_cls"], (_FeedForward,), {"up_first": up_first})
    block_cls = type(names["block_cls"], (_Block,), {"_attrs": names["attrs"]})
    net_cls = type(
        f"{names['block_cls']}Model",
        (_Net,),
        {"_attrs": (names["emb"], names["blocks"], names["final"], names["head"])},
    )

    def block(layer):
        b = block_cls()
        parts = (
            norm_cls(hidden, eps),
            attn_cls(hidden, heads, kv, rotary),
            norm_cls(hidden, eps),
            mlp_cls(hidden, cfg.intermediate_size),
        )
        for attr, part in zip(names["attrs"], parts):
            setattr(b, attr, part)
        return b

    net = net_cls()
    setattr(net, names["emb"], nn.Embedding(cfg.vocab_size, hidden))
    setattr(net, names["blocks"], nn.ModuleList(block(i) for i in range(cfg.num_hidden_layers)))
    setattr(net, names["final"], norm_cls(hidden, eps))
    setattr(net, names["head"], nn.Linear(hidden, cfg.vocab_size, bias=False))
    net.register_buffer("inv_freq", hf.model.rotary_emb.inv_freq.detach().clone(), persistent=False)
    _load(net, hf, names)
    for m in net.modules():
        if isinstance(m, _Attention):
            m.einsum = einsum
    return net.eval()


@torch.no_grad()
def _load(net, hf, names: dict) -> None:
    getattr(net, names["emb"]).weight.copy_(hf.model.embed_tokens.weight)
    for mine, theirs in zip(getattr(net, names["blocks"]), hf.model.layers):
        n1, attn, n2, ff = (getattr(mine, a) for a in names["attrs"])
        n1.scale.copy_(theirs.input_layernorm.weight)
        n2.scale.copy_(theirs.post_attention_layernorm.weight)
        sa = theirs.self_attn
        attn.wqkv.weight.copy_(torch.cat([sa.q_proj.weight, sa.k_proj.weight, sa.v_proj.weight]))
        attn.wo.weight.copy_(sa.o_proj.weight)
        mlp = theirs.mlp
        halves = [mlp.gate_proj.weight, mlp.up_proj.weight]
        ff.w13.weight.copy_(torch.cat(halves[::-1] if ff.up_first else halves))
        ff.w2.weight.copy_(mlp.down_proj.weight)
    getattr(net, names["final"]).scale.copy_(hf.model.norm.weight)
    getattr(net, names["head"]).weight.copy_(hf.lm_head.weight)


# ---- planted port bugs (issue tests of bisect's patterns): each returns a new, broken copy ----


def _eps_outside_forward(self, x):
    """The bug: eps added outside the square root, 1 / (sqrt(mean(x²)) + eps)."""
    h = x.float()
    h = h / (h.pow(2).mean(-1, keepdim=True).sqrt() + self.eps)
    return self.scale * h.to(x.dtype)


def _norms(net):
    return [m for m in net.modules() if isinstance(m, _Norm)]


def _blocks(net):
    return [m for m in net.modules() if isinstance(m, _Block)]


def eps_outside_sqrt(port):
    """Every norm of the port adds eps outside the square root."""
    import copy
    import types

    bad = copy.deepcopy(port)
    for norm in _norms(bad):
        norm.forward = types.MethodType(_eps_outside_forward, norm)
    return bad


def _no_attn_residual_forward(self, x, cos, sin):
    n1, attn, n2, ff = (getattr(self, a) for a in self._attrs)
    x = attn(n1(x), cos, sin)  # the bug: the residual around attention is dropped
    return x + ff(n2(x))


def dropped_residual(port, layer: int):
    """Layer `layer` forgets the residual connection around its attention."""
    import copy
    import types

    bad = copy.deepcopy(port)
    block = _blocks(bad)[layer]
    block.forward = types.MethodType(_no_attn_residual_forward, block)
    return bad


def down_proj_not_loaded(port, layer: int, seed: int = 5):
    """Layer `layer`'s down projection keeps its fresh initialisation (the load skipped it)."""
    import copy

    bad = copy.deepcopy(port)
    block = _blocks(bad)[layer]
    ff = next(m for m in block.children() if isinstance(m, _FeedForward))
    with torch.no_grad():
        fresh = nn.Linear(ff.w2.in_features, ff.w2.out_features, bias=False)
        torch.manual_seed(seed)
        fresh.reset_parameters()
        ff.w2.weight.copy_(fresh.weight)
    return bad


def _gqa_ungrouped_forward(self, x, cos, sin):
    """The GQA bug: kv heads tiled (k0, k1, k0, k1) instead of grouped (k0, k0, k1, k1)."""
    b, s, _ = x.shape
    q, k, v = self.wqkv(x).split(
        [self.heads * self.dim, self.kv_heads * self.dim, self.kv_heads * self.dim], -1
    )
    q = q.view(b, s, self.heads, self.dim).transpose(1, 2)
    k = k.view(b, s, self.kv_heads, self.dim).transpose(1, 2)
    v = v.view(b, s, self.kv_heads, self.dim).transpose(1, 2)
    q, k = globals()[self.rotary](q, k, cos, sin)
    rep = self.heads // self.kv_heads
    k, v = k.repeat(1, rep, 1, 1), v.repeat(1, rep, 1, 1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.wo(out.transpose(1, 2).reshape(b, s, -1))


def gqa_ungrouped(port):
    """Every attention of the port pairs query heads with the wrong kv heads."""
    import copy
    import types

    bad = copy.deepcopy(port)
    for m in bad.modules():
        if isinstance(m, _Attention):
            m.forward = types.MethodType(_gqa_ungrouped_forward, m)
    return bad


def hf_for_ports(num_layers: int = 4, qk_scale: float = 1.0):
    """A seeded HF Llama for the pattern tests: hidden 64, MLP width 1024 (its down projection is
    wide enough that the thread count changes its bits: the noise run), norms that are not all
    ones, q / k projections scaled by `qk_scale` (sharper attention makes rotary matter)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from helpers.tiny_models import lm_tiny

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**dict(lm_tiny(num_layers, 64), intermediate_size=1024))).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(
                    torch.empty_like(p).uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(name)))
                )
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(qk_scale)
            layer.self_attn.k_proj.weight.mul_(qk_scale)
    return model
