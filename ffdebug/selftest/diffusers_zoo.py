"""diffusers' denoisers in the selftest: listing, default configs, one shrinker, inputs by signature.

- **Listing**: every `ModelMixin` class diffusers exports from `diffusers.models.transformers` or
  `diffusers.models.unets` (read at run time, never by hand: a new diffusers brings its models).
- **Config**: a diffusers model's config is its constructor's keyword arguments; the default is the
  signature's defaults (a `config.json` with `_class_name` gives its own).
- **Shrinker**: the size arguments diffusers spells (`num_layers`, `num_attention_heads`,
  `attention_head_dim`, `joint_attention_dim`, `cross_attention_dim`, `block_out_channels`,
  `down_block_types`, ...) scaled down together: 2 layers (1 single-stream), 2 heads of 16, text
  states of 32, a UNet of two resolutions (its first and last block kinds) with channels 32 and 64
  and groups of 8, a 16 × 16 latent; rotary axes re-split to sum to the head dim. What does not
  build is reported with the constructor's reason.
- **Inputs**, from the forward's parameter names: the latent (`sample` / `hidden_states`: [B, C, 16,
  16], [B, C, 2, 16, 16] for a video model, [B, 16, C] packed with `img_ids` where the model takes
  position ids: one column per rotary axis), `timestep`, `encoder_hidden_states` [B, 8, D] (D the
  config's text width, else the shrunk 32 when the forward requires text) with an all-ones
  `encoder_attention_mask`, `pooled_projections`, `txt_ids`, `guidance`, `class_labels` where the
  config asks for them. A forward that needs more (image sizes, crop coordinates, extra latents) is
  recorded as not run, with its own error.
"""

from __future__ import annotations

import inspect
from typing import Any

LATENT = 16  # latent height and width
TEXT_TOKENS = 8
PACKED_TOKENS = 16
FRAMES = 2
HEADS, HEAD_DIM, LAYERS, TEXT_DIM = 2, 16, 2, 32
TEXT_WIDTHS = (
    "joint_attention_dim",
    "cross_attention_dim",
    "caption_channels",
    "text_embed_dim",
    "text_dim",
    "cap_feat_dim",
    "caption_dim",
    "text_hidden_dim",
    "context_dim",
)
MODULES = ("diffusers.models.transformers", "diffusers.models.unets")


def model_class(name: str) -> Any | None:
    """The diffusers denoiser class called `name`, else None (diffusers missing, or not a denoiser)."""
    if not name.isidentifier() or not any(m in name for m in ("Transformer", "UNet", "DiT")):
        return None
    try:
        import diffusers
        from diffusers.models.modeling_utils import ModelMixin
    except ImportError:
        return None
    try:
        obj = getattr(diffusers, name, None)
    except Exception:  # noqa: BLE001 - a lazy import that fails: not a usable class
        return None
    if isinstance(obj, type) and issubclass(obj, ModelMixin) and obj.__module__.startswith(MODULES):
        return obj
    return None


def architectures() -> list[str]:
    """Every denoiser class diffusers exports (module docstring), sorted; [] without diffusers."""
    try:
        import diffusers
    except ImportError:
        return []
    names = [
        n for n in dir(diffusers) if n[:1].isupper() and ("Transformer" in n or "UNet" in n or "DiT" in n)
    ]
    return sorted(n for n in names if model_class(n) is not None)


def default_config(cls: Any) -> dict[str, Any]:
    """The constructor's keyword defaults: a diffusers model's default config."""
    out = {}
    for name, p in inspect.signature(cls.__init__).parameters.items():
        if name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.default is p.empty:
            continue
        out[name] = p.default
    return out


def _ints(value: Any, new: int) -> Any:
    """`new` in the shape of `value` (an int, or a tuple / list of ints)."""
    if isinstance(value, (list, tuple)):
        return type(value)(new for _ in value)
    return new


def _axes(axes: Any, head_dim: int) -> Any:
    """Rotary axes re-split to sum to `head_dim`, each even and at least 2, in their proportions."""
    total = sum(axes)
    scaled = [2 * max(1, round(a * head_dim / total / 2)) for a in axes]
    scaled[-1] = head_dim - sum(scaled[:-1])
    if scaled[-1] < 2:
        scaled = [2] * (len(axes) - 1) + [head_dim - 2 * (len(axes) - 1)]
    return type(axes)(scaled)


def shrink(config: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A tiny copy of a diffusers config (module docstring) and what changed (`field: old -> new`)."""
    cfg = dict(config)
    changes: list[str] = []

    def put(name: str, value: Any) -> None:
        if name in cfg and cfg[name] != value:
            changes.append(f"{name}: {cfg[name]!r} -> {value!r}")
            cfg[name] = value

    def is_int(name: str) -> bool:
        v = cfg.get(name)
        return isinstance(v, int) and not isinstance(v, bool)

    for name in ("num_layers", "num_transformer_layers", "depth", "num_blocks"):
        if is_int(name) and cfg[name] > LAYERS:
            put(name, LAYERS)
    for name in (
        "num_single_layers",
        "num_refiner_layers",
        "num_noise_refiner_layers",
        "num_context_refiner_layers",
    ):
        if is_int(name) and cfg[name] > 1:
            put(name, 1)
    old_head_dim = cfg.get("attention_head_dim")
    for name in ("num_attention_heads", "num_heads"):
        if cfg.get(name) is not None:
            put(name, _ints(cfg[name], HEADS))
    if cfg.get("attention_head_dim") is not None:
        put("attention_head_dim", _ints(cfg["attention_head_dim"], HEAD_DIM))
    if is_int("num_key_value_heads") or is_int("num_kv_heads"):
        for name in ("num_key_value_heads", "num_kv_heads"):
            if is_int(name):
                put(name, 1 if cfg[name] == 1 else HEADS)
    for name in TEXT_WIDTHS + ("pooled_projection_dim", "text_hidden_dim", "encoder_hid_dim"):
        if cfg.get(name) is not None and not isinstance(cfg[name], str):
            put(name, _ints(cfg[name], TEXT_DIM))
    inner = HEADS * HEAD_DIM
    for name in ("caption_projection_dim", "inner_dim", "hidden_size", "dim"):
        if is_int(name):
            put(name, inner)
    for name, axes in list(cfg.items()):  # rotary axes (`axes_dims_rope`, `rope_axes_dim`, ...)
        if (
            ("axes" in name or name == "rope_dim_list")
            and isinstance(axes, (list, tuple))
            and all(isinstance(a, int) for a in axes)
            and isinstance(old_head_dim, int)
            and sum(axes) == old_head_dim
        ):
            put(name, _axes(axes, HEAD_DIM))
    _shrink_levels(cfg, config, put)
    if is_int("norm_num_groups"):
        put("norm_num_groups", 8)
    for name in ("sample_size", "pos_embed_max_size", "sample_width", "sample_height"):
        if is_int(name):
            put(name, max(LATENT, 8) if name != "pos_embed_max_size" else LATENT)
    for name in ("time_embedding_dim", "timestep_embed_dim", "cond_dim", "text_time_embed_dim"):
        if is_int(name):
            put(name, inner)
    return cfg, changes


def _shrink_levels(cfg: dict[str, Any], config: dict[str, Any], put) -> None:
    """A UNet cut to two resolutions: its first and last block kinds, channels 32 and 64, one layer
    per block, and every per-level tuple cut to the levels kept."""
    for kinds in ("down_block_types", "up_block_types"):
        types = cfg.get(kinds)
        if isinstance(types, (list, tuple)) and len(types) > 2:
            put(kinds, type(types)((types[0], types[-1])))
    levels = len(cfg["down_block_types"]) if isinstance(cfg.get("down_block_types"), (list, tuple)) else None
    channels = cfg.get("block_out_channels")
    if isinstance(channels, (list, tuple)):
        n = levels or min(len(channels), 2)
        put("block_out_channels", type(channels)(32 * 2 ** min(i, 1) for i in range(n)))
    for name in ("layers_per_block", "transformer_layers_per_block"):
        v = cfg.get(name)
        if v is not None and not isinstance(v, bool):
            put(
                name,
                _ints(v, 1)
                if not isinstance(v, (list, tuple))
                else type(v)(1 for _ in range(levels or len(v))),
            )
    if levels is not None:  # per-level tuples follow the levels kept
        for name, value in list(cfg.items()):
            if (
                name not in ("down_block_types", "up_block_types", "block_out_channels")
                and isinstance(value, tuple)
                and len(value) == len(config.get("down_block_types", ()))
                and len(value) > levels
            ):
                put(name, value[:levels])


def _text_width(config: Any) -> int | None:
    for name in TEXT_WIDTHS:
        value = config.get(name)
        value = value[0] if isinstance(value, (list, tuple)) and value else value
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def denoiser_inputs(model: Any, batch: int, seed: int) -> dict[str, Any]:
    """The forward's keyword arguments for a diffusers denoiser (module docstring)."""
    import torch

    config = dict(model.config)
    params = inspect.signature(model.forward).parameters
    generator = torch.Generator().manual_seed(seed + 11)
    channels = int(config.get("in_channels") or 4)
    latent_name = "sample" if "sample" in params else "hidden_states"
    packed = "img_ids" in params
    video = "3D" in type(model).__name__ or "Video" in type(model).__name__
    if packed:
        latent = torch.randn(batch, PACKED_TOKENS, channels, generator=generator)
    elif video:
        latent = torch.randn(batch, channels, FRAMES, LATENT, LATENT, generator=generator)
    else:
        latent = torch.randn(batch, channels, LATENT, LATENT, generator=generator)
    out: dict[str, Any] = {latent_name: latent}
    if "timestep" in params:
        out["timestep"] = torch.full((batch,), 0.5 if packed else 500.0)
    width = _text_width(config)
    text = params.get("encoder_hidden_states")
    if text is not None and (width is not None or text.default is text.empty):
        # a model whose text width the config does not name gets the shrunk width every rule sets
        out["encoder_hidden_states"] = torch.randn(batch, TEXT_TOKENS, width or TEXT_DIM, generator=generator)
        if "encoder_attention_mask" in params:  # every text token is real
            out["encoder_attention_mask"] = torch.ones(batch, TEXT_TOKENS, dtype=torch.long)
    pooled = config.get("pooled_projection_dim")
    if "pooled_projections" in params and isinstance(pooled, int):
        out["pooled_projections"] = torch.randn(batch, pooled, generator=generator)
    if packed:  # position ids with one column per rotary axis: (frame or text index, ..., row, column)
        axes = next((v for k, v in config.items() if "axes" in k and isinstance(v, (list, tuple))), (0, 0, 0))
        side = int(PACKED_TOKENS**0.5)
        grid = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij"), -1)
        lead = torch.zeros(PACKED_TOKENS, max(0, len(axes) - 2))
        out["img_ids"] = torch.cat([lead, grid.reshape(-1, 2).float()], -1)
        if "txt_ids" in params:
            out["txt_ids"] = torch.zeros(TEXT_TOKENS, len(axes))
    if "guidance" in params and config.get("guidance_embeds"):
        out["guidance"] = torch.full((batch,), 3.5)
    if "class_labels" in params and (config.get("num_embeds_ada_norm") or config.get("num_class_embeds")):
        classes = int(config.get("num_class_embeds") or config.get("num_embeds_ada_norm"))
        out["class_labels"] = torch.arange(batch) % max(1, classes)
    return out
