"""An engine-style port of a tiny HF DeepSeek-V3 (MLA attention, grouped routing) for the engine-port
tests, written from the model's equations, not from transformers' code: other classes and names,
one fused `q_a | kv_a` down-projection, the rotary part of the key shared by every head,
`kv_b` kept whole (the unabsorbed form), stacked `w13` / `w2` expert weights run one `F.linear`
per expert slice, its own sigmoid router with a selection-only correction bias, node-limited
(grouped) top-k and a shared expert, dense first layers, `forward(ids)` returning a plain tensor.

    q = W_qb · norm(W_qa · x)                  [B, S, H, d_nope + d_rope] → (q_nope, q_pe)
    c, k_pe = split(W_kva · x)                 c: [B, S, r_kv] latent, k_pe: [B, S, d_rope] (one head)
    k_nope, v = split(W_kvb · norm(c))         [B, S, H, d_nope], [B, S, H, d_v]
    q_pe, k_pe = rope(q_pe), rope(k_pe)        interleaved pairs (x0, x1), (x2, x3), ...
    o = W_o · softmax([q_nope, q_pe] · [k_nope, k_pe]ᵀ · s) v

`tiny_deepseek_v3()` builds the HF side from a config; `make_mla_port(hf)` builds the port and
loads the HF model's weights into it. Imported as `from helpers.mla_port import make_mla_port`.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers.moe_port import Rms


def tiny_deepseek_v3(num_layers: int = 3, seed: int = 0):
    """A seeded `DeepseekV3ForCausalLM`: hidden 32, 4 heads, q / kv latents of 24 / 16, nope 8,
    rope 4, v 8; 8 routed experts in 4 groups (top-2 groups, top-2 experts), one shared expert,
    layer 0 dense; eager experts; router weights and correction bias drawn (HF starts them at 0)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV3Config(
        vocab_size=1000,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        rope_interleave=True,
    )
    model = DeepseekV3ForCausalLM._from_config(cfg, experts_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.uniform_(0.5, 1.5)
        for layer in model.model.layers[cfg.first_k_dense_replace :]:
            layer.mlp.gate.weight.normal_(0, 0.5)
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    return model


def rope_pairs(x, cos, sin):
    """Rotate interleaved pairs (x0, x1), (x2, x3), ... of the last dim by the angles in `cos` /
    `sin` (one per pair); the output lists the rotated first elements, then the second ones."""
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


class LatentAttention(nn.Module):
    def __init__(self, cfg, scale: float) -> None:
        super().__init__()
        self.h, self.nope, self.rope, self.dv = (
            cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
        )  # fmt: skip
        self.rq, self.rkv, self.scale = cfg.q_lora_rank, cfg.kv_lora_rank, scale
        self.down = nn.Linear(cfg.hidden_size, self.rq + self.rkv + self.rope, bias=False)  # q_a | kv_a
        self.q_norm, self.c_norm = Rms(self.rq, 1e-6), Rms(self.rkv, 1e-6)
        self.q_up = nn.Linear(self.rq, self.h * (self.nope + self.rope), bias=False)
        self.kv_up = nn.Linear(self.rkv, self.h * (self.nope + self.dv), bias=False)
        self.out = nn.Linear(self.h * self.dv, cfg.hidden_size, bias=False)

    def absorb(self) -> None:
        """Fold the kv up-projection into q and the output (the absorbed form engines decode with):
        `W_kc` `[H, d_nope, r_kv]` maps q_nope into the latent space, `W_vc` `[H, r_kv, d_v]` maps
        the attention over latents back to per-head values; `kv_b` itself is gone."""
        w = self.kv_up.weight.detach().view(self.h, self.nope + self.dv, self.rkv)
        self.w_kc = nn.Parameter(w[:, : self.nope].clone())
        self.w_vc = nn.Parameter(w[:, self.nope :].transpose(1, 2).clone())
        del self.kv_up

    def forward(self, x, cos, sin, mask=None):
        if x.dim() == 2:  # packed [T, hidden]: one row of tokens, `mask` keeps sequences apart
            return self.forward(x[None], cos, sin, mask)[0]
        if hasattr(self, "w_kc"):
            return self.absorbed(x, cos, sin)
        b, s, _ = x.shape
        q_lat, c, k_pe = self.down(x).split([self.rq, self.rkv, self.rope], dim=-1)
        q = self.q_up(self.q_norm(q_lat)).view(b, s, self.h, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        kv = self.kv_up(self.c_norm(c)).view(b, s, self.h, self.nope + self.dv)
        k_nope, v = kv.split([self.nope, self.dv], dim=-1)
        q_pe = rope_pairs(q_pe, cos[:, :, None], sin[:, :, None])
        k_pe = rope_pairs(k_pe[:, :, None], cos[:, :, None], sin[:, :, None])
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)
        k = torch.cat([k_nope, k_pe.expand(b, s, self.h, self.rope)], dim=-1).transpose(1, 2)
        causal = dict(is_causal=True) if mask is None else dict(attn_mask=mask)
        o = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), scale=self.scale, **causal)
        return self.out(o.transpose(1, 2).reshape(b, s, -1))

    def absorbed(self, x, cos, sin):
        """softmax((W_kc q_nope)·c + q_pe·k_pe) over the latents c, then W_vc: one kv head (MQA)."""
        b, s, _ = x.shape
        q_lat, c, k_pe = self.down(x).split([self.rq, self.rkv, self.rope], dim=-1)
        q = self.q_up(self.q_norm(q_lat)).view(b, s, self.h, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        c = self.c_norm(c)
        q_pe = rope_pairs(q_pe, cos[:, :, None], sin[:, :, None])
        k_pe = rope_pairs(k_pe, cos, sin)
        q_lat_heads = torch.bmm(q_nope.reshape(b * s, self.h, self.nope).transpose(0, 1), self.w_kc)
        q_lat_heads = q_lat_heads.transpose(0, 1).reshape(b, s, self.h, self.rkv)
        qk = torch.cat([q_lat_heads, q_pe], dim=-1).transpose(1, 2)  # [B, H, S, r_kv + d_rope]
        kk = torch.cat([c, k_pe], dim=-1)[:, None]  # [B, 1, S, r_kv + d_rope]
        o = F.scaled_dot_product_attention(
            qk, kk, c[:, None], is_causal=True, scale=self.scale, enable_gqa=True
        )
        o = torch.bmm(o.transpose(1, 2).reshape(b * s, self.h, self.rkv).transpose(0, 1), self.w_vc)
        return self.out(o.transpose(0, 1).reshape(b, s, self.h * self.dv))


class Dense(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.w13 = nn.Linear(hidden, 2 * inner, bias=False)
        self.w2 = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        g, u = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(g) * u)


class GroupedMoE(nn.Module):
    """Sigmoid scores; selection by score + bias among the best `topk_group` groups (a group's
    strength: the sum of its two best biased scores); weights are the chosen unbiased scores,
    renormalised and scaled; plus a shared expert on every token."""

    def __init__(self, cfg) -> None:
        super().__init__()
        e, hid, inner = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.k, self.groups, self.keep = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.factor = cfg.routed_scaling_factor
        self.score = nn.Linear(hid, e, bias=False)
        self.bias = nn.Parameter(torch.zeros(e), requires_grad=False)
        self.w13 = nn.Parameter(torch.empty(e, 2 * inner, hid))
        self.w2 = nn.Parameter(torch.empty(e, hid, inner))
        self.common = Dense(hid, inner * cfg.n_shared_experts)

    def route(self, flat):
        scores = F.linear(flat.float(), self.score.weight.float()).sigmoid()
        biased = scores + self.bias
        n = flat.shape[0]
        strength = biased.view(n, self.groups, -1).topk(2, dim=-1).values.sum(-1)
        kept = strength.topk(self.keep, dim=-1, sorted=False).indices
        allowed = torch.zeros_like(strength).scatter(1, kept, 1.0).bool()
        allowed = allowed[:, :, None].expand(n, self.groups, biased.shape[-1] // self.groups).reshape(n, -1)
        ids = biased.masked_fill(~allowed, float("-inf")).topk(self.k, dim=-1, sorted=False).indices
        w = scores.gather(1, ids)
        return ids, w / (w.sum(-1, keepdim=True) + 1e-20) * self.factor

    def forward(self, x):
        hid = x.shape[-1]
        flat = x.reshape(-1, hid)
        ids, w = self.route(flat)
        out = torch.zeros_like(flat)
        for e in range(self.w13.shape[0]):
            slot, tok = torch.where((ids == e).T)
            if tok.numel() == 0:
                continue
            g, u = F.linear(flat[tok], self.w13[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(g) * u, self.w2[e]) * w[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return (out + self.common(flat)).view(x.shape)


class Layer(nn.Module):
    def __init__(self, cfg, scale: float, dense: bool) -> None:
        super().__init__()
        self.pre_mix, self.pre_ff = (
            Rms(cfg.hidden_size, cfg.rms_norm_eps),
            Rms(cfg.hidden_size, cfg.rms_norm_eps),
        )
        self.mix = LatentAttention(cfg, scale)
        self.ff = Dense(cfg.hidden_size, cfg.intermediate_size) if dense else GroupedMoE(cfg)

    def forward(self, x, cos, sin, mask=None):
        x = x + self.mix(self.pre_mix(x), cos, sin, mask)
        return x + self.ff(self.pre_ff(x))


class MlaNet(nn.Module):
    def __init__(self, cfg, scale: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.stack = nn.ModuleList(
            Layer(cfg, scale, dense=i < cfg.first_k_dense_replace) for i in range(cfg.num_hidden_layers)
        )
        self.last = Rms(cfg.hidden_size, cfg.rms_norm_eps)
        self.read = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, ids):
        x = self.tok(ids)
        angles = torch.arange(ids.shape[1], dtype=torch.float32)[:, None] * self.inv_freq  # [S, d_rope/2]
        cos, sin = angles.cos()[None], angles.sin()[None]
        for layer in self.stack:
            x = layer(x, cos, sin)
        return self.read(self.last(x))


class PackedMlaNet(MlaNet):
    """The same model on packed tokens: `forward(ids [T], cu_seqlens [n + 1])`, every sequence's
    tokens one after the other, positions restarting per sequence, attention kept inside each
    sequence by a block-diagonal causal mask (`leak = True`, a planted bug: causal over the whole
    pack, so later sequences attend to earlier ones); block stages are `[T, hidden]`."""

    leak = False

    def forward(self, ids, cu_seqlens):
        x = self.tok(ids)
        lens = cu_seqlens.diff()
        seq = torch.repeat_interleave(torch.arange(lens.numel()), lens)
        pos = torch.arange(ids.numel()) - cu_seqlens[seq]
        angles = pos[:, None].float() * self.inv_freq
        cos, sin = angles.cos()[None], angles.sin()[None]
        t = torch.arange(ids.numel())
        mask = t[:, None] >= t[None, :]
        if not self.leak:
            mask &= seq[:, None] == seq[None, :]
        for layer in self.stack:
            x = layer(x, cos, sin, mask)
        return self.read(self.last(x))


def pack(ids, mask):
    """(packed ids [T], cu_seqlens) of a right-padded batch."""
    lens = mask.sum(-1)
    return ids[mask.bool()], torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])


@torch.no_grad()
def make_mla_port(hf, absorbed: bool = False, packed: bool = False) -> MlaNet:
    """The port of `hf` (a `tiny_deepseek_v3()`) with its weights loaded; `absorbed`: every
    attention in the absorbed form (`LatentAttention.absorb`); `packed`: a `PackedMlaNet`."""
    cfg = hf.config
    net = (PackedMlaNet if packed else MlaNet)(cfg, hf.model.layers[0].self_attn.scaling)
    net.register_buffer("inv_freq", hf.model.rotary_emb.inv_freq.detach().clone(), persistent=False)
    net.tok.weight.copy_(hf.model.embed_tokens.weight)
    for mine, theirs in zip(net.stack, hf.model.layers):
        mine.pre_mix.g.copy_(theirs.input_layernorm.weight)
        mine.pre_ff.g.copy_(theirs.post_attention_layernorm.weight)
        a, sa = mine.mix, theirs.self_attn
        a.down.weight.copy_(torch.cat([sa.q_a_proj.weight, sa.kv_a_proj_with_mqa.weight]))
        a.q_norm.g.copy_(sa.q_a_layernorm.weight)
        a.c_norm.g.copy_(sa.kv_a_layernorm.weight)
        a.q_up.weight.copy_(sa.q_b_proj.weight)
        a.kv_up.weight.copy_(sa.kv_b_proj.weight)
        a.out.weight.copy_(sa.o_proj.weight)
        if isinstance(mine.ff, Dense):
            _load_dense(mine.ff, theirs.mlp)
            continue
        moe = theirs.mlp
        mine.ff.score.weight.copy_(moe.gate.weight)
        mine.ff.bias.copy_(moe.gate.e_score_correction_bias)
        mine.ff.w13.copy_(moe.experts.gate_up_proj)
        mine.ff.w2.copy_(moe.experts.down_proj)
        _load_dense(mine.ff.common, moe.shared_experts)
    net.last.g.copy_(hf.model.norm.weight)
    net.read.weight.copy_(hf.lm_head.weight)
    if absorbed:
        for layer in net.stack:
            layer.mix.absorb()
    return net.eval()


def _load_dense(mine: Dense, theirs) -> None:
    mine.w13.weight.copy_(torch.cat([theirs.gate_proj.weight, theirs.up_proj.weight]))
    mine.w2.weight.copy_(theirs.down_proj.weight)
