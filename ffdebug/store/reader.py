"""Read one side of a dump store (or a foreign dump) into a list of typed records.

Accepted inputs for `open_side(path)`:
- an ffdebug side directory (`run.json` and/or `rankNNN/manifest.jsonl`), read here: every
  manifest line becomes a `Record` (`ffdebug.io.record`), its fields type-checked once;
- a weight dump directory written by `maybe_dump_weights_and_exit` (same format);
- anything a registered importer detects (`ffdebug.io.registry`): built in are ATOM-style `.pt`
  dumps (a directory of `.pt` files or one file, loaded weights-only) and a `.safetensors` file
  (each tensor becomes a record, read when loaded).

Stores are untrusted (docs/architecture.md, "Hostile stores"): every file is opened through
`ffdebug.io.contained` (regular files only, bounded), a payload `file` must be a plain name inside
its rank directory, and a rank directory must hold one writer's records with unique `seq`.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable
from dataclasses import dataclass

from ffdebug.errors import FFDebugError
from ffdebug.io.contained import MAX_LINE_BYTES, contained, loads_bounded, open_regular, read_fd, read_json
from ffdebug.io.record import Record
from ffdebug.io.registry import find_importer, importers, peer_sides
from ffdebug.io.side import SideStore
from ffdebug.io.sources import StorePayload

__all__ = ["Record", "SideStore", "open_side", "sides_in"]


def read_manifest_bytes(path: str) -> bytes:
    """The bytes of a manifest, read through a checked descriptor."""
    fd = open_regular(path, "manifest")
    try:
        return read_fd(fd, None, path, "manifest")
    finally:
        os.close(fd)


def _manifest_lines(path: str, data: bytes | None = None):
    """(line number, text) of every complete line; the count of a trailing partial line (0 or 1).
    Read through a checked descriptor (unless its bytes are given), each line at most
    MAX_LINE_BYTES."""
    if data is None:
        data = read_manifest_bytes(path)
    lines = data.split(b"\n")
    # A last line without its newline is a write cut short by a kill: skip it, keep the rest.
    partial = 1 if lines and lines[-1] != b"" else 0
    out = []
    for lineno, line in enumerate(lines[:-1], start=1):
        if len(line) > MAX_LINE_BYTES:
            raise FFDebugError(
                f"{path}:{lineno}: manifest line is {len(line)} bytes (at most {MAX_LINE_BYTES}); "
                "the store is damaged or hostile"
            )
        out.append((lineno, line.decode("utf-8", errors="replace")))
    return out, partial


def _read_manifest(
    path: str, rank_dir: str, data: bytes | None = None, payload_of=None
) -> tuple[list[Record], int]:
    """The records of one manifest (read from `path`, or its bytes `data`); `payload_of(path, tensor)`
    builds the source of a payload file checked to lie inside `rank_dir` (default: the file)."""
    records: list[Record] = []
    lines, partial = _manifest_lines(path, data)
    payload_of = payload_of or StorePayload
    for lineno, line in lines:
        if not line.strip():
            continue
        where = f"{path}:{lineno}"

        def payload(file: str, tensor: str, where=where):
            return payload_of(contained(rank_dir, file, where), tensor)

        rec = loads_bounded(line, where, "manifest line")
        if not isinstance(rec, dict):
            raise FFDebugError(
                f"{where}: manifest line is not a JSON object; this is not an ffdebug manifest"
            )
        records.append(Record.from_manifest(rec, where, payload))
    _check_one_writer(path, records)
    return records, partial


def _check_one_writer(path: str, records: list[Record]) -> None:
    """One rank directory holds one writer's records, each `seq` once: two writers on one side
    would otherwise be read as one run."""
    writers = list(dict.fromkeys(r.writer for r in records))
    if len(writers) > 1:
        named = ", ".join(repr(w)[:60] for w in writers[:3])
        raise FFDebugError(
            f"{path}: records of {len(writers)} writers ({named}) in one rank directory; two runs wrote "
            "one side — delete the side directory and re-run one dump"
        )
    seen: set[int] = set()
    for r in records:
        if r.seq in seen:
            raise FFDebugError(
                f"{path}: seq {r.seq} appears twice; two writers or a damaged manifest — "
                "delete the side directory and re-run the dump"
            )
        seen.add(r.seq)


def _is_side_dir(path: str) -> bool:
    return os.path.lexists(os.path.join(path, "run.json")) or bool(
        glob.glob(os.path.join(path, "rank*", "manifest.jsonl"))
    )


def sides_in(directory: str) -> list[str]:
    """Side directories found directly under a dump directory."""
    if not os.path.isdir(directory):
        return []
    return sorted(n for n in os.listdir(directory) if _is_side_dir(os.path.join(directory, n)))


def open_side(path: str, format: str | None = None) -> SideStore:
    """Open one side; raises FFDebugError with a one-line fix when `path` is not readable.

    An ffdebug store is read here; any other path by the first importer that detects it
    (`ffdebug.io.registry`), or by the importer named `format`. `DIR/SIDE` where DIR is a foreign
    dump keeping several sides in one directory (ATOM) reads that side."""
    path = os.fspath(path)
    if format is not None:
        return _by_format(path, format)
    if not os.path.exists(path):
        parent, side = os.path.split(os.path.normpath(path))
        found = peer_sides(parent) if os.path.isdir(parent) else None
        if found is not None and side in found[1]:
            return found[0].read_side(parent, side)
        raise FFDebugError(f"{path}: no such file or directory")
    if os.path.isdir(path) and _is_side_dir(path):
        return _open_store_dir(path)
    importer = find_importer(path)
    if importer is not None:
        return importer.read(path)
    if os.path.isfile(path):
        raise FFDebugError(
            f"{path}: not a dump store or tensor file; pass a side directory (e.g. DIR/ref), "
            "a .safetensors file, or a .pt file"
        )
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


def _by_format(path: str, format: str) -> SideStore:
    names = {imp.name: imp for imp in importers()}
    if format == "store":
        if not (os.path.isdir(path) and _is_side_dir(path)):
            raise FFDebugError(
                f"{path}: --format store needs a side directory (run.json or rank*/manifest.jsonl)"
            )
        return _open_store_dir(path)
    if format not in names:
        raise FFDebugError(f"--format {format!r}: unknown; use one of store, {', '.join(names)}")
    if not os.path.exists(path):
        raise FFDebugError(f"{path}: no such file or directory")
    return names[format].read(path)


def _check_one_world_size(path: str, by_rank_dir: list[tuple[str, list[Record]]]) -> None:
    """Rank directories of one side must come from one run: stale ranks of an earlier, larger run
    would be folded in as if they were shards of this one."""
    sizes: dict = {}
    for rank_dir, records in by_rank_dir:
        for rec in records:
            sizes.setdefault(rec.world_size, os.path.basename(rank_dir))
    if len(sizes) > 1:
        seen = ", ".join(f"{where} says {size}" for size, where in sizes.items())
        raise FFDebugError(
            f"{path}: mixed world sizes ({seen}); rank directories from different runs are mixed — "
            "delete the side directory and re-run the dump"
        )


def _read_object(path: str, what: str) -> dict:
    obj = read_json(path, what)
    if not isinstance(obj, dict):
        raise FFDebugError(f"{path}: {what} is not a JSON object; the store is damaged — re-run the dump")
    return obj


# status.json fields the writer sets (`StoreWriter.close`) and their types.
_STATUS_FIELDS = {
    "records": int,
    "bytes_written": int,
    "written": int,
    "stats_only": int,
    "over_budget": int,
    "skipped_graph_capture": int,
    "writer": str,
    "complete": bool,
}


def _read_status(path: str) -> dict:
    status = _read_object(path, "status.json")
    for name, want in _STATUS_FIELDS.items():
        v = status.get(name)
        if v is not None and (type(v) is not want or (want is int and v < 0)):
            kind = "a non-negative integer" if want is int else ("a boolean" if want is bool else "a string")
            raise FFDebugError(
                f"{path}: status.json field '{name}' must be {kind}, got {str(v)[:40]!r}; the store is damaged "
                "— re-run the dump"
            )
    return status


def _rank_dirs(path: str) -> list[str]:
    """The `rankNNN` directories of a side; a symlinked one would lead reads outside the store."""
    out = []
    for rank_dir in sorted(glob.glob(os.path.join(path, "rank*"))):
        if os.path.islink(rank_dir):
            raise FFDebugError(
                f"{rank_dir}: rank directory is a symbolic link; ffdebug reads only files inside the store"
            )
        if os.path.isdir(rank_dir):
            out.append(rank_dir)
    return out


def read_run_info(path: str) -> dict:
    """A side's run.json ({} when it has none)."""
    run_path = os.path.join(path, "run.json")
    return _read_object(run_path, "run.json") if os.path.lexists(run_path) else {}


def read_status(rank_dir: str) -> dict | None:
    """A rank directory's status.json (None when it has none), its fields checked."""
    status_path = os.path.join(rank_dir, "status.json")
    return _read_status(status_path) if os.path.lexists(status_path) else None


def store_rank_dirs(path: str) -> list[str]:
    """The rank directories of a side directory that hold a manifest, in name order."""
    return [d for d in _rank_dirs(path) if os.path.lexists(os.path.join(d, "manifest.jsonl"))]


@dataclass(frozen=True)
class RankDirText:
    """One rank directory as read elsewhere (another process, `ffdebug.across`): its path, its
    manifest's bytes, its status.json (checked), and the source of its payload files."""

    path: str
    manifest: bytes
    status: dict | None
    payload_of: Callable | None = None  # (file path, tensor name) -> source; None: the file itself


def _open_store_dir(path: str) -> SideStore:
    rank_dirs = [
        RankDirText(d, read_manifest_bytes(os.path.join(d, "manifest.jsonl")), read_status(d))
        for d in store_rank_dirs(path)
    ]
    return side_from_texts(path, read_run_info(path), rank_dirs)


def side_from_texts(path: str, run: dict, rank_dirs: list[RankDirText]) -> SideStore:
    """A side built from its run.json and its rank directories' manifests and statuses (every
    check of `open_side` applies)."""
    records: list[Record] = []
    by_rank_dir: list[tuple[str, list[Record]]] = []
    status: dict = {}
    partial = 0
    run_path = os.path.join(path, "run.json")
    for rd in rank_dirs:
        manifest = os.path.join(rd.path, "manifest.jsonl")
        recs, cut = _read_manifest(manifest, rd.path, rd.manifest, rd.payload_of)
        records.extend(recs)
        by_rank_dir.append((rd.path, recs))
        partial += cut
        if rd.status is not None:
            status[os.path.basename(rd.path)] = rd.status
    _check_one_world_size(path, by_rank_dir)
    records.sort(key=lambda r: (r.rank, r.seq))
    problems = run.get("import_problems") or []
    if not isinstance(problems, list) or not all(isinstance(p, str) for p in problems):
        raise FFDebugError(
            f"{run_path}: run.json field 'import_problems' must be a list of strings — re-run the import"
        )
    return SideStore(
        path=path, records=records, run=run, status=status, incomplete_lines=partial, problems=list(problems)
    )
