"""Tiny HF models built from configs (no download) and the bugs the bisect tests inject.

Reference and target share weights: both are built from the same seed. The functions without
arguments double as `--model-ref` / `--model-target` entries (`tests/helpers/bisect/bisect_models.py:llama_ref`).
"""

from __future__ import annotations

import copy

import torch

DS_CLASSES = "DeepseekV3DecoderLayer,DeepseekV3TopkRouter,DeepseekV3Experts,DeepseekV3MLP"
ROPE_BAD_LAYER = 2
ROPE_BAD_BASE = 1000.0


def deepseek(num_layers: int = 5, dense: int = 2):
    """DeepSeek-V3-style LM: `dense` dense layers, then MoE layers (router weights non-zero)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from ffdebug.demo import DEMO_CONFIG

    torch.manual_seed(0)
    cfg = dict(DEMO_CONFIG, num_hidden_layers=num_layers, first_k_dense_replace=dense)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**cfg)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                gate.weight.normal_(0.0, 0.5)
    return model


def deepseek_missing_routed_scaling(model):
    """The port's bug: the MoE router forgets `routed_scaling_factor` (MoE layers only)."""
    target = copy.deepcopy(model)
    for layer in target.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "routed_scaling_factor"):
            gate.routed_scaling_factor = 1.0
    return target


def llama(num_layers: int = 5):
    """Llama-style LM with sharpened q/k projections so that rotary positions matter."""
    from helpers.tiny_models import tiny_llama

    model = tiny_llama(num_layers=num_layers)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6.0)
            layer.self_attn.k_proj.weight.mul_(6.0)
    return model


def _rotary(cos, base: float):
    dim = cos.shape[-1]
    pos = torch.arange(cos.shape[-2], dtype=torch.float32)
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.outer(pos, inv)
    emb = torch.cat([freqs, freqs], dim=-1)[None]
    return emb.cos().to(cos.dtype), emb.sin().to(cos.dtype)


def llama_wrong_rope(model, layer: int = ROPE_BAD_LAYER, base: float = ROPE_BAD_BASE):
    """The port's bug: one layer's attention builds its rotary table with the wrong base."""
    target = copy.deepcopy(model)

    def pre(module, args, kwargs):
        cos, _sin = kwargs["position_embeddings"]
        return args, dict(kwargs, position_embeddings=_rotary(cos, base))

    target.model.layers[layer].self_attn.register_forward_pre_hook(pre, with_kwargs=True)
    return target


def llama_ref():
    return llama()


def llama_target():
    return llama_wrong_rope(llama())


def input_ids(batch: int = 2, seq: int = 16, vocab: int = 1000, seed: int = 7):
    return torch.randint(3, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def dump(model, directory, side: str, ids, classes=None, **options):
    import ffdebug

    with ffdebug.capture(model, dir=directory, side=side, classes=classes, **options), torch.no_grad():
        model(input_ids=ids)
    return f"{directory}/{side}"


def llama_scaled(model, name: str, factor: float):
    """A target whose parameter `name` (e.g. `lm_head.weight`) is scaled by `factor`."""
    target = copy.deepcopy(model)
    with torch.no_grad():
        target.get_parameter(name).mul_(factor)
    return target


def qwen2_sliding(num_layers: int = 6, window: int = 4):
    """Qwen2-style LM alternating sliding-window and full attention (`layer_types` in the config)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from helpers.tiny_models import lm_tiny

    torch.manual_seed(0)
    cfg = Qwen2Config(
        **lm_tiny(num_layers),
        use_sliding_window=True,
        sliding_window=window,
        layer_types=["sliding_attention", "full_attention"] * (num_layers // 2),
    )
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6.0)
            layer.self_attn.k_proj.weight.mul_(6.0)
    return model


def wrong_sliding_window(model, window: int = 8):
    """The port's bug: the sliding-window layers attend over the wrong window (full layers fine)."""
    target = copy.deepcopy(model)
    target.config.sliding_window = window
    return target


def qwen3_moe(num_layers: int = 6):
    """Qwen3-MoE-style LM alternating dense (even) and MoE (odd) layers, top-2 of 8 experts with
    renormalised top-k weights, q/k norms in every attention (router weights non-zero)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from helpers.tiny_models import lm_tiny

    torch.manual_seed(0)
    cfg = dict(
        lm_tiny(num_layers),
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        decoder_sparse_step=2,
        norm_topk_prob=True,
        head_dim=8,
    )
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.weight.normal_(0.0, 0.5)
    return model


def _routers(model):
    return [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]


def topk_not_renormalised(model):
    """The port's bug: the MoE layers' top-k weights are not renormalised to sum to one."""
    target = copy.deepcopy(model)
    for gate in _routers(target):
        gate.norm_topk_prob = False
    return target


def _bf16_router_forward(self, hidden_states):
    h = hidden_states.reshape(-1, self.hidden_dim)
    logits = torch.nn.functional.linear(h.bfloat16(), self.weight.bfloat16()).float()
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    top, idx = torch.topk(probs, self.top_k, dim=-1)
    return logits, top / top.sum(dim=-1, keepdim=True), idx


def bf16_router(model):
    """Not a bug: the router's projection runs in bf16 (a kernel choice), the rest in fp32."""
    import types

    target = copy.deepcopy(model)
    for gate in _routers(target):
        gate.forward = types.MethodType(_bf16_router_forward, gate)
    return target


def qk_norm_skipped(model, layer: int):
    """The port's bug: one attention layer skips its q / k norms."""
    target = copy.deepcopy(model)
    attn = target.model.layers[layer].self_attn
    attn.q_norm, attn.k_norm = torch.nn.Identity(), torch.nn.Identity()
    return target
