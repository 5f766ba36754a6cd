"""One way to read a field of a model config (a transformers config object or a plain dict)."""

from __future__ import annotations

from typing import Any


def config_field(config: Any, key: str) -> Any:
    """`config[key]` / `config.key`, or None when it is absent, and also when the config refuses to
    give one value for the whole model: transformers' per-layer (heterogeneous) configs raise their
    own error for a global `head_dim` or `num_attention_heads`; such a field is not known globally."""
    if config is None:
        return None
    if isinstance(config, dict):
        return config.get(key)
    try:
        return getattr(config, key, None)
    except Exception:  # noqa: BLE001 - the config's own refusal type varies with the release
        return None


def model_config(model: Any) -> Any:
    """The config a model's sizes are read from: its own `config`, else that of the outermost
    sub-module holding one (a wrapper — an engine's packed-call module, DDP, a user's `nn.Module`
    around an HF model — keeps its config on what it wraps); None when none has one."""
    own = getattr(model, "config", None)
    if own is not None or not hasattr(model, "modules"):
        return own
    return next((m.config for m in model.modules() if getattr(m, "config", None) is not None), None)
