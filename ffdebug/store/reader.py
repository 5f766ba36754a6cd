"""Read one side of a dump store (or a foreign dump) into a list of records.

Accepted inputs for `open_side(path)`:
- an ffdebug side directory (`run.json` and/or `rankNNN/manifest.jsonl`);
- a weight dump directory written by `maybe_dump_weights_and_exit` (same format);
- ATOM-style `.pt` dumps (a directory of `.pt` files or one file), loaded with
  `torch.load(weights_only=True)` only;
- a `.safetensors` file (each tensor becomes a record).
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from typing import Any

from ffdebug.errors import FFDebugError, short_reason


@dataclass
class Record:
    """One captured tensor: its manifest fields plus where to load it from."""

    fields: dict
    rank_dir: str | None = None
    _tensor: Any = field(default=None, repr=False)  # in-memory tensors from importers

    def __getitem__(self, name: str):
        return self.fields.get(name)

    def __getattr__(self, name: str):
        # bridge to attribute access until the typed Record lands
        if name.startswith("_") or name == "fields":
            raise AttributeError(name)
        value = self.__dict__["fields"].get(name)
        if value is None and name in ("rank", "invocation"):
            return 0
        if value is None and name in ("step", "extra"):
            return {}
        return value

    def get(self, name: str, default=None):
        return self.fields.get(name, default)

    @property
    def key(self) -> str:
        return self.fields["key"]

    @property
    def has_payload(self) -> bool:
        return self._tensor is not None or bool(self.fields.get("file"))

    def load(self):
        """The tensor (memory-mapped safetensors payload, or the imported tensor)."""
        if self._tensor is not None:
            return self._tensor
        name = self.fields.get("file")
        if not name:
            raise FFDebugError(
                f"{self.key}: only statistics were dumped (FFDEBUG_FWD_DUMP_MODE=stats or over the "
                "byte budget); re-run the dump with FFDEBUG_FWD_DUMP_MODE=full"
            )
        path = os.path.join(self.rank_dir or "", name)
        return load_safetensors_tensor(path, self.fields.get("tensor") or "tensor")

    def verify(self) -> None:
        """Check that the payload file exists and its safetensors header covers the file."""
        name = self.fields.get("file")
        if self._tensor is None and name:
            verify_safetensors(os.path.join(self.rank_dir or "", name))


def verify_safetensors(path: str) -> None:
    from safetensors import SafetensorError, safe_open

    if not os.path.exists(path):
        raise FFDebugError(f"{path}: payload file is missing; the store is incomplete — re-run the dump")
    try:
        with safe_open(path, framework="pt") as f:
            list(f.keys())
    except (SafetensorError, OSError, ValueError) as err:
        raise FFDebugError(
            f"{path}: unreadable safetensors file ({short_reason(err)}); "
            "it may be truncated — re-run the dump"
        ) from None


def load_safetensors_tensor(path: str, name: str):
    from safetensors import SafetensorError, safe_open

    if not os.path.exists(path):
        raise FFDebugError(f"{path}: payload file is missing; the store is incomplete — re-run the dump")
    try:
        with safe_open(path, framework="pt") as f:
            return f.get_tensor(name)
    except (SafetensorError, OSError, ValueError) as err:
        raise FFDebugError(
            f"{path}: unreadable safetensors file ({short_reason(err)}); "
            "it may be truncated — re-run the dump"
        ) from None


@dataclass
class SideStore:
    """All records of one side, in capture order per rank."""

    path: str
    records: list[Record]
    run: dict = field(default_factory=dict)
    status: dict = field(default_factory=dict)  # rank -> status.json (absent for killed runs)
    kind: str = "store"  # store | atom | safetensors
    incomplete_lines: int = 0

    @property
    def side(self) -> str:
        return self.run.get("side") or os.path.basename(os.path.normpath(self.path))

    def keys(self) -> list[str]:
        return [r.key for r in self.records]


def _read_manifest(path: str, rank_dir: str) -> tuple[list[Record], int]:
    records: list[Record] = []
    partial = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        data = f.read()
    lines = data.split("\n")
    # A last line without its newline is a write cut short by a kill: skip it, keep the rest.
    if lines and lines[-1] != "":
        partial = 1
    for lineno, line in enumerate(lines[:-1], start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as err:
            raise FFDebugError(
                f"{path}:{lineno}: malformed manifest line ({err.msg}); the store is damaged — re-run the dump"
            ) from None
        if not isinstance(rec, dict) or "key" not in rec or "seq" not in rec:
            raise FFDebugError(
                f"{path}:{lineno}: manifest record lacks 'key'/'seq'; this is not an ffdebug manifest"
            )
        records.append(Record(rec, rank_dir))
    return records, partial


def _is_side_dir(path: str) -> bool:
    return os.path.exists(os.path.join(path, "run.json")) or bool(
        glob.glob(os.path.join(path, "rank*", "manifest.jsonl"))
    )


def sides_in(directory: str) -> list[str]:
    """Side directories found directly under a dump directory."""
    if not os.path.isdir(directory):
        return []
    return sorted(n for n in os.listdir(directory) if _is_side_dir(os.path.join(directory, n)))


def open_side(path: str) -> SideStore:
    """Open one side; raises FFDebugError with a one-line fix when `path` is not readable."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FFDebugError(f"{path}: no such file or directory")
    if os.path.isfile(path):
        if path.endswith(".safetensors"):
            from ffdebug.store.importers import import_safetensors_file

            return import_safetensors_file(path)
        if path.endswith((".pt", ".pth", ".bin")):
            from ffdebug.store.importers import import_pt_files

            return import_pt_files(path, [path])
        raise FFDebugError(
            f"{path}: not a dump store or tensor file; pass a side directory (e.g. DIR/ref), "
            "a .safetensors file, or a .pt file"
        )
    if _is_side_dir(path):
        return _open_store_dir(path)
    pts = sorted(glob.glob(os.path.join(path, "*.pt")))
    if pts:
        from ffdebug.store.importers import import_pt_files

        return import_pt_files(path, pts)
    sides = sides_in(path)
    if sides:
        raise FFDebugError(
            f"{path}: is a dump directory holding sides {', '.join(sides)}; pass one side "
            f"(e.g. {os.path.join(path, sides[0])}) or use 'compare ref-vs-target --dir {path}'"
        )
    raise FFDebugError(
        f"{path}: not an ffdebug store (no run.json or rank*/manifest.jsonl); "
        "pass a side directory written with FFDEBUG_FWD_DUMP_DIR, e.g. DIR/ref"
    )


def _check_one_world_size(path: str, records: list[Record]) -> None:
    """Rank directories of one side must come from one run: stale ranks of an earlier, larger run
    would be folded in as if they were shards of this one."""
    sizes: dict = {}
    for rec in records:
        sizes.setdefault(rec.get("world_size"), os.path.basename(rec.rank_dir or ""))
    if len(sizes) > 1:
        seen = ", ".join(f"{where} says {size}" for size, where in sizes.items())
        raise FFDebugError(
            f"{path}: mixed world sizes ({seen}); rank directories from different runs are mixed — "
            "delete the side directory and re-run the dump"
        )


def _open_store_dir(path: str) -> SideStore:
    run: dict = {}
    run_path = os.path.join(path, "run.json")
    if os.path.exists(run_path):
        try:
            with open(run_path, encoding="utf-8") as f:
                run = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise FFDebugError(f"{run_path}: malformed run.json ({err}); re-run the dump") from None
        if not isinstance(run, dict):
            raise FFDebugError(f"{run_path}: run.json is not a JSON object; re-run the dump")
    records: list[Record] = []
    status: dict = {}
    partial = 0
    for rank_dir in sorted(glob.glob(os.path.join(path, "rank*"))):
        manifest = os.path.join(rank_dir, "manifest.jsonl")
        if not os.path.exists(manifest):
            continue
        recs, cut = _read_manifest(manifest, rank_dir)
        records.extend(recs)
        partial += cut
        status_path = os.path.join(rank_dir, "status.json")
        if os.path.exists(status_path):
            try:
                with open(status_path, encoding="utf-8") as f:
                    status[os.path.basename(rank_dir)] = json.load(f)
            except json.JSONDecodeError:
                status[os.path.basename(rank_dir)] = {"complete": False}
    _check_one_world_size(path, records)
    records.sort(key=lambda r: (r.get("rank") or 0, r.get("seq") or 0))
    return SideStore(path=path, records=records, run=run, status=status, incomplete_lines=partial)
