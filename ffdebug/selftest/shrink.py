"""One generic shrinker: a Hugging Face config made tiny enough to build and run on a CPU in seconds.

Every size field a config family spells its own way is scaled down consistently (`SIZES`): hidden
width, heads (query, key/value: MHA stays MHA, MQA stays MQA, GQA keeps a group), explicit head
dims, MLP and expert widths, experts, top-k and expert groups, MLA ranks, linear-attention and SSM
state sizes, vocabulary, positions, image and patch sizes (and a hierarchical vision model's
per-stage depths, widths and heads). Layer counts drop to `layers`; the per-layer type lists
(`layer_types`, `mlp_layer_types`, ...) are shortened with every run of one type cut to at most two
layers, so each type the model mixes is still there (Gemma-3's five sliding layers then one full:
`sliding, sliding, full, sliding`). A window length (`sliding_window`, ...) is set below the test's
sequence length so that it acts. Token ids outside the shrunk vocabulary are clamped into it.
Sub-configs that hold a text model (`text_config`, `decoder`, `encoder`, ...) are shrunk the same way.

The result is validated by building the model (`models.build`), never assumed: a field this table
does not know leaves the model large or inconsistent, and the build says so.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Sizes:
    """The tiny model's sizes. `window` must stay below the sequence length the cases run."""

    hidden: int = 64
    heads: int = 4
    head_dim: int = 16
    intermediate: int = 128
    moe_intermediate: int = 32
    experts: int = 8
    top_k: int = 2
    layers: int = 4
    vocab: int = 512
    positions: int = 128
    window: int = 6
    state: int = 16

    def __post_init__(self) -> None:
        for name in ("hidden", "heads", "head_dim", "intermediate", "layers", "vocab", "positions", "window"):
            if getattr(self, name) < 1:
                raise ValueError(f"Sizes.{name}: must be at least 1")
        if self.hidden % self.heads:
            raise ValueError(f"Sizes.hidden: {self.hidden} is not a multiple of heads ({self.heads})")


# field name -> the Sizes attribute it takes (a callable: computed from the original value and sizes)
def _fixed(attr: str):
    return lambda value, s: getattr(s, attr)


def _kv_heads(value: int, s: Sizes) -> int:
    """MQA (1) stays 1; a grouping keeps two key/value heads (MHA is restored by `_consistent`)."""
    return 1 if value == 1 else 2


def _at_most(attr: str):
    return lambda value, s: min(value, getattr(s, attr))


EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K_FIELDS = ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_k")

SIZES: dict[str, Any] = {
    # widths
    **dict.fromkeys(
        ("hidden_size", "d_model", "n_embd", "model_dim", "embed_dim", "attention_hidden_size"),
        _fixed("hidden"),
    ),
    **dict.fromkeys(
        (
            "num_attention_heads",
            "n_head",
            "n_heads",
            "num_heads",
            "encoder_attention_heads",
            "decoder_attention_heads",
            "swa_num_attention_heads",
            "index_n_heads",
            "linear_num_value_heads",
            "mamba_n_heads",
            "n_mamba_heads",
            "linear_num_heads",
        ),
        _fixed("heads"),
    ),  # fmt: skip
    **dict.fromkeys(
        (
            "num_key_value_heads",
            "num_kv_heads",
            "n_kv_heads",
            "multi_query_group_num",
            "swa_num_key_value_heads",
            "linear_num_key_heads",
        ),
        _kv_heads,
    ),  # fmt: skip
    **dict.fromkeys(
        (
            "head_dim",
            "kv_channels",
            "attention_head_dim",
            "swa_head_dim",
            "dim_head",
            "index_head_dim",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_head_dim",
            "mamba_d_head",
            "v_head_dim",
        ),
        _fixed("head_dim"),
    ),  # fmt: skip
    **dict.fromkeys(
        (
            "intermediate_size",
            "ffn_dim",
            "n_inner",
            "d_ff",
            "ffn_hidden_size",
            "encoder_ffn_dim",
            "decoder_ffn_dim",
            "dim_ff",
            "dff",
        ),
        _fixed("intermediate"),
    ),  # fmt: skip
    **dict.fromkeys(
        (
            "moe_intermediate_size",
            "expert_intermediate_size",
            "shared_expert_intermediate_size",
            "shared_intermediate_size",
        ),
        _fixed("moe_intermediate"),
    ),  # fmt: skip
    # experts and routing
    **dict.fromkeys(EXPERT_COUNTS, _fixed("experts")),
    **dict.fromkeys(TOP_K_FIELDS, _at_most("top_k")),
    "n_group": lambda value, s: min(value, 2),
    "num_expert_group": lambda value, s: min(value, 2),
    "topk_group": lambda value, s: 1,
    "first_k_dense_replace": lambda value, s: min(value, 1),
    # multi-head latent attention, indexers, partial rotary
    "q_lora_rank": lambda value, s: 2 * s.head_dim,
    "kv_lora_rank": _fixed("head_dim"),
    "qk_rope_head_dim": lambda value, s: s.head_dim // 2,
    "qk_nope_head_dim": lambda value, s: s.head_dim // 2,
    "qk_head_dim": _fixed("head_dim"),
    "rotary_dim": lambda value, s: s.head_dim // 2,
    "index_topk": lambda value, s: 4,
    "o_lora_rank": _fixed("head_dim"),
    # state-space and recurrent sizes
    **dict.fromkeys(("mamba_d_state", "state_size", "d_state"), _fixed("state")),
    **dict.fromkeys(("time_step_rank", "mamba_dt_rank"), lambda value, s: 8),
    **dict.fromkeys(("mamba_chunk_size", "chunk_size"), lambda value, s: 16),
    # vocabulary, positions, windows
    "vocab_size": _fixed("vocab"),
    **dict.fromkeys(
        ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "model_max_length"),
        _fixed("positions"),
    ),
    **dict.fromkeys(
        (
            "sliding_window",
            "attention_window",
            "local_window",
            "sliding_window_size",
            "local_attention_window_len",
        ),
        _fixed("window"),
    ),  # fmt: skip
    "max_window_layers": _at_most("layers"),
    # images
    "image_size": lambda value, s: min(value, 32),
    "patch_size": lambda value, s: min(value, 8),
    "window_size": lambda value, s: min(value, 2),  # a windowed vision model's (Swin) window in patches
}
# list fields of hierarchical (vision) models: the stages kept, each stage tiny
LIST_SIZES: dict[str, Any] = {
    "depths": lambda values, s: [1 for _ in values],
    "hidden_sizes": lambda values, s: [16 * 2**i for i in range(len(values))],
    "num_heads": lambda values, s: [min(v, 2) for v in values],
    "embed_dims": lambda values, s: [16 * 2**i for i in range(len(values))],
    "image_size": lambda values, s: [min(v, 32) for v in values],
    "patch_size": lambda values, s: [min(v, 8) for v in values],
}
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers")
LAYER_LISTS = (
    "layer_types",
    "mlp_layer_types",
    "layers_block_type",
    "block_types",
    "attn_layers",
    "attention_layers",
)
TOKEN_IDS = (
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "decoder_start_token_id",
    "sep_token_id",
    "forced_eos_token_id",
)
SUB_CONFIGS = (
    "text_config",
    "decoder",
    "encoder",
    "decoder_config",
    "encoder_config",
    "language_config",
    "llm_config",
)


@dataclass
class Shrunk:
    """The shrunk config and what changed (`field: old -> new`, sub-configs prefixed)."""

    config: Any
    changes: list[str] = field(default_factory=list)


def compress_types(types: list, layers: int) -> list:
    """The first `layers` entries of `types` with every run of one value cut to at most two: each
    kind the model mixes appears, in its order (a list of one kind stays one kind)."""
    runs: list = []
    for value in types:
        if len(runs) >= 2 and runs[-1] == value and runs[-2] == value:
            continue
        runs.append(value)
    while len(runs) < layers:  # a short pattern repeats
        runs.extend(runs[: layers - len(runs)])
    return runs[:layers]


def _get(cfg: Any, name: str) -> Any:
    """`cfg.name`, or None when it is absent or the config refuses to give one global value (a
    per-layer heterogeneous config raises its own error for that)."""
    try:
        return getattr(cfg, name, None)
    except Exception:  # noqa: BLE001 - transformers' per-layer configs raise their own error type
        return None


def _layer_count(cfg: Any) -> int | None:
    return next((_get(cfg, n) for n in LAYER_COUNTS if isinstance(_get(cfg, n), int)), None)


def _shrink_one(cfg: Any, sizes: Sizes, prefix: str, changes: list[str]) -> None:
    original = copy.deepcopy(cfg)

    def put(name: str, value: Any) -> None:
        old = _get(cfg, name)
        if old == value:
            return
        try:
            setattr(cfg, name, value)
        except Exception as e:  # noqa: BLE001 - a config that refuses a field: left as it was, said
            changes.append(f"{prefix}{name}: kept {old!r} (the config refused {value!r}: {type(e).__name__})")
            return
        changes.append(f"{prefix}{name}: {old!r} -> {value!r}")

    for name, rule in SIZES.items():
        value = _get(cfg, name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            put(name, rule(value, sizes))
    experts = any(isinstance(_get(cfg, n), int) and _get(cfg, n) > 1 for n in EXPERT_COUNTS)
    for name in TOP_K_FIELDS:  # a config that leaves its top-k unset (DeepSeek-V2's defaults) routes none
        if experts and hasattr(cfg, name) and _get(cfg, name) is None:
            put(name, sizes.top_k)
    for name, rule in LIST_SIZES.items():
        value = _get(cfg, name)
        if (
            isinstance(value, (list, tuple))
            and value
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        ):
            put(name, type(value)(rule(value, sizes)))
    layers = _layer_count(cfg)
    for name in LAYER_COUNTS:
        value = _get(cfg, name)
        if isinstance(value, int) and not isinstance(value, bool) and value > sizes.layers:
            put(name, sizes.layers)
    for name in LAYER_LISTS:
        value = _get(cfg, name)
        if isinstance(value, list) and value and (layers is None or len(value) == layers):
            put(name, compress_types(value, sizes.layers))
    _consistent(cfg, original, put)
    vocab = _get(cfg, "vocab_size")
    if isinstance(vocab, int):
        for name in TOKEN_IDS:
            value = _get(cfg, name)
            if isinstance(value, int) and value >= vocab:
                put(name, vocab - 1)
            elif isinstance(value, list) and any(isinstance(v, int) and v >= vocab for v in value):
                put(name, [min(v, vocab - 1) for v in value])


def _consistent(cfg: Any, original: Any, put) -> None:
    """The relations between sizes that the per-field rules cannot see, restored."""
    get = lambda name, of=cfg: _get(of, name)  # noqa: E731
    for kv, q in (("num_key_value_heads", "num_attention_heads"), ("num_kv_heads", "num_attention_heads")):
        if isinstance(get(kv), int) and get(kv, original) == get(q, original):  # MHA stays MHA
            put(kv, get(q))
    rope, nope = get("qk_rope_head_dim"), get("qk_nope_head_dim")
    if isinstance(rope, int):  # MLA: the rotary part is what `head_dim` sizes, q/k heads are nope + rope
        if isinstance(get("head_dim"), int):
            put("head_dim", rope)
        if isinstance(nope, int) and isinstance(get("qk_head_dim"), int):
            put("qk_head_dim", nope + rope)
    hidden = get("hidden_size")
    for expand_name, heads_name, dim_name in (
        ("mamba_expand", "mamba_n_heads", "mamba_d_head"),
        ("expand", "num_heads", "head_dim"),
        ("mamba_expand", "n_mamba_heads", "mamba_headdim"),
    ):  # SSM heads x head dim = expand x hidden
        expand, dim = get(expand_name), get(dim_name)
        if (
            isinstance(hidden, int)
            and isinstance(expand, int)
            and isinstance(dim, int)
            and get(heads_name) is not None
        ):
            if dim_name == "mamba_headdim":
                put(dim_name, 16)
                dim = 16
            put(heads_name, max(1, expand * hidden // dim))
    if (
        isinstance(get("mamba_d_ssm"), int)
        and isinstance(get("mamba_n_heads"), int)
        and isinstance(get("mamba_d_head"), int)
    ):
        put("mamba_d_ssm", get("mamba_n_heads") * get("mamba_d_head"))
    _one_attention_layer(cfg, get, put)
    layers = _layer_count(cfg)
    if isinstance(get("attn_layer_period"), int) and isinstance(
        layers, int
    ):  # an attention layer among the few
        period = min(get("attn_layer_period"), 2)
        put("attn_layer_period", period)
        if isinstance(get("attn_layer_offset"), int):
            put("attn_layer_offset", min(get("attn_layer_offset"), period - 1))


def _one_attention_layer(cfg: Any, get, put) -> None:
    """A hybrid whose default config has no attention layer (transformers' `layer_types` all
    `linear_attention`, or `attn_layer_indices` unset: Bamba, GraniteMoeHybrid) gets one at layer
    1, so the shrunk model mixes both kinds (an all-linear model's forward fails in transformers'
    cache)."""
    if hasattr(cfg, "attn_layer_indices") and get("attn_layer_indices") is None:
        put("attn_layer_indices", [1])
    for name in ("layer_types", "layers_block_type"):
        kinds = get(name)
        if isinstance(kinds, list) and len(kinds) > 1 and set(kinds) == {"linear_attention"}:
            put(name, [kinds[0], "full_attention", *kinds[2:]])
            return


def shrink(config: Any, sizes: Sizes | None = None) -> Shrunk:
    """A tiny copy of `config` (the original is left as it was); see the module docstring."""
    sizes = sizes or Sizes()
    cfg = copy.deepcopy(config)
    changes: list[str] = []
    _shrink_one(cfg, sizes, "", changes)
    for name in SUB_CONFIGS:
        sub = _get(cfg, name)
        if sub is not None and hasattr(sub, "to_dict"):
            _shrink_one(sub, sizes, f"{name}.", changes)
    return Shrunk(cfg, changes)
