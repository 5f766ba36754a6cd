"""A Llama built from torch alone, with transformers' module names and classes' names (so the
role rules of docs/dumping.md "Role sub-stages" and the block-class report read as for
`LlamaForCausalLM`), for hunt tests whose point is the search, not the HF codebase: each run
script then starts without importing transformers (about half a run's CPU time). Its rotary
function is tapped with `ffdebug.tap_function` as `attn.q_rot` / `attn.k_rot`, the line a user's
own codebase would add.

Imported as `helpers.hunt.torch_llama` (`tests/helpers/__init__.py`).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    """q, k: [B, heads, S, D]; cos, sin: [B, S, D]. Returns the rotated (q, k)."""
    cos, sin = cos[:, None], sin[:, None]
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class LlamaRMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class LlamaAttention(nn.Module):
    def __init__(self, d: int, heads: int, kv: int):
        super().__init__()
        self.heads, self.kv, self.dh = heads, kv, d // heads
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, kv * self.dh, bias=False)
        self.v_proj = nn.Linear(d, kv * self.dh, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x, position_embeddings):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.dh).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv, self.dh).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv, self.dh).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        rep = self.heads // self.kv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class LlamaMLP(nn.Module):
    def __init__(self, d: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, inner, bias=False)
        self.up_proj = nn.Linear(d, inner, bias=False)
        self.down_proj = nn.Linear(inner, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, d: int, heads: int, kv: int, inner: int):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(d)
        self.self_attn = LlamaAttention(d, heads, kv)
        self.post_attention_layernorm = LlamaRMSNorm(d)
        self.mlp = LlamaMLP(d, inner)

    def forward(self, x, position_embeddings):
        x = x + self.self_attn(self.input_layernorm(x), position_embeddings=position_embeddings)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, kv: int, inner: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(LlamaDecoderLayer(d, heads, kv, inner) for _ in range(layers))
        self.norm = LlamaRMSNorm(d)
        dh = d // heads
        self.register_buffer("inv_freq", 1e4 ** (-torch.arange(0, dh, 2).float() / dh), persistent=False)

    def forward(self, ids):
        x = self.embed_tokens(ids)
        freqs = torch.outer(torch.arange(ids.shape[1], dtype=torch.float32), self.inv_freq)
        table = torch.cat((freqs, freqs), dim=-1)[None]
        pe = (table.cos().to(x.dtype), table.sin().to(x.dtype))
        for layer in self.layers:
            x = layer(x, position_embeddings=pe)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, kv: int, inner: int):
        super().__init__()
        self.model = LlamaModel(vocab, d, layers, heads, kv, inner)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        return self.lm_head(self.model(ids))


def torch_llama(num_layers: int = 4, hidden: int = 32, vocab: int = 1000, seed: int = 0):
    """A seeded torch-only Llama in eval mode (heads, kv heads and MLP width as `tiny_models.lm_tiny`)."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(vocab, hidden, num_layers, 4, 2, 2 * hidden).eval()
