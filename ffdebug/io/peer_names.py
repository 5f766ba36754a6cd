"""Peer stage names -> canonical stage keys (docs/peer-dumps.md "Peer dumps", the table there is this one).

ATOM and SGLang name their stages in their own words; ffdebug pairs stages by canonical keys
(`L{layer:03d}.hidden_out`, `final.logits`, ...). `canonical_key(name, layer)` maps a peer name
through `STAGE_NAMES` (block-level stages, used with the layer) and `GLOBAL_NAMES` (stages outside
blocks); a name in neither stays a free tap: `L{layer:03d}.{name}` when the peer gave a layer,
else the name itself, so the peer's spelling survives and the other side can still pair it.
"""

from __future__ import annotations

import re

# Block-level stage names of the peers (ATOM's `layer{L}.{stage}` protocol and ref_patch
# stages, SGLang dumper names commonly used with `layer_id`) -> canonical stage.
STAGE_NAMES: dict[str, str] = {
    "hidden_in": "hidden_in",
    "layer_input": "hidden_in",
    "layer_start__hidden_states": "hidden_in",
    "hidden_out": "hidden_out",
    "layer_output": "hidden_out",
    "attn_norm_out": "attn_norm_out",
    "input_layernorm_output": "attn_norm_out",
    "attn_out": "attn_out",
    "attn_output": "attn_out",
    "self_attn_output": "attn_out",
    "ffn_norm_out": "ffn_norm_out",
    "post_attention_layernorm_output": "ffn_norm_out",
    "ffn_out": "ffn_out",
    "mlp_output": "ffn_out",
    "moe_output": "ffn_out",
    "ffn_output": "ffn_out",
}

# Stages outside the blocks.
GLOBAL_NAMES: dict[str, str] = {
    "embed.input_ids": "embed.input_ids",
    "input_ids": "embed.input_ids",
    "embed.out": "embed.out",
    "embed.final_h": "final.norm_out",
    "embed.final_logits": "final.logits",
    "final_hidden_states": "final.norm_out",
    "logits": "final.logits",
}

# SGLang's non-intrusive hooks: `non_intrusive__{module path}.{output | inputs.N | inputs.NAME}`.
_NON_INTRUSIVE = re.compile(
    r"^non_intrusive__(?P<path>.*?)\.(?P<io>output|inputs\.\w+)(?P<field>(?:\.\w+)?)$"
)
_LAYER_PATH = re.compile(r"^(?:.+\.)?layers\.(?P<layer>\d+)(?:\.(?P<rest>.+))?$")
_GLOBAL_MODULES = {"embed_tokens": "embed.out", "norm": "final.norm_out", "lm_head": "final.logits"}


def canonical_key(name: str, layer: int | None) -> str:
    """The canonical key of a peer stage `name` (`layer`: the peer's layer tag, or None)."""
    if layer is None and name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    m = _NON_INTRUSIVE.match(name)
    if m:
        return _non_intrusive_key(m, layer)
    if layer is None:
        return name
    return f"L{layer:03d}.{STAGE_NAMES.get(name, name)}"


def _non_intrusive_key(m: re.Match, layer: int | None) -> str:
    path, io, field = m.group("path"), m.group("io"), m.group("field")
    suffix = (
        "out" if io == "output" else "in" + ("" if io in ("inputs.0", "inputs.hidden_states") else io[6:])
    )
    lm = _LAYER_PATH.match(path)
    if lm:
        layer = int(lm.group("layer")) if layer is None else layer
        rest = lm.group("rest")
        if rest is None and suffix in ("out", "in"):
            return f"L{layer:03d}.hidden_{suffix}{field}"
        return f"L{layer:03d}.{rest + '.' if rest else ''}{suffix}{field}"
    last = path.rsplit(".", 1)[-1]
    if last in _GLOBAL_MODULES and suffix == "out" and not field:
        return _GLOBAL_MODULES[last]
    return f"{path}.{suffix}{field}" if path else f"{suffix}{field}"
