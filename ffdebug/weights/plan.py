"""The planning steps of a weights diff, before any tensor is read: each takes the tensors of a
side by name and returns the new map (docs/weights-diff.md).

    group (names mapped)  ->  filter (--skip, --layers)  ->  restrict_to_dump
      ->  split_ranks (rank r with rank r)  ->  logicals (TP pieces merged)
      ->  stack / fuse / scales / content (`weights.layout`)  ->  schema (`weights.schema_diff`)

The layer count (for negative `--layers` and dump selections) is counted once, over both sides,
before anything is left out (`layer_count`)."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from ffdebug.errors import FFDebugError
from ffdebug.io.record import Record
from ffdebug.weights.names import NameMap
from ffdebug.weights.sources import WeightSource
from ffdebug.weights.tp import Logical, plan_merge

Groups = dict[str, list[Record]]  # mapped name -> its pieces (one per rank), in file order


def group(src: WeightSource, name_map: NameMap, side: str) -> Groups:
    """Entries by mapped name (insertion = file order); two names mapped onto one is an error."""
    groups: Groups = {}
    origin: dict[tuple[str, int], str] = {}
    for e in src.entries:
        name = name_map.apply(e.key)
        key = (name, e.rank)
        if key in origin and origin[key] != e.key:
            raise FFDebugError(
                f"{src.path}: {side} tensors {origin[key]} and {e.key} both map to {name}; "
                "narrow --strip-prefix / --map"
            )
        origin[key] = e.key
        groups.setdefault(name, []).append(e)
    return groups


def layer_count(*sides: Groups) -> int | None:
    """The number of blocks (highest layer index + 1) over all sides; None when no tensor has one."""
    known = [e[0].layer for groups in sides for e in groups.values() if e[0].layer is not None]
    return max(known) + 1 if known else None


def filter_groups(groups: Groups, skip: tuple, layers, num_layers: int | None) -> tuple[Groups, list[str]]:
    """(kept, names --skip left out); --layers keeps tensors outside blocks."""
    if not skip and layers.all:
        return groups, []
    kept, skipped = {}, []
    for name, entries in groups.items():
        src = entries[0].key
        if any(fnmatch.fnmatchcase(name, g) or fnmatch.fnmatchcase(src, g) for g in skip):
            skipped.append(name)
            continue
        layer = entries[0].layer
        if layer is not None and not layers.contains(layer, num_layers):
            continue
        kept[name] = entries
    return kept, skipped


@dataclass(frozen=True)
class Restricted:
    """What `restrict_to_dump` kept, the `restricted` item it reports and a note."""

    groups: Groups
    restricted: dict | None = None
    note: str | None = None


def restrict_to_dump(groups: Groups, side: str, dump: WeightSource, num_layers: int | None) -> Restricted:
    """When the other side is a weight dump written with FFDEBUG_WEIGHT_DUMP_LAYERS, leave out
    this side's tensors of layers the dump did not select (it cannot hold them); tensors
    outside blocks are kept, unless the dump holds block tensors only (ATOM's, which also
    skips `never_dumped` names such as experts). Said in `restricted` and a note."""
    from ffdebug._env import parse_layers

    if dump.kind != "weight-dump" or not dump.layer_spec:
        return Restricted(groups)
    try:
        selection = parse_layers(dump.layer_spec, "FFDEBUG_WEIGHT_DUMP_LAYERS")
    except FFDebugError:
        note = f"{dump.path}: run.json FFDEBUG_WEIGHT_DUMP_LAYERS={dump.layer_spec!r} unreadable"
        return Restricted(groups, note=note)
    kept, left_out = {}, 0
    for name, entries in groups.items():
        layer = entries[0].layer
        skipped = any(part in name for part in dump.never_dumped)
        if skipped or (layer is None and dump.layers_only):  # ATOM: `layers.{L}.` only, no experts
            left_out += 1
            continue
        if layer is not None and not selection.contains(layer, num_layers):
            left_out += 1
            continue
        kept[name] = entries
    if not left_out:
        return Restricted(kept)
    layers = sorted({e[0].layer for e in kept.values() if e[0].layer is not None})
    item = {"side": side, "layers": layers, "left_out": left_out, "because": dump.layer_spec}
    return Restricted(kept, restricted=item)


def split_ranks(groups: Groups) -> Groups:
    """Each rank's piece under `name@rankR` (both sides per-rank with the same world size)."""
    out = {}
    for name, entries in groups.items():
        if len(entries) == 1:
            out[name] = entries
            continue
        for e in entries:
            out[f"{name}@rank{e.rank}"] = [e]
    return out


def logicals(mine: Groups, other: Groups, tp_merge) -> tuple[dict[str, Logical], list[str]]:
    """(one `Logical` per name, notes): the pieces of a name merged by `tp.plan_merge`, against
    the other side's shape where it has a single piece."""
    out, notes = {}, []
    for name, pieces in mine.items():
        counterpart = other.get(name)
        other_shape = tuple(counterpart[0].shape) if counterpart and len(counterpart) == 1 else None
        fold, shape, note = plan_merge(pieces, other_shape, tp_merge)
        first = pieces[0]
        out[name] = Logical(
            name=name,
            source_name=first.key,
            entries=sorted(pieces, key=lambda e: e.rank),
            shape=tuple(shape),
            dtype=first.dtype,
            fold=fold,
            layer=first.layer,
            note=note,
        )
        if note:
            notes.append(f"{name}: {note}")
    return out, notes
