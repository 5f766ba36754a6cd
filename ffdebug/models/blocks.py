"""Find the repeated blocks of a model, give each a layer index and a layer class (docs/dumping.md "Dumping your own runs").

Layer index: the block's own index attribute (`layer_id`, `layer_idx`, `layer_number`, as
configured) when it is an int, else its position across all block lists in registration order
(Flux: double-stream blocks 0..N-1, then single-stream blocks N..).

Layer class: from the HF config where it says so (`layer_types`, `first_k_dense_replace`,
`mlp_only_layers`, `decoder_sparse_step`), else a signature of the block class and those direct
children whose class differs between blocks (`Qwen3MoeDecoderLayer[mlp=Qwen3MoeSparseMoeBlock]`),
or as declared by hand (`"hash:0-2,routed:3-"`).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from ffdebug.errors import FFDebugError
from ffdebug.models.config_fields import config_field, model_config


@dataclass
class BlockInfo:
    module: object
    path: str  # module path from the root, e.g. "model.layers.3"
    layer: int
    layer_class: str
    class_name: str


def _class_matches(module, globs: tuple[str, ...]) -> bool:
    name = type(module).__name__
    return any(fnmatch.fnmatchcase(name, g) for g in globs)


def _looks_like_block_class(name: str) -> bool:
    return any(tok in name for tok in ("Block", "Layer", "Decoder", "Encoder"))


def find_block_modules(model, class_globs: tuple[str, ...] = ()) -> list[tuple[str, object]]:
    """(path, module) of every block, in registration order.

    With `class_globs`, blocks are the outermost modules whose class matches one of the globs (the
    first glob that matches anything names the block class). Without, they are the members of the
    outermost `ModuleList`s whose members all share one class.
    """
    import torch.nn as nn

    found: list[tuple[str, object]] = []
    if class_globs:
        for glob in class_globs:
            found = _outermost(model, lambda m, g=glob: _class_matches(m, (g,)))
            if found:
                return found
        return []

    def is_block_list(child) -> bool:
        if not isinstance(child, nn.ModuleList) or len(child) == 0:
            return False
        names = {type(m).__name__ for m in child}
        if len(names) == 1:
            return len(child) >= 2 or _looks_like_block_class(next(iter(names)))
        # mixed classes (UNet down / up blocks, hybrid stacks): blocks when every member says so
        return all(_looks_like_block_class(n) for n in names)

    def walk(prefix: str, module) -> None:
        lists = {name for name, child in module.named_children() if is_block_list(child)}
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if name in lists:
                found.extend((f"{path}.{i}", m) for i, m in enumerate(child))
            elif lists and _lone_block(child):  # a UNet's mid block, beside its down / up lists
                found.append((path, child))
            else:
                walk(path, child)

    walk("", model)
    return found


def _lone_block(module) -> bool:
    """A single block beside block lists: a `*Block*` class with parameters that is no norm."""
    from ffdebug.models.roles import is_norm_type

    name = type(module).__name__
    return "Block" in name and not is_norm_type(module) and any(True for _ in module.parameters())


def _outermost(model, predicate) -> list[tuple[str, object]]:
    found: list[tuple[str, object]] = []

    def walk(prefix: str, module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if predicate(child):
                found.append((path, child))
            else:
                walk(path, child)

    walk("", model)
    return found


def parse_layer_class_spec(spec: str) -> list[tuple[str, int, int | None]]:
    """`"hash:0-2,routed:3-"` -> [("hash", 0, 2), ("routed", 3, None)]."""
    out = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        if ":" not in part:
            raise FFDebugError(
                f"--layer-class {spec!r}: {part!r} lacks 'NAME:'; use e.g. 'hash:0-2,routed:3-'"
            )
        name, rng = part.split(":", 1)
        rng = rng.strip()
        try:
            if rng.endswith("-"):
                out.append((name.strip(), int(rng[:-1]), None))
            elif "-" in rng:
                lo, hi = rng.split("-", 1)
                out.append((name.strip(), int(lo), int(hi)))
            else:
                out.append((name.strip(), int(rng), int(rng)))
        except ValueError:
            raise FFDebugError(
                f"--layer-class {spec!r}: cannot read range {rng!r}; use 'A-B', 'A-' or 'A'"
            ) from None
    return out


def declared_class(spec: list[tuple[str, int, int | None]], layer: int) -> str | None:
    for name, lo, hi in spec:
        if layer >= lo and (hi is None or layer <= hi):
            return name
    return None


def config_layer_classes(config, num_layers: int) -> list[str] | None:
    """Layer classes the HF config declares, or None when it declares none.

    Attention kind from `layer_types` (sliding / full / linear attention), `layers_block_type`
    (Jamba, Zamba: mamba / attention), `attn_layer_indices` (Bamba-style hybrid lists: the listed
    layers are attention, the rest mamba) or `attn_type_list` (MiniMax: 0 linear, 1 full); MLP kind
    from `first_k_dense_replace`, `mlp_only_layers`, `decoder_sparse_step` (dense / moe). When both
    kinds vary across layers the label joins them: `full_attention+moe`.
    """
    if config is None:
        return None

    def get(k):
        return config_field(config, k)

    attn = _attention_kinds(get, num_layers)
    mlp = _mlp_kinds(get, num_layers)
    if attn and mlp and len(set(attn)) > 1 and len(set(mlp)) > 1:
        return [f"{a}+{m}" for a, m in zip(attn, mlp)]
    if attn and len(set(attn)) > 1:
        return attn
    return mlp or attn


def _attention_kinds(get, num_layers: int) -> list[str] | None:
    for name in ("layer_types", "layers_block_type"):
        types = get(name)
        if isinstance(types, (list, tuple)) and len(types) == num_layers:
            return [str(t) for t in types]
    idx = get("attn_layer_indices")
    if isinstance(idx, (list, tuple)) and idx:
        return ["attention" if i in idx else "mamba" for i in range(num_layers)]
    kinds = get("attn_type_list")
    if isinstance(kinds, (list, tuple)) and len(kinds) == num_layers:
        return ["full_attention" if int(k) == 1 else "linear_attention" for k in kinds]
    return None


def _mlp_kinds(get, num_layers: int) -> list[str] | None:
    k = get("first_k_dense_replace")
    if isinstance(k, int) and not isinstance(k, bool) and 0 < k < num_layers:
        return ["dense" if i < k else "moe" for i in range(num_layers)]
    mlp_only = get("mlp_only_layers")
    step = get("decoder_sparse_step")
    experts = get("num_experts") or get("n_routed_experts") or get("num_local_experts")
    if isinstance(mlp_only, (list, tuple)) and mlp_only:
        return ["dense" if i in mlp_only else "moe" for i in range(num_layers)]
    if isinstance(step, int) and step > 1 and experts:
        return ["moe" if (i + 1) % step == 0 else "dense" for i in range(num_layers)]
    return None


def structural_classes(modules: list[object]) -> list[str]:
    """Signature of block class + direct children whose class differs between blocks of that class."""
    by_cls: dict[str, list[int]] = {}
    for i, m in enumerate(modules):
        by_cls.setdefault(type(m).__name__, []).append(i)
    labels = [type(m).__name__ for m in modules]
    for cls_name, idxs in by_cls.items():
        child_classes: dict[str, set[str]] = {}
        for i in idxs:
            for name, child in modules[i].named_children():
                child_classes.setdefault(name, set()).add(type(child).__name__)
        varying = sorted(n for n, s in child_classes.items() if len(s) > 1)
        if not varying:
            continue
        for i in idxs:
            children = dict(modules[i].named_children())
            sig = ",".join(
                f"{n}={type(children[n]).__name__}" if n in children else f"{n}=None" for n in varying
            )
            labels[i] = f"{cls_name}[{sig}]"
    return labels


def stack_labels(paths: list[str], labels: list[str]) -> list[str]:
    """A label held by blocks of two stacks (T5's encoder and decoder `T5Block`s) gets the stack's
    name in front, the first path component where their lists differ: `encoder.T5Block`."""
    lists: dict[str, set[str]] = {}
    for path, label in zip(paths, labels):
        lists.setdefault(label, set()).add(path.rsplit(".", 1)[0] if "." in path else "")
    out = []
    for path, label in zip(paths, labels):
        parts = sorted(lists[label])
        if len(parts) < 2:
            out.append(label)
            continue
        split = [p.split(".") for p in parts]
        depth = next((i for i in range(min(map(len, split))) if len({s[i] for s in split}) > 1), 0)
        out.append(f"{path.split('.')[depth]}.{label}")
    return out


def index_attribute(module, layer_attrs: tuple[str, ...]) -> int | None:
    """The first of `layer_attrs` that the module holds as an int (its own layer index), else None."""
    for attr in layer_attrs:
        value = getattr(module, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def find_blocks(
    model,
    class_globs: tuple[str, ...] = (),
    layer_attrs: tuple[str, ...] = ("layer_id", "layer_idx", "layer_number"),
    declared: str | None = None,
) -> list[BlockInfo]:
    """Blocks with their layer index and layer class."""
    mods = find_block_modules(model, class_globs)
    if not mods:
        return []
    layers = []
    for pos, (_, m) in enumerate(mods):
        idx = index_attribute(m, layer_attrs)
        layers.append(pos if idx is None else idx)
    if len(set(layers)) != len(layers):  # attributes that repeat (per-list counters): use position
        layers = list(range(len(mods)))
    classes = config_layer_classes(model_config(model), len(mods))
    if classes is None:
        classes = stack_labels([p for p, _ in mods], structural_classes([m for _, m in mods]))
    if declared:
        spec = parse_layer_class_spec(declared)
        classes = [declared_class(spec, layer) or c for layer, c in zip(layers, classes)]
    return [
        BlockInfo(module=m, path=p, layer=layer, layer_class=c, class_name=type(m).__name__)
        for (p, m), layer, c in zip(mods, layers, classes)
    ]


# Direct children of a block that carry canonical stage names (HF decoder layers, diffusers blocks).
CANONICAL_CHILDREN = {
    "input_layernorm": "attn_norm_out",
    "ln_1": "attn_norm_out",
    "attention_norm": "attn_norm_out",
    "self_attn": "attn_out",
    "self_attention": "attn_out",
    "attention": "attn_out",
    "attn": "attn_out",
    "post_attention_layernorm": "ffn_norm_out",
    "ln_2": "ffn_norm_out",
    "ffn_norm": "ffn_norm_out",
    "mlp": "ffn_out",
    "ffn": "ffn_out",
    "ff": "ffn_out",
    "feed_forward": "ffn_out",
    "block_sparse_moe": "ffn_out",
}


def find_named_child(model, names: tuple[str, ...], exclude: set[int]):
    """First module (outside `exclude` ids) whose last path component is one of `names`."""
    for path, m in model.named_modules():
        if id(m) in exclude:
            continue
        if path.rsplit(".", 1)[-1] in names:
            return path, m
    return None, None


# The canonical block-level stages of a layer (capture's keys `L{NNN}.<stage>`), beside
# `hidden_in` / `hidden_out`: what a layer's sub-stages feed.
BLOCK_STAGES = (
    "attn_norm_out",
    "attn_out",
    "ffn_norm_out",
    "ffn_out",
    "branch_norm_out",
    "branch_out",
    "encoder_hidden_in",
)


def is_block_stage(stage: str) -> bool:
    """Canonical block-level stage (not a finer sub-stage dump)."""
    return stage in BLOCK_STAGES or stage.startswith("hidden_out")
