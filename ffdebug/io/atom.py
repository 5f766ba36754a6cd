"""ATOM `debug_helper` dumps, read as they are (docs/peer-dumps.md "Peer dumps").

ATOM (`atom/utils/debug_helper/`, ROCm/ATOM main) writes, in one directory:

- hook files `layer{LL}_{Class}_rank{R}.pt` (`ATOM_FWD_DUMP_ONE_SHOT=1`: the first call only) or
  `..._rank{R}_call{NNN}.pt` (every call), holding `{hidden, shape, input, input_fields,
  output_fields}` (older versions: `{hidden, shape}`; `ATOM_FWD_DUMP_STATS_ONLY`: statistics);
- reference files from `ref_patch` in the same directory, `{prefix}_layer{LL}_{Class}__{stage}_rank{R}.pt`
  (`{hidden, shape}`; layer 99 means "unknown layer");
- weight dumps `weight_rank{R}_layer{L}.pt`: parameters by name, buffers as `buffer:NAME`, and
  `_tp_rank`, `_tp_size`, `_layer`;
- hand-assembled `{side}_rank{R}_fwd.pt` dicts keyed `embed.input_ids`, `layer{L}.{stage}`, ...

Sides: files with a prefix are that side (`ref_...` -> `ref`; `atom_...` is ATOM's own model, so
`target`); hook files are `target`. A directory holding two sides is read one side at a time
(`read_side`), which `compare ref-vs-target --dir D` does.

Keys: the block class's hook files give `L{LLL}.hidden_out` (`hidden`) and `L{LLL}.hidden_in`
(`input`), their fields `L{LLL}.hidden_out.{field}` / `.hidden_in.{field}`; other hooked classes
(sub-stages) give `L{LLL}.{Class}.out` / `.in`. The block class is the one the reference dumped
`hidden_in` / `hidden_out` for, else the only hooked class, else a class named `*Block` /
`*DecoderLayer` / `*Layer`. Stage names go through `ffdebug.io.peer_names`. When untagged calls
differ in row count, calls whose row counts are all powers of two while others' are not are
ATOM's warm-up (its own `pick_prefill_call` rule) and marked `warmup_guess`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass

from ffdebug.errors import FFDebugError
from ffdebug.io.checkpoints import dtype_name
from ffdebug.io.peer_names import STAGE_NAMES, canonical_key
from ffdebug.io.record import Record
from ffdebug.io.side import SideStore
from ffdebug.io.sources import InMemory
from ffdebug.io.torchfile import Refused, load_or_refused

HOOK = re.compile(
    r"^layer(?P<layer>\d+)_(?P<cls>[A-Za-z0-9_]+?)_rank(?P<rank>\d+)(?:_call(?P<call>\d+))?\.pt$"
)
PATCHED = re.compile(
    r"^(?P<side>[A-Za-z0-9]+)_layer(?P<layer>\d+)_(?:(?P<cls>[A-Za-z0-9_]+?)__)?(?P<stage>\w+?)_rank(?P<rank>\d+)\.pt$"
)
WEIGHTS = re.compile(r"^weight_rank(?P<rank>\d+)_layer(?P<layer>\d+)\.pt$")
FWD = re.compile(r"^(?P<side>[A-Za-z0-9]+)_rank(?P<rank>\d+)_fwd\.pt$")
_BLOCK_NAME = re.compile(r"(Block|DecoderLayer|Layer)$")
_FWD_LAYER = re.compile(r"^layer(?P<layer>\d+)\.(?P<stage>.+)$")
UNKNOWN_LAYER = 99  # ref_patch.patch_module_dump's "unknown layer"
_STATS = ("mean", "std", "min", "max")


@dataclass(frozen=True)
class AtomFile:
    path: str
    kind: str  # hook | patched | weights | fwd
    side: str
    rank: int
    layer: int | None = None
    cls: str | None = None
    stage: str | None = None
    call: int | None = None


def _side_label(prefix: str) -> str:
    return "target" if prefix == "atom" else prefix


def classify(name: str, path: str) -> AtomFile | None:
    m = HOOK.match(name)
    if m:
        call = int(m.group("call")) if m.group("call") else 0
        return AtomFile(
            path, "hook", "target", int(m.group("rank")), int(m.group("layer")), m.group("cls"), call=call
        )
    m = WEIGHTS.match(name)
    if m:
        return AtomFile(path, "weights", "weights", int(m.group("rank")), int(m.group("layer")))
    m = FWD.match(name)
    if m:
        return AtomFile(path, "fwd", _side_label(m.group("side")), int(m.group("rank")))
    m = PATCHED.match(name)
    if m:
        layer = int(m.group("layer"))
        return AtomFile(
            path,
            "patched",
            _side_label(m.group("side")),
            int(m.group("rank")),
            None if layer == UNKNOWN_LAYER else layer,
            m.group("cls"),
            m.group("stage"),
        )
    return None


def atom_files(path: str) -> list[AtomFile]:
    """The ATOM files of a directory; none when any `.pt` file there is not named as ATOM names
    them (such a folder of tensors is read by the generic `.pt` importer, one side)."""
    if not os.path.isdir(path):
        return []
    out = [classify(n, os.path.join(path, n)) for n in sorted(os.listdir(path)) if n.endswith(".pt")]
    return out if all(f is not None for f in out) else []


def sides(path: str) -> list[str]:
    return sorted({f.side for f in atom_files(path)})


def detect(path: str) -> bool:
    return bool(atom_files(path))


def read(path: str) -> SideStore:
    found = sides(path)
    if len(found) > 1:
        raise FFDebugError(
            f"{path}: ATOM directory holding sides {', '.join(found)}; pass one side "
            f"(e.g. {os.path.join(path, found[0])}) or use 'compare {found[0]}-vs-{found[-1]} --dir {path}'"
        )
    return read_side(path, found[0])


def read_side(path: str, side: str) -> SideStore:
    files = atom_files(path)
    mine = [f for f in files if f.side == side]
    if not mine:
        raise FFDebugError(
            f"{path}: no ATOM files of side {side!r} (sides present: {', '.join(sides(path))})"
        )
    blocks = _block_classes(files)
    records: list[Record] = []
    problems: list[str] = []
    for f in sorted(mine, key=lambda f: (f.rank, f.call or 0, f.layer if f.layer is not None else -1)):
        obj = load_or_refused(f.path)
        if isinstance(obj, Refused):
            problems.append(obj.sentence())
            continue
        for key, value, extra in _entries(f, obj, blocks):
            rec = _record(f, key, value, extra, len(records))
            if f.kind == "weights":  # the file's own TP coordinates
                tp = obj.get("_tp_size")
                rec = dataclasses.replace(
                    rec,
                    rank=int(obj.get("_tp_rank", f.rank)),
                    world_size=int(tp) if isinstance(tp, int) else None,
                )
            records.append(rec)
    kind = "atom-weights" if side == "weights" else "atom"
    run = {"side": side, "format": kind}
    if side == "weights":
        run["layers"] = sorted({f.layer for f in mine})
    if side != "weights":
        records = [dataclasses.replace(r, seq=i) for i, r in enumerate(sorted(records, key=_execution_order))]
    records = _mark_warmup(records)
    return SideStore(path=os.path.join(path, side), records=records, run=run, kind=kind, problems=problems)


def _execution_order(r: Record) -> tuple:
    """ATOM's file names do not give the order within a layer: the block input first, sub-stages,
    the block output last; input ids and embeddings before the layers, final stages after."""
    if r.layer is not None:
        within = 0 if ".hidden_in" in r.key or r.key.endswith(".in") else (2 if ".hidden_out" in r.key else 1)
        place = (1, r.layer, within)
    else:
        place = (
            (0, 0, 0)
            if r.key.startswith("embed.")
            else ((2, 0, 0) if r.key.startswith("final.") else (3, 0, 0))
        )
    return (r.rank, r.call if r.call is not None else -1, *place, r.seq)


def _block_classes(files: list[AtomFile]) -> set[str]:
    named = {f.cls for f in files if f.kind == "patched" and f.cls and f.stage in ("hidden_in", "hidden_out")}
    hooked = {f.cls for f in files if f.kind == "hook"}
    if named & hooked:
        return named
    if len(hooked) == 1:
        return hooked
    return {c for c in hooked if _BLOCK_NAME.search(c)} | named


def _entries(f: AtomFile, obj, blocks: set[str]):
    """(key, tensor or stats dict, extra) of one file."""
    import torch

    if isinstance(obj, torch.Tensor) and f.kind in ("hook", "patched"):
        obj = {"hidden": obj}  # a bare tensor saved by hand under ATOM's name
    if not isinstance(obj, dict):
        raise FFDebugError(f"{f.path}: an ATOM dump holds a dict, got {type(obj).__name__}")
    if f.kind == "weights":
        for name, t in obj.items():
            if isinstance(t, torch.Tensor):
                buffer = name.startswith("buffer:")
                yield name[len("buffer:") :] if buffer else name, t, {"buffer": True} if buffer else {}
        return
    if f.kind == "fwd":
        for name, t in obj.items():
            if isinstance(t, torch.Tensor):
                m = _FWD_LAYER.match(name)
                key = (
                    canonical_key(m.group("stage"), int(m.group("layer"))) if m else canonical_key(name, None)
                )
                yield key, t, {"atom_name": name}
        return
    if f.kind == "patched":
        stage = f.stage or "out"
        if f.cls and f.cls not in blocks and stage not in STAGE_NAMES:
            stage = f"{f.cls}.{stage}"
        yield _keyed(f.layer, stage), _payload(f, obj), {}
        return
    head = "hidden" if f.cls in blocks else f"{f.cls}."
    out_key, in_key = (f"{head}_out", f"{head}_in") if f.cls in blocks else (f"{head}out", f"{head}in")
    yield _keyed(f.layer, out_key), _payload(f, obj), {}
    if isinstance(obj.get("input"), torch.Tensor):
        yield _keyed(f.layer, in_key), obj["input"], {}
    for group, base in (("output_fields", out_key), ("input_fields", in_key)):
        for field, t in (obj.get(group) or {}).items():
            if isinstance(t, torch.Tensor):
                yield _keyed(f.layer, f"{base}.{field}"), t, {}


def _keyed(layer: int | None, stage: str) -> str:
    return canonical_key(stage, layer) if layer is not None else stage


def _payload(f: AtomFile, obj: dict):
    import torch

    if isinstance(obj.get("hidden"), torch.Tensor):
        return obj["hidden"]
    if all(isinstance(obj.get(k), (int, float)) for k in _STATS):  # ATOM_FWD_DUMP_STATS_ONLY
        return obj
    raise FFDebugError(f"{f.path}: no 'hidden' tensor and no statistics; not an ATOM forward dump")


def _record(f: AtomFile, key: str, value, extra: dict, seq: int) -> Record:
    import torch

    m = re.match(r"^L(\d+)\.", key)
    common = dict(
        key=key,
        seq=seq,
        side=f.side,
        rank=f.rank,
        call=f.call,
        layer=f.layer if f.kind in ("weights",) else (int(m.group(1)) if m else None),
        module_class=f.cls,
        file=os.path.basename(f.path),
        extra=extra,
    )
    if f.kind == "weights":
        common.update(io="weight", world_size=None)
    else:
        common.update(io="in" if key.endswith(("hidden_in", ".in")) or ".hidden_in." in key else "out")
    if isinstance(value, torch.Tensor):
        return Record(
            **common, dtype=dtype_name(value.dtype), shape=tuple(value.shape), source=InMemory(value, f.path)
        )
    stats = {k: float(value[k]) for k in _STATS}
    shape = tuple(int(s) for s in value.get("shape") or ())
    return Record(
        **common, dtype=str(value.get("dtype", "")).replace("torch.", "") or None, shape=shape, stats=stats
    )


def _mark_warmup(records: list[Record]) -> list[Record]:
    """ATOM's warm-up rule: among a rank's calls, those whose row counts are all powers of two are
    the warm-up when other calls' are not."""
    rows: dict[tuple, set[bool]] = {}
    for r in records:
        if r.call is not None and r.shape and r.io == "out":
            rows.setdefault((r.rank, r.call), set()).add(_pow2(r.shape[0]))
    calls_by_rank: dict[int, list[int]] = {}
    for rank, call in rows:
        calls_by_rank.setdefault(rank, []).append(call)
    warm = set()
    for rank, calls in calls_by_rank.items():
        pow2 = {c for c in calls if rows[(rank, c)] == {True}}
        if pow2 and len(pow2) < len(calls):
            warm |= {(rank, c) for c in pow2}
    return [dataclasses.replace(r, phase="warmup_guess") if (r.rank, r.call) in warm else r for r in records]


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
