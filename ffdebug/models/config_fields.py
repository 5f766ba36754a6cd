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
