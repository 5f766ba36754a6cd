"""A from-scratch port of HF Qwen3-MoE for the role sub-stage tests: its own classes and attribute
names, a fused q/k/v weight, expert weights stacked as `[E, 2·I, H]` / `[E, H, I]` parameters of
the MoE block itself (no expert modules; with `expert_list=True`, an `nn.ModuleList` of expert
MLPs instead), a plain `nn.Linear` router, its own rotary code and
`forward(ids)` returning a plain tensor. `tiny_qwen3_moe()` builds the HF side from a config;
`make_moe_port(hf)` builds the port and loads its weights.

Imported as `from helpers.moe_port import make_moe_port` (`tests/helpers/__init__.py`).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers.llama_ports import rope


def tiny_qwen3_moe(num_layers: int = 2, seed: int = 0):
    """A seeded `Qwen3MoeForCausalLM`: hidden 32, 4 heads of 8, 2 KV heads, 8 experts of width 16,
    top-2 renormalised; eager experts (the per-expert loop runs one projection per expert)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=1000,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    model = Qwen3MoeForCausalLM._from_config(cfg, experts_implementation="eager").eval()
    with torch.no_grad():  # HF initialises the router at zero: give it weights so routing matters
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
    return model


class Rms(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        return self.g * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Mixer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv: int, dim: int, eps: float) -> None:
        super().__init__()
        self.h, self.kv, self.d = heads, kv, dim
        self.qkv = nn.Linear(hidden, (heads + 2 * kv) * dim, bias=False)
        self.out = nn.Linear(heads * dim, hidden, bias=False)
        self.qn, self.kn = Rms(dim, eps), Rms(dim, eps)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split([self.h * self.d, self.kv * self.d, self.kv * self.d], -1)
        q = self.qn(q.view(b, s, self.h, self.d)).transpose(1, 2)
        k = self.kn(k.view(b, s, self.kv, self.d)).transpose(1, 2)
        v = v.view(b, s, self.kv, self.d).transpose(1, 2)
        q, k = rope(q, k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.out(o.transpose(1, 2).reshape(b, s, -1))


class Routed(nn.Module):
    """Top-k routing over stacked expert weights, one `F.linear` per expert slice."""

    def __init__(self, hidden: int, inner: int, experts: int, k: int) -> None:
        super().__init__()
        self.k = k
        self.pick = nn.Linear(hidden, experts, bias=False)
        self.w_in = nn.Parameter(torch.empty(experts, 2 * inner, hidden))
        self.w_out = nn.Parameter(torch.empty(experts, hidden, inner))

    def forward(self, x):
        b, s, h = x.shape
        flat = x.reshape(-1, h)
        probs = self.pick(flat).softmax(-1, dtype=torch.float)
        w, ids = probs.topk(self.k, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(flat)
        for e in range(self.w_in.shape[0]):
            tok, slot = (ids == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            g, u = F.linear(flat[tok], self.w_in[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(g) * u, self.w_out[e])
            out.index_add_(0, tok, y * w[tok, slot, None])
        return out.view(b, s, h)


class Unit(nn.Module):
    """One expert as a module (Mixtral's older layout): w1 gate, w3 up, w2 down."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, inner, bias=False)
        self.w3 = nn.Linear(hidden, inner, bias=False)
        self.w2 = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class RoutedList(nn.Module):
    """The same routing over an expert list."""

    def __init__(self, hidden: int, inner: int, experts: int, k: int) -> None:
        super().__init__()
        self.k = k
        self.pick = nn.Linear(hidden, experts, bias=False)
        self.units = nn.ModuleList(Unit(hidden, inner) for _ in range(experts))

    def forward(self, x):
        b, s, h = x.shape
        flat = x.reshape(-1, h)
        w, ids = self.pick(flat).softmax(-1, dtype=torch.float).topk(self.k, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(flat)
        for e, unit in enumerate(self.units):
            tok, slot = (ids == e).nonzero(as_tuple=True)
            if tok.numel():
                out.index_add_(0, tok, unit(flat[tok]) * w[tok, slot, None])
        return out.view(b, s, h)


class Layer(nn.Module):
    def __init__(self, cfg, expert_list: bool = False) -> None:
        super().__init__()
        d, eps = cfg.hidden_size // cfg.num_attention_heads, cfg.rms_norm_eps
        self.a = Rms(cfg.hidden_size, eps)
        self.mix = Mixer(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, d, eps)
        self.b = Rms(cfg.hidden_size, eps)
        routed = RoutedList if expert_list else Routed
        self.route = routed(
            cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok
        )

    def forward(self, x, cos, sin):
        x = x + self.mix(self.a(x), cos, sin)
        return x + self.route(self.b(x))


class Net(nn.Module):
    def __init__(self, cfg, inv_freq, expert_list: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.trunk = nn.ModuleList(Layer(cfg, expert_list) for _ in range(cfg.num_hidden_layers))
        self.end = Rms(cfg.hidden_size, cfg.rms_norm_eps)
        self.read = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, ids):
        x = self.tok(ids)
        freqs = torch.outer(torch.arange(ids.shape[1], dtype=torch.float32), self.inv_freq)
        table = torch.cat((freqs, freqs), dim=-1)
        cos, sin = table.cos()[None, None], table.sin()[None, None]
        for layer in self.trunk:
            x = layer(x, cos, sin)
        return self.read(self.end(x))


@torch.no_grad()
def make_moe_port(hf, expert_list: bool = False) -> Net:
    """The port of `hf` (a `tiny_qwen3_moe`) with its weights loaded; `expert_list`: experts as
    modules of an `nn.ModuleList` instead of stacked weights."""
    net = Net(hf.config, hf.model.rotary_emb.inv_freq.detach().clone(), expert_list)
    net.tok.weight.copy_(hf.model.embed_tokens.weight)
    for mine, theirs in zip(net.trunk, hf.model.layers):
        sa, moe = theirs.self_attn, theirs.mlp
        mine.a.g.copy_(theirs.input_layernorm.weight)
        mine.b.g.copy_(theirs.post_attention_layernorm.weight)
        mine.mix.qkv.weight.copy_(torch.cat([sa.q_proj.weight, sa.k_proj.weight, sa.v_proj.weight]))
        mine.mix.out.weight.copy_(sa.o_proj.weight)
        mine.mix.qn.g.copy_(sa.q_norm.weight)
        mine.mix.kn.g.copy_(sa.k_norm.weight)
        mine.route.pick.weight.copy_(moe.gate.weight)
        if expert_list:
            for unit, gate_up, down in zip(mine.route.units, moe.experts.gate_up_proj, moe.experts.down_proj):
                gate, up = gate_up.chunk(2, dim=0)
                unit.w1.weight.copy_(gate)
                unit.w3.weight.copy_(up)
                unit.w2.weight.copy_(down)
        else:
            mine.route.w_in.copy_(moe.experts.gate_up_proj)
            mine.route.w_out.copy_(moe.experts.down_proj)
    net.end.g.copy_(hf.model.norm.weight)
    net.read.weight.copy_(hf.lm_head.weight)
    return net.eval()
