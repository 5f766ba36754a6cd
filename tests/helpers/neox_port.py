"""An engine-style port of a tiny HF GPT-NeoX for the engine-port tests, written from the model's
equations: parallel residual `x + attn(ln1(x)) + mlp(ln2(x))`, a fused q / k / v weight in
GPT-NeoX's per-head interleaved layout ([q_h | k_h | v_h] per head h) read through a
`[B, S, heads, 3, D]` view, rotary on the first `rot` dims of each head only (halves rotated), no
hint word in any class or attribute name, and logits returned with another output in a tuple.

`tiny_neox()` builds the HF side; `make_neox_port(hf, rotary_dims=None, qkv_blocks=False)` builds
the port and loads the weights (`rotary_dims`: rotate that many dims, a planted bug when it is not
the model's; `qkv_blocks`: read the fused output as [q | k | v] blocks, a planted layout bug).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def tiny_neox(num_layers: int = 3, seed: int = 0):
    """A seeded `GPTNeoXForCausalLM`: hidden 32, 4 heads of 8, rotary on 2 of them (0.25)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(seed)
    cfg = GPTNeoXConfig(
        vocab_size=1000,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        rotary_pct=0.25,
        max_position_embeddings=128,
        use_parallel_residual=True,
        tie_word_embeddings=False,
    )
    model = GPTNeoXForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name or "layer_norm" in name:
                p.add_(torch.empty_like(p).uniform_(-0.3, 0.3))
    return model


def _half_turn(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Mix(nn.Module):
    def __init__(self, hidden: int, heads: int, rot: int, qkv_blocks: bool) -> None:
        super().__init__()
        self.h, self.d, self.rot, self.blocks = heads, hidden // heads, rot, qkv_blocks
        self.w = nn.Linear(hidden, 3 * hidden)
        self.wo = nn.Linear(hidden, hidden)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        y = self.w(x)
        if self.blocks:  # the layout bug: the per-head interleaved weight read as [q | k | v]
            q, k, v = (t.view(b, s, self.h, self.d) for t in y.chunk(3, dim=-1))
        else:
            q, k, v = y.view(b, s, self.h, 3, self.d).unbind(dim=-2)
        q, k = (
            torch.cat(
                [t[..., : self.rot] * cos + _half_turn(t[..., : self.rot]) * sin, t[..., self.rot :]], -1
            )
            for t in (q, k)
        )
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class Widen(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(hidden, inner), nn.Linear(inner, hidden)

    def forward(self, x):
        return self.b(F.gelu(self.a(x)))


class Unit(nn.Module):
    def __init__(self, cfg, rot: int, qkv_blocks: bool) -> None:
        super().__init__()
        hid = cfg.hidden_size
        self.n1, self.n2 = (
            nn.LayerNorm(hid, eps=cfg.layer_norm_eps),
            nn.LayerNorm(hid, eps=cfg.layer_norm_eps),
        )
        self.m = Mix(hid, cfg.num_attention_heads, rot, qkv_blocks)
        self.f = Widen(hid, cfg.intermediate_size)

    def forward(self, x, cos, sin):
        return x + self.m(self.n1(x), cos, sin) + self.f(self.n2(x))


class NeoxNet(nn.Module):
    def __init__(self, cfg, rot: int, qkv_blocks: bool) -> None:
        super().__init__()
        self.e = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.u = nn.ModuleList(Unit(cfg, rot, qkv_blocks) for _ in range(cfg.num_hidden_layers))
        self.n = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.r = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rot = rot

    def forward(self, ids):
        x = self.e(ids)
        inv = self.inv_freq if self.rot == 2 * self.inv_freq.numel() else _inv_freq(self.rot, self.base)
        angles = torch.arange(ids.shape[1], dtype=torch.float32)[:, None] * inv
        table = torch.cat((angles, angles), dim=-1)
        cos, sin = table.cos()[None, :, None], table.sin()[None, :, None]  # [1, S, 1, rot]
        for unit in self.u:
            x = unit(x, cos, sin)
        logits = self.r(self.n(x))
        return x, logits  # the final hidden state first: the logits are found by their width


def _inv_freq(dims: int, base: float):
    return 1.0 / (base ** (torch.arange(0, dims, 2, dtype=torch.float32) / dims))


@torch.no_grad()
def make_neox_port(hf, rotary_dims: int | None = None, qkv_blocks: bool = False) -> NeoxNet:
    cfg = hf.config
    inv = hf.gpt_neox.rotary_emb.inv_freq.detach().clone()
    net = NeoxNet(cfg, rotary_dims or 2 * inv.numel(), qkv_blocks)
    net.register_buffer("inv_freq", inv, persistent=False)
    net.base = cfg.rope_parameters["rope_theta"]
    net.e.weight.copy_(hf.gpt_neox.embed_in.weight)
    for mine, theirs in zip(net.u, hf.gpt_neox.layers):
        mine.n1.load_state_dict(theirs.input_layernorm.state_dict())
        mine.n2.load_state_dict(theirs.post_attention_layernorm.state_dict())
        mine.m.w.load_state_dict(theirs.attention.query_key_value.state_dict())
        mine.m.wo.load_state_dict(theirs.attention.dense.state_dict())
        mine.f.a.load_state_dict(theirs.mlp.dense_h_to_4h.state_dict())
        mine.f.b.load_state_dict(theirs.mlp.dense_4h_to_h.state_dict())
    net.n.load_state_dict(hf.gpt_neox.final_layer_norm.state_dict())
    net.r.weight.copy_(hf.lm_head.weight)
    return net.eval()
