"""From-scratch ports for the content-matching tests (own attribute names, fused and stacked
weights), loading a Hugging Face checkpoint's tensors by their own loaders.

`LlamaPort` holds `tok_emb`, `blocks.N.attn.wqkv` (q, k, v fused), `blocks.N.attn.wo`,
`blocks.N.attn_norm.scale`, `blocks.N.ff_norm.scale`, `blocks.N.ff.w13` (gate, up fused),
`blocks.N.ff.w2`, `norm_f.scale`, `output`. `MoEPort` holds experts stacked as
`blocks.N.moe.w_gate_up` [E, 2I, H] and `blocks.N.moe.w_down` [E, H, I].
"""

from __future__ import annotations

import torch
from torch import nn


class Norm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(dim))  # not ones: an unloaded norm is visible


class Attn(nn.Module):
    def __init__(self, h: int, q: int, kv: int, head_norm: int | None) -> None:
        super().__init__()
        self.wqkv = nn.Linear(h, q + 2 * kv, bias=False)
        self.wo = nn.Linear(q, h, bias=False)
        if head_norm:  # Qwen3: per-head q / k norms
            self.q_norm, self.k_norm = Norm(head_norm), Norm(head_norm)


class FF(nn.Module):
    def __init__(self, h: int, i: int) -> None:
        super().__init__()
        self.w13 = nn.Linear(h, 2 * i, bias=False)
        self.w2 = nn.Linear(i, h, bias=False)


class MoE(nn.Module):
    def __init__(self, h: int, i: int, experts: int) -> None:
        super().__init__()
        self.router = nn.Linear(h, experts, bias=False)
        self.w_gate_up = nn.Parameter(torch.randn(experts, 2 * i, h))
        self.w_down = nn.Parameter(torch.randn(experts, h, i))


class Block(nn.Module):
    def __init__(self, cfg, moe: bool) -> None:
        super().__init__()
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
        self.attn_norm = Norm(cfg.hidden_size)
        self.attn = Attn(cfg.hidden_size, q, kv, hd if moe else None)
        self.ff_norm = Norm(cfg.hidden_size)
        if moe:
            self.moe = MoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts)
        else:
            self.ff = FF(cfg.hidden_size, cfg.intermediate_size)


class Port(nn.Module):
    def __init__(self, cfg, moe: bool = False) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.blocks = nn.ModuleList(Block(cfg, moe) for _ in range(cfg.num_hidden_layers))
        self.norm_f = Norm(cfg.hidden_size)
        self.output = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)


def build(cfg, moe: bool = False, seed: int = 123) -> Port:
    """The port unloaded (its own seeded initialisation)."""
    torch.manual_seed(seed)
    return Port(cfg, moe)


@torch.no_grad()
def load_hf(port: Port, sd: dict, *, swap_qk_layer=None, skip=(), permute_experts=None) -> Port:
    """Load an HF Llama / Qwen3-MoE state dict into the port, with optional planted bugs:
    `swap_qk_layer` fuses k before q in that layer; `skip` leaves those port tensors at their
    initialisation; `permute_experts=(layer, perm)` stacks expert perm[e] into slot e."""

    def put(name, value):
        if name not in skip:
            port.get_parameter(name).copy_(value)

    put("tok_emb.weight", sd["model.embed_tokens.weight"])
    put("output.weight", sd["lm_head.weight"])
    put("norm_f.scale", sd["model.norm.weight"])
    for i, blk in enumerate(port.blocks):
        p = f"model.layers.{i}."
        q, k, v = (sd[p + f"self_attn.{x}_proj.weight"] for x in "qkv")
        put(f"blocks.{i}.attn.wqkv.weight", torch.cat([k, q, v] if swap_qk_layer == i else [q, k, v]))
        put(f"blocks.{i}.attn.wo.weight", sd[p + "self_attn.o_proj.weight"])
        put(f"blocks.{i}.attn_norm.scale", sd[p + "input_layernorm.weight"])
        put(f"blocks.{i}.ff_norm.scale", sd[p + "post_attention_layernorm.weight"])
        if hasattr(blk.attn, "q_norm"):
            put(f"blocks.{i}.attn.q_norm.scale", sd[p + "self_attn.q_norm.weight"])
            put(f"blocks.{i}.attn.k_norm.scale", sd[p + "self_attn.k_norm.weight"])
        if hasattr(blk, "ff"):
            gate, up = sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]
            put(f"blocks.{i}.ff.w13.weight", torch.cat([gate, up]))
            put(f"blocks.{i}.ff.w2.weight", sd[p + "mlp.down_proj.weight"])
            continue
        n = blk.moe.w_gate_up.shape[0]
        perm = permute_experts[1] if permute_experts and permute_experts[0] == i else list(range(n))
        e = p + "mlp.experts."
        put(f"blocks.{i}.moe.router.weight", sd[p + "mlp.gate.weight"])
        gu = [torch.cat([sd[f"{e}{j}.gate_proj.weight"], sd[f"{e}{j}.up_proj.weight"]]) for j in perm]
        put(f"blocks.{i}.moe.w_gate_up", torch.stack(gu))
        put(f"blocks.{i}.moe.w_down", torch.stack([sd[f"{e}{j}.down_proj.weight"] for j in perm]))
    return port


def tiny_qwen3_moe(seed: int = 0):
    """A seeded `Qwen3MoeForCausalLM` (4 experts, 2 layers), built from its config."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return Qwen3MoeForCausalLM(cfg).eval()


ENTRY = """
import sys
from safetensors.torch import load_file
from transformers import AutoConfig

from helpers.weights.ports import build, load_hf


def load(checkpoint=None):
    port = build(AutoConfig.from_pretrained(CKPT))
    if checkpoint is None:
        return port  # unloaded: the audit compares against this initialisation
    return load_hf(port, load_file(checkpoint + "/model.safetensors"), skip=SKIP)
"""
