"""`Record`: one tensor of a dump store, a tensor file or a checkpoint, typed once when read.

The attributes are named exactly as the manifest fields (`ffdebug.store.schema.RECORD_KEYS`).
`Record.from_manifest` type-checks every field of one manifest line: a wrong-typed field is an
`FFDebugError` (exit 2) naming `file:line` and the field. Keys the schema does not know are kept
in `unknown`, never an error. The tensor itself is read lazily through `source` (see
`ffdebug.io.sources`); a record without a source was dumped as statistics only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ffdebug.errors import FFDebugError

REDUCTIONS = ("full", "partial")


@dataclass(frozen=True)
class ShardSpec:
    """A manifest `shard`: this record is piece `index` of `count` along `dim`."""

    dim: int
    index: int
    count: int

    def to_json(self) -> dict:
        return {"dim": self.dim, "index": self.index, "count": self.count}


@dataclass(frozen=True)
class Record:
    """One tensor: manifest fields plus the lazy source of its payload (None: statistics only)."""

    key: str
    seq: int
    side: str | None = None
    rank: int = 0
    world_size: int | None = None
    call: int | None = None
    invocation: int = 0
    phase: str | None = None
    step: dict = field(default_factory=dict)
    layer: int | None = None
    layer_class: str | None = None
    module_class: str | None = None
    module_path: str | None = None
    io: str = "out"
    dtype: str | None = None
    shape: tuple[int, ...] = ()
    stats: dict | None = None
    shard: ShardSpec | None = None
    reduction: str = "full"
    file: str | None = None
    tensor: str | None = None
    persistent: bool | None = None
    over_budget: bool = False
    extra: dict = field(default_factory=dict)
    unknown: dict = field(default_factory=dict)  # manifest keys outside the schema, kept as read
    source: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def from_manifest(cls, obj: dict, where: str, source=None) -> Record:
        """A record from one parsed manifest line; `where` is `file:line` for messages."""
        return cls(**_checked_fields(obj, where), source=source)

    @property
    def has_payload(self) -> bool:
        """A tensor can be loaded (for a folded record: every part has one)."""
        return self.source is not None and all(p.has_payload for p in self.parts)

    @property
    def origin(self) -> str:
        """Where the payload lives (a file or folder), for messages."""
        return getattr(self.source, "origin", "") if self.source is not None else ""

    @property
    def parts(self) -> tuple[Record, ...]:
        """The per-rank records a folded record was built from (empty for a plain record)."""
        return tuple(getattr(self.source, "parts", ()))

    @property
    def fold(self):
        """The rank plan (`ffdebug.io.ranks`) of a folded record, else None."""
        return getattr(self.source, "plan", None)

    def load(self):
        """The tensor (read from its source now; nothing is cached on the record)."""
        if self.source is None:
            raise FFDebugError(
                f"{self.key}: only statistics were dumped (FFDEBUG_FWD_DUMP_MODE=stats or over the "
                "byte budget); re-run the dump with FFDEBUG_FWD_DUMP_MODE=full"
            )
        return self.source.load()

    def verify(self) -> None:
        """Check that the payload is readable without loading it (headers, file presence)."""
        if self.source is not None:
            self.source.verify()


# ------------------------------------------------------------------------------------------------
# manifest field checks


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _kind(v) -> str:
    return (
        "null"
        if v is None
        else {dict: "object", list: "array", str: "string", bool: "boolean"}.get(type(v), type(v).__name__)
    )


class _Fields:
    def __init__(self, obj: dict, where: str) -> None:
        self.obj, self.where = obj, where

    def bad(self, name: str, want: str) -> FFDebugError:
        got = self.obj.get(name)
        return FFDebugError(
            f"{self.where}: manifest field '{name}' must be {want}, got {_kind(got)} {_short(got)}; "
            "the store is damaged or not an ffdebug manifest — re-run the dump"
        )

    def int(self, name: str, default=None, nullable: bool = False):
        v = self.obj.get(name, default)
        if v is None and (nullable or default is not None):
            return default
        if not _is_int(v):
            raise self.bad(name, "an integer" + (" or null" if nullable else ""))
        return v

    def str(self, name: str, default=None, nullable: bool = True):
        v = self.obj.get(name, default)
        if v is None and (nullable or default is not None):
            return default
        if not isinstance(v, str):
            raise self.bad(name, "a string" + (" or null" if nullable else ""))
        return v

    def dict(self, name: str, nullable: bool):
        v = self.obj.get(name)
        if v is None:
            return None if nullable else {}
        if not isinstance(v, dict):
            raise self.bad(name, "an object" + (" or null" if nullable else ""))
        return v

    def bool(self, name: str, default):
        v = self.obj.get(name, default)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise self.bad(name, "a boolean" + (" or null" if default is None else ""))
        return v


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:39] + "…"


def _checked_fields(obj: dict, where: str) -> dict:
    f = _Fields(obj, where)
    if "key" not in obj or "seq" not in obj:
        raise FFDebugError(f"{where}: manifest record lacks 'key'/'seq'; this is not an ffdebug manifest")
    shape = obj.get("shape")
    if shape is None:
        shape = ()
    elif not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
        raise f.bad("shape", "an array of non-negative integers")
    reduction = f.str("reduction", "full")
    if reduction not in REDUCTIONS:
        raise FFDebugError(
            f"{where}: manifest field 'reduction' must be one of {', '.join(REDUCTIONS)}, got {reduction!r}; "
            "the store is damaged or not an ffdebug manifest — re-run the dump"
        )
    fields = {
        "key": f.str("key", nullable=False),
        "seq": f.int("seq"),
        "side": f.str("side"),
        "rank": f.int("rank", 0),
        "world_size": f.int("world_size", nullable=True),
        "call": f.int("call", nullable=True),
        "invocation": f.int("invocation", 0),
        "phase": f.str("phase"),
        "step": f.dict("step", nullable=False),
        "layer": f.int("layer", nullable=True),
        "layer_class": f.str("layer_class"),
        "module_class": f.str("module_class"),
        "module_path": f.str("module_path"),
        "io": f.str("io", "out"),
        "dtype": f.str("dtype"),
        "shape": tuple(shape),
        "stats": f.dict("stats", nullable=True),
        "shard": _shard(f),
        "reduction": reduction,
        "file": f.str("file"),
        "tensor": f.str("tensor"),
        "persistent": f.bool("persistent", None),
        "over_budget": f.bool("over_budget", False),
        "extra": f.dict("extra", nullable=False),
    }
    fields["unknown"] = {k: v for k, v in obj.items() if k not in fields}
    return fields


def _shard(f: _Fields) -> ShardSpec | None:
    raw = f.dict("shard", nullable=True)
    if raw is None:
        return None
    want = "an object {dim, index, count} of integers"
    vals = {k: raw.get(k) for k in ("dim", "index", "count")}
    if (
        not all(_is_int(v) for v in vals.values())
        or vals["count"] < 1
        or not 0 <= vals["index"] < vals["count"]
    ):
        raise f.bad("shard", want + " with 0 <= index < count")
    return ShardSpec(**vals)
