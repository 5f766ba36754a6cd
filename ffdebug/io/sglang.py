"""SGLang dumper files, read as they are (docs/peer-dumps.md "Peer dumps").

SGLang's dumper (`sglang.srt.debug_utils.dumper`, 0.5.23) writes one pickle per dump into
`{dir}/{exp_name}/`, named by its tags joined with `___`:

    step=0___rank=0___dump_index=10___name=mlp_output___recompute_status=disabled___layer_id=2.pt

holding `{"value": tensor, "meta": {...the tags, world_rank, world_size, sglang_parallel_info or
megatron_parallel_info, dims, recompute_pseudo_rank/size...}}` (its dump loader also accepts a
bare value). One `exp_name` directory is one run: pass it, or its parent when that holds exactly
one. What becomes of each tag:

- `name` (+ `layer_id`) -> the stage key through `ffdebug.io.peer_names`;
- `step` and user tags -> the record's step tags (calls pair by them, as SGLang matches bundles);
- `rank` -> rank; `dump_index` -> capture order; a gap in a rank's `dump_index` (a dump the
  dumper counted but did not save) is a coverage problem that blocks exit 0;
- `recompute_status`, parallel-rank tags (`tp_rank`, ...) -> kept in `extra`; a `recompute` copy
  is checked against its `original` (SGLang's replicated pseudo-axis) and set aside;
- `dims` -> per-rank pieces folded by the rank plan it declares (`ffdebug.io.dims`); replicated
  axes are checked for consistency (SGLang's tolerance, max_abs <= 1e-6).

Files that `torch.load(weights_only=True)` refuses are listed with the global they need.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
from dataclasses import dataclass, field

from ffdebug.errors import FFDebugError
from ffdebug.io.checkpoints import dtype_name
from ffdebug.io.dims import AXES, DimsError, parse_dims, resolve_axes, unshard_plan
from ffdebug.io.peer_names import canonical_key
from ffdebug.io.ranks import Replicated, fold
from ffdebug.io.record import Record
from ffdebug.io.side import SideStore
from ffdebug.io.sources import InMemory
from ffdebug.io.torchfile import Refused, flatten_tensors, load_or_refused

_BOOKKEEPING = {"step", "rank", "dump_index", "name", "layer_id", "recompute_status"}
_PARALLEL_TAGS = {"pp_rank", "tp_rank", "cp_rank", "ep_rank", "etp_rank"}
_INT_TAGS = ("step", "rank", "dump_index", "layer_id")
_PARALLEL_INFO = ("sglang_parallel_info", "megatron_parallel_info")
_LAYER_KEY = re.compile(r"^L(\d+)\.")
REPLICA_ATOL = 1e-6  # SGLang's own tolerance for replicated ranks


def parse_file_name(stem: str) -> dict | None:
    """The `k=v` tags of a dumper file name, or None when it is not one (needs `name=`)."""
    tags: dict = {}
    for part in stem.split("___"):
        k, sep, v = part.partition("=")
        if not sep or not k:
            return None
        tags[k] = v
    if "name" not in tags:
        return None
    for k in _INT_TAGS:
        if k in tags:
            try:
                tags[k] = int(tags[k])
            except ValueError:
                return None
    return tags


def _dump_files(path: str) -> list[str]:
    return sorted(
        f for f in glob.glob(os.path.join(path, "*.pt")) if parse_file_name(os.path.basename(f)[:-3])
    )


def run_dir(path: str) -> str | None:
    """The exp_name directory `path` stands for (itself, or its only exp_name child), else None."""
    if not os.path.isdir(path):
        return None
    if _dump_files(path):
        return path
    runs = sorted(d for d in glob.glob(os.path.join(path, "*")) if os.path.isdir(d) and _dump_files(d))
    if len(runs) > 1:
        names = ", ".join(os.path.basename(r) for r in runs[:4])
        raise FFDebugError(
            f"{path}: holds {len(runs)} SGLang runs (exp_name directories {names}); one exp_name "
            f"directory is one run — pass one of them, e.g. {runs[0]}"
        )
    return runs[0] if runs else None


def detect(path: str) -> bool:
    try:
        return run_dir(path) is not None
    except FFDebugError:
        return True  # read() says why


@dataclass
class _Dump:
    tags: dict
    meta: dict
    tensors: dict  # field suffix ("" for the value itself) -> tensor
    file: str

    @property
    def rank(self) -> int:
        return self.tags.get("rank", 0)

    @property
    def coords(self) -> dict:
        info = next((self.meta[k] for k in _PARALLEL_INFO if isinstance(self.meta.get(k), dict)), {})
        out = {}
        for key, size in info.items():
            if key.endswith("_size") and isinstance(size, int) and size > 1:
                axis = key[: -len("_size")]
                if axis in AXES and isinstance(info.get(f"{axis}_rank"), int):
                    out[axis] = (info[f"{axis}_rank"], size)
        return out  # the recompute pseudo-axis is handled by `_set_aside_recompute`


@dataclass
class _Reading:
    dumps: list[_Dump] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    indices: dict = field(default_factory=dict)  # rank -> dump_index values seen


def _load(files: list[str]) -> _Reading:
    out = _Reading()
    for f in files:
        tags = parse_file_name(os.path.basename(f)[:-3])
        out.indices.setdefault(tags.get("rank", 0), []).append(tags.get("dump_index"))
        obj = load_or_refused(f)
        if isinstance(obj, Refused):
            out.problems.append(obj.sentence())
            continue
        value, meta = (
            (obj["value"], obj.get("meta") or {}) if isinstance(obj, dict) and "value" in obj else (obj, {})
        )
        tensors = _tensors(value)
        if not tensors:
            out.problems.append(
                f"{os.path.basename(f)} holds no tensor ({type(value).__name__}); not compared"
            )
            continue
        out.dumps.append(_Dump(tags, meta if isinstance(meta, dict) else {}, tensors, f))
    return out


def _tensors(value) -> dict:
    import torch

    if isinstance(value, torch.Tensor):
        return {"": value}
    if isinstance(value, (bool, int, float)) or (
        isinstance(value, (list, tuple)) and value and all(isinstance(v, (int, float)) for v in value)
    ):
        return {"": torch.tensor(value)}
    return {f".{k}": t for k, t in flatten_tensors(value).items()}


def _gaps(indices: dict) -> list[str]:
    out = []
    for rank, seen in sorted(indices.items()):
        have = {i for i in seen if isinstance(i, int)}
        if not have:
            continue
        missing = sorted(set(range(1, max(have) + 1)) - have)
        if missing:
            shown = ", ".join(map(str, missing[:8])) + (
                f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            )
            out.append(
                f"rank {rank}: dump_index {shown} missing (dumps the dumper counted but did not save, or deleted files)"
            )
    return out


def read(path: str) -> SideStore:
    rdir = run_dir(path)
    if rdir is None:
        raise FFDebugError(f"{path}: no SGLang dumper files (step=…___rank=…___name=….pt) found")
    reading = _load(_dump_files(rdir))
    dumps = sorted(reading.dumps, key=lambda d: (d.rank, d.tags.get("dump_index") or 0))
    world = max([d.rank + 1 for d in dumps] + [d.meta.get("world_size") or 1 for d in dumps] + [1])
    side = os.path.basename(os.path.normpath(path))
    records, problems = _records(dumps, side, world)
    problems = reading.problems + _gaps(reading.indices) + problems
    run = {"side": side, "format": "sglang", "exp_name": os.path.basename(rdir)}
    return SideStore(path=path, records=records, run=run, kind="sglang", problems=problems)


def _step_tags(tags: dict) -> dict:
    return {k: v for k, v in tags.items() if k not in _BOOKKEEPING - {"step"} and k not in _PARALLEL_TAGS}


def _records(dumps: list[_Dump], side: str, world: int) -> tuple[list[Record], list[str]]:
    """Per-rank records in capture order; pieces whose dims shard them folded into one."""
    per_rank: list[Record] = []
    for d in dumps:
        base = canonical_key(str(d.tags["name"]), d.tags.get("layer_id"))
        for suffix, t in d.tensors.items():
            key = base + suffix
            m = _LAYER_KEY.match(key)
            extra = {
                k: v
                for k, v in d.tags.items()
                if k in _PARALLEL_TAGS or k in ("dump_index", "recompute_status")
            }
            if isinstance(d.meta.get("dims"), str):
                extra["dims"] = d.meta["dims"]
            per_rank.append(
                Record(
                    key=key,
                    seq=len(per_rank),
                    side=side,
                    rank=d.rank,
                    world_size=world,
                    step=_step_tags(d.tags),
                    layer=int(m.group(1)) if m else None,
                    io=_io(str(d.tags["name"]), key),
                    dtype=dtype_name(t.dtype),
                    shape=tuple(t.shape),
                    file=os.path.basename(d.file),
                    extra={"sglang": extra, "coords": d.coords},
                    source=InMemory(t, d.file),
                )
            )
    kept, problems = _set_aside_recompute(per_rank)
    records, more = _unshard(kept)
    return records, problems + more


def _set_aside_recompute(records: list[Record]) -> tuple[list[Record], list[str]]:
    """Activation recompute dumps a tensor twice (`recompute_status` original, then recompute);
    SGLang treats the copies as replicas. The recompute copy is checked against its original
    (same key, tags, rank and occurrence) within SGLang's tolerance and set aside."""

    originals: dict[tuple, list[Record]] = {}
    kept, problems = [], []
    for rec in records:
        ident = (rec.key, tuple(sorted((k, str(v)) for k, v in rec.step.items())), rec.rank)
        status = rec.extra["sglang"].get("recompute_status")
        if status == "recompute" and originals.get(ident):
            twin = originals[ident].pop(0)
            if not _within_replica_tolerance(twin.load(), rec.load()):
                problems.append(
                    f"{rec.key}: the recomputed copy differs from the original forward (rank {rec.rank})"
                )
            continue
        if status == "original":
            originals.setdefault(ident, []).append(rec)
        kept.append(rec)
    return kept, problems


def _io(name: str, key: str) -> str:
    """`grad__NAME` is the dumper's gradient of NAME; block inputs are `in`."""
    if name.startswith("grad__"):
        return "grad"
    return "in" if key.endswith((".in", "hidden_in")) or ".in." in key else "out"


def _unshard(records: list[Record]) -> tuple[list[Record], list[str]]:
    groups: dict[tuple, list[Record]] = {}
    for rec in records:
        tags = tuple(sorted((k, str(v)) for k, v in rec.step.items()))
        dup = sum(1 for r in groups.get((rec.key, tags), []) if r.rank == rec.rank)
        groups.setdefault((rec.key, tags), []).append(dataclasses.replace(rec, invocation=dup))
    out, problems = [], []
    for (key, _), recs in groups.items():
        by_dup: dict[int, list[Record]] = {}
        for r in recs:
            by_dup.setdefault(r.invocation, []).append(r)
        for parts in by_dup.values():
            folded, problem = _fold_parts(key, parts)
            out.extend(folded)
            problems.extend(problem)
    out.sort(key=lambda r: (r.rank, r.seq))
    return [dataclasses.replace(r, invocation=0, extra={"sglang": r.extra["sglang"]}) for r in out], problems


def _fold_parts(key: str, parts: list[Record]) -> tuple[list[Record], list[str]]:
    text = next((p.extra["sglang"].get("dims") for p in parts if p.extra["sglang"].get("dims")), None)
    if text is None:
        return parts, []
    coords = [p.extra["coords"] for p in parts]
    try:
        dims = parse_dims(text)
        if len(dims.names) != len(parts[0].shape):
            raise DimsError(
                f"dims {text!r} name {len(dims.names)} dims, the tensor has {len(parts[0].shape)}"
            )
        coords, loose = resolve_axes(dims, coords)
        if loose:
            raise DimsError(
                f"dims {text!r} do not declare the dump's parallel axis {', '.join(loose)}; "
                "fix the annotation (shard it, or add '# AXIS:replicated')"
            )
        plan = unshard_plan(dims, coords)
    except DimsError as err:
        return parts, [f"{key}: {err}; its ranks were compared one by one"]
    if plan is None:
        return parts, []
    problems = _replica_problems(key, plan, parts)
    rec = fold(parts, plan)
    extra = dict(rec.extra, sglang=dict(rec.extra["sglang"], unsharded=plan.describe()))
    return [dataclasses.replace(rec, extra=extra)], problems


def _within_replica_tolerance(a, b) -> bool:
    """One shape and |a − b| <= `REPLICA_ATOL` everywhere, in float64 (NaN never within)."""
    import numpy as np

    from ffdebug.arrays import as_float64

    return a.shape == b.shape and bool(np.allclose(as_float64(a), as_float64(b), rtol=0, atol=REPLICA_ATOL))


def _replica_problems(key: str, plan, parts: list[Record]) -> list[str]:
    """Replicated pieces (the plan's first steps) must agree within SGLang's tolerance."""
    out = []
    for step, groups in plan.steps:
        if not isinstance(step, Replicated):
            break
        for group in groups:
            base = parts[group[0]].load()
            for i in group[1:]:
                if not _within_replica_tolerance(base, parts[i].load()):
                    out.append(
                        f"{key}: replicated rank {parts[i].rank} differs from rank {parts[group[0]].rank}"
                    )
        break  # only the first replicated axis is checked: later steps index already-picked pieces
    return out
