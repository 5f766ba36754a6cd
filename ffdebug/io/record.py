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

from ffdebug.arrays import as_array
from ffdebug.errors import FFDebugError

REDUCTIONS = ("full", "partial")
MAX_KEY_CHARS = 1024  # a manifest key longer than this is refused (docs/architecture.md, "Hostile stores")


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
    writer: str | None = None  # the writer lock's identity (ffdebug.store.lock)
    persistent: bool | None = None
    over_budget: bool = False
    extra: dict = field(default_factory=dict)
    unknown: dict = field(default_factory=dict)  # manifest keys outside the schema, kept as read
    source: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def from_manifest(cls, obj: dict, where: str, payload=None) -> Record:
        """A record from one parsed manifest line; `where` is `file:line` for messages.
        `payload(file, tensor)` builds the source of a record that names a payload file."""
        fields = _checked_fields(obj, where)
        source = None
        if payload is not None and fields["file"]:
            source = payload(fields["file"], fields["tensor"] or "tensor")
        return cls(**fields, source=source)

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
        """The tensor as a numpy array (`ffdebug.arrays`), read from its source now; nothing is
        cached on the record."""
        if self.source is None:
            raise FFDebugError(
                f"{self.key}: only statistics were dumped (FFDEBUG_FWD_DUMP_MODE=stats or over the "
                "byte budget); re-run the dump with FFDEBUG_FWD_DUMP_MODE=full"
            )
        return as_array(self.source.load())

    def verify(self) -> None:
        """Check that the payload is readable without loading it (headers, file presence)."""
        if self.source is not None:
            self.source.verify()


# ------------------------------------------------------------------------------------------------
# manifest field checks

_REQUIRED = object()
_INT, _STR, _DICT, _BOOL = (int,), (str,), (dict,), (bool,)  # exact types: True is not an int here
_WANT = {_INT: "an integer", _STR: "a string", _DICT: "an object", _BOOL: "a boolean"}

# field -> (accepted types, value when absent or null; _REQUIRED: neither is allowed)
_SPEC: dict[str, tuple[tuple, object]] = {
    "key": (_STR, _REQUIRED),
    "seq": (_INT, _REQUIRED),
    "side": (_STR, None),
    "rank": (_INT, 0),
    "world_size": (_INT, None),
    "call": (_INT, None),
    "invocation": (_INT, 0),
    "phase": (_STR, None),
    "step": (_DICT, {}),
    "layer": (_INT, None),
    "layer_class": (_STR, None),
    "module_class": (_STR, None),
    "module_path": (_STR, None),
    "io": (_STR, "out"),
    "dtype": (_STR, None),
    "stats": (_DICT, None),
    "reduction": (_STR, "full"),
    "file": (_STR, None),
    "tensor": (_STR, None),
    "writer": (_STR, None),
    "persistent": (_BOOL, None),
    "over_budget": (_BOOL, False),
    "extra": (_DICT, {}),
}
_CHECKED = frozenset(_SPEC) | {"shape", "shard"}


def _kind(v) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(v), type(v).__name__)


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:39] + "…"


def _bad(where: str, name: str, want: str, got) -> FFDebugError:
    return FFDebugError(
        f"{where}: manifest field '{name}' must be {want}, got {_kind(got)} {_short(got)}; "
        "the store is damaged or not an ffdebug manifest — re-run the dump"
    )


def _checked_fields(obj: dict, where: str) -> dict:
    if "key" not in obj or "seq" not in obj:
        raise FFDebugError(f"{where}: manifest record lacks 'key'/'seq'; this is not an ffdebug manifest")
    fields: dict = {}
    for name, (types, default) in _SPEC.items():
        v = obj.get(name)
        if v is None:
            if default is _REQUIRED:
                raise _bad(where, name, _WANT[types], v)
            v = dict(default) if type(default) is dict else default
        elif type(v) not in types:
            nullable = "" if default is _REQUIRED or default is not None else " or null"
            raise _bad(where, name, _WANT[types] + nullable, v)
        fields[name] = v
    if len(fields["key"]) > MAX_KEY_CHARS:
        raise FFDebugError(
            f"{where}: manifest field 'key' is {len(fields['key'])} characters long (at most {MAX_KEY_CHARS}); "
            "the store is damaged or hostile"
        )
    stats = fields["stats"]
    if stats is not None:
        for name, v in stats.items():
            if v is not None and type(v) not in (int, float):
                raise _bad(where, f"stats.{name}", "a number or null", v)
    if fields["reduction"] not in REDUCTIONS:
        raise _bad(where, "reduction", f"one of {', '.join(REDUCTIONS)}", fields["reduction"])
    shape = obj.get("shape")
    if shape is None:
        fields["shape"] = ()
    elif type(shape) is not list or not all(type(s) is int and s >= 0 for s in shape):
        raise _bad(where, "shape", "an array of non-negative integers", shape)
    else:
        fields["shape"] = tuple(shape)
    fields["shard"] = _shard(obj.get("shard"), where)
    fields["unknown"] = {k: v for k, v in obj.items() if k not in _CHECKED}
    return fields


def _shard(raw, where: str) -> ShardSpec | None:
    if raw is None:
        return None
    want = "an object {dim, index, count} of integers with 0 <= index < count"
    if type(raw) is not dict:
        raise _bad(where, "shard", want + " or null", raw)
    vals = {k: raw.get(k) for k in ("dim", "index", "count")}
    if not all(type(v) is int for v in vals.values()) or not 0 <= vals["index"] < vals["count"]:
        raise _bad(where, "shard", want, raw)
    return ShardSpec(**vals)
