"""The schema of a planned weights diff: names only on one side, shape and dtype differences,
the names compared, buffers only a weight dump holds, and rename suggestions."""

from __future__ import annotations

from dataclasses import dataclass, field

from ffdebug.weights.schema import suggest_renames
from ffdebug.weights.sources import WeightSource
from ffdebug.weights.tp import Logical

# Buffers models register with persistent=False: in a weight dump (named_buffers), never in a
# checkpoint or a state_dict(). Used when the dump record does not say `persistent` itself.
NON_PERSISTENT_BUFFERS = frozenset(
    {
        "inv_freq",
        "original_inv_freq",
        "cos_cached",
        "sin_cached",
        "_cos_cached",
        "_sin_cached",
        "cos_sin_cache",
        "position_ids",
    }
)


def non_persistent(t: Logical) -> bool:
    """A buffer a checkpoint never holds (its records say so, or its leaf name is a known one)."""
    flags = {e.persistent for e in t.entries}
    if flags == {False}:
        return True
    return None in flags and t.source_name.rsplit(".", 1)[-1] in NON_PERSISTENT_BUFFERS


def shape_after(transforms, side: str, name: str, shape: tuple) -> tuple | None:
    """The shape after the built-in `transpose` transforms; None when a Python transform applies
    (its output shape is known only once it ran)."""
    from ffdebug.weights.transforms import transpose

    for tr in transforms:
        if tr.side == side and tr.matches(name):
            if tr.fn is not transpose or len(shape) < 2:
                return None
            shape = tuple(shape[:-2]) + (shape[-1], shape[-2])
    return tuple(shape)


@dataclass
class Schema:
    """The JSON schema lists of a diff (docs/weights-diff.md "Weights first") and the names compared."""

    only_ref: list[str] = field(default_factory=list)
    only_target: list[str] = field(default_factory=list)
    common: list[str] = field(default_factory=list)  # in reference order
    shape_mismatch: list[dict] = field(default_factory=list)
    dtype_mismatch: list[dict] = field(default_factory=list)
    buffers_not_in_checkpoint: list[dict] = field(default_factory=list)
    renames: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _dump_buffers(schema: Schema, ref: dict, tgt: dict, ref_src: WeightSource, tgt_src: WeightSource) -> None:
    """Non-persistent buffers only a weight dump holds leave the only-in lists."""
    for side, src, other, only, mine in (
        ("ref", ref_src, tgt_src, schema.only_ref, ref),
        ("target", tgt_src, ref_src, schema.only_target, tgt),
    ):
        if src.kind != "weight-dump" or other.kind == "weight-dump":
            continue
        for n in [n for n in only if non_persistent(mine[n])]:
            only.remove(n)
            schema.buffers_not_in_checkpoint.append({"name": n, "side": side})


def schema_of(ref: dict, tgt: dict, ref_src, tgt_src, transforms=(), dequantized=()) -> Schema:
    """The schema of two logical tensor maps (`dequantized`: the JSON items of the scale step)."""
    schema = Schema(
        only_ref=[n for n in ref if n not in tgt],
        only_target=[n for n in tgt if n not in ref],
        common=[n for n in ref if n in tgt],
    )
    _dump_buffers(schema, ref, tgt, ref_src, tgt_src)
    cast = {d["name"] for d in dequantized}
    for n in schema.common:
        r, t = ref[n], tgt[n]
        after = (shape_after(transforms, "ref", n, r.shape), shape_after(transforms, "target", n, t.shape))
        if r.shape != t.shape and after[0] is not None and after[0] == after[1]:
            schema.notes.append(f"{n}: shapes {list(r.shape)} vs {list(t.shape)} agree after --transform")
        elif r.shape != t.shape:
            item = {"name": n, "shape_ref": list(r.shape), "shape_target": list(t.shape)}
            if len(r.shape) == 2 and t.shape == r.shape[::-1]:
                item["note"] = "transposed shape"
            if t.note or r.note:
                item["note"] = t.note or r.note
            schema.shape_mismatch.append(item)
        if r.dtype != t.dtype:
            item = {"name": n, "dtype_ref": r.dtype, "dtype_target": t.dtype}
            if r.scale is not None or t.scale is not None or n in cast:
                item["dequantized"] = True
            schema.dtype_mismatch.append(item)
    if schema.only_ref and schema.only_target:
        schema.renames = suggest_renames(
            {n: ref[n].shape for n in schema.only_ref},
            {n: tgt[n].shape for n in schema.only_target},
        )
    return schema
