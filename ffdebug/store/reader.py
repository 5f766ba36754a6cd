"""Read one side of a dump store (or a foreign dump) into a list of typed records.

Accepted inputs for `open_side(path)`:
- an ffdebug side directory (`run.json` and/or `rankNNN/manifest.jsonl`), read here: every
  manifest line becomes a `Record` (`ffdebug.io.record`), its fields type-checked once;
- a weight dump directory written by `maybe_dump_weights_and_exit` (same format);
- anything a registered importer detects (`ffdebug.io.registry`): built in are ATOM-style `.pt`
  dumps (a directory of `.pt` files or one file, loaded weights-only) and a `.safetensors` file
  (each tensor becomes a record, read when loaded).
"""

from __future__ import annotations

import glob
import json
import os

from ffdebug.errors import FFDebugError
from ffdebug.io.record import Record
from ffdebug.io.registry import find_importer
from ffdebug.io.side import SideStore
from ffdebug.io.sources import StorePayload

__all__ = ["Record", "SideStore", "open_side", "sides_in"]


def _read_manifest(path: str, rank_dir: str) -> tuple[list[Record], int]:
    records: list[Record] = []
    partial = 0

    def payload(file: str, tensor: str) -> StorePayload:
        return StorePayload(os.path.join(rank_dir, file), tensor)

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
        if not isinstance(rec, dict):
            raise FFDebugError(
                f"{path}:{lineno}: manifest line is not a JSON object; this is not an ffdebug manifest"
            )
        records.append(Record.from_manifest(rec, f"{path}:{lineno}", payload))
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
    """Open one side; raises FFDebugError with a one-line fix when `path` is not readable.

    An ffdebug store is read here; any other path by the first importer that detects it
    (`ffdebug.io.registry`)."""
    path = os.fspath(path)
    if not os.path.exists(path):
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
    by_rank_dir: list[tuple[str, list[Record]]] = []
    status: dict = {}
    partial = 0
    for rank_dir in sorted(glob.glob(os.path.join(path, "rank*"))):
        manifest = os.path.join(rank_dir, "manifest.jsonl")
        if not os.path.exists(manifest):
            continue
        recs, cut = _read_manifest(manifest, rank_dir)
        records.extend(recs)
        by_rank_dir.append((rank_dir, recs))
        partial += cut
        status_path = os.path.join(rank_dir, "status.json")
        if os.path.exists(status_path):
            try:
                with open(status_path, encoding="utf-8") as f:
                    status[os.path.basename(rank_dir)] = json.load(f)
            except json.JSONDecodeError:
                status[os.path.basename(rank_dir)] = {"complete": False}
    _check_one_world_size(path, by_rank_dir)
    records.sort(key=lambda r: (r.rank, r.seq))
    return SideStore(path=path, records=records, run=run, status=status, incomplete_lines=partial)
