"""The run's JSONL logs (``metrics.jsonl``, ``eval.jsonl``): read strictly, truncated atomically.

A run appends one JSON object per line. A process killed mid-write can leave a *partial last line*
(no newline, or not valid JSON): ``read_jsonl`` drops it, with a warning naming the file and the byte
offset where it starts. A bad line that is *not* the last one is damage the run did not cause; it is a
``LogError`` naming ``file:line`` (exit 2), and nothing is rewritten.

``truncate_jsonl`` keeps the records at or before a step (a resumed run redoes the later ones) and
replaces the file atomically: the kept lines are written to a temporary file beside it, fsync'ed, and
renamed over it, so a kill during the rewrite leaves either the old file or the new one.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reference_trainer.errors import warn


class LogError(ValueError):
    """A line of a JSONL log that is not the last one is not a JSON object with an ``optimizer_step``."""


@dataclass(frozen=True)
class JsonlContents:
    """The valid records of a log, and where a dropped partial last line started (``None``: none)."""

    records: tuple[dict[str, Any], ...]
    dropped_at: int | None = None


def _parse(line: bytes) -> dict[str, Any] | None:
    """The record of one line, or ``None`` if it is not a JSON object with an integer ``optimizer_step``."""
    try:
        record = json.loads(line)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        return None
    if not isinstance(record, dict) or type(record.get("optimizer_step")) is not int:
        return None
    return record


def read_jsonl(path: Path, *, quiet: bool = False) -> JsonlContents:
    """The records of ``path`` (none when it does not exist); see the module docstring.

    ``quiet``: no warning for a dropped partial last line (a check that a later read repeats).
    """
    path = Path(path)
    if not path.is_file():
        return JsonlContents(())
    *complete, tail = path.read_bytes().split(b"\n")  # tail: what follows the last newline
    records: list[dict[str, Any]] = []
    offset = 0
    for number, line in enumerate(complete, start=1):
        if line.strip():
            record = _parse(line)
            if record is None and (number < len(complete) or tail.strip()):
                raise LogError(
                    f"{path}:{number}: not a JSON record with an integer optimizer_step; only a partial "
                    "last line is dropped: repair or remove this line"
                )
            if record is None:  # the last line, garbled
                return _dropped(path, records, offset, len(line), quiet)
            records.append(record)
        offset += len(line) + 1
    if tail.strip():  # no newline after it: cut mid-write, even if it happens to parse
        return _dropped(path, records, offset, len(tail), quiet)
    return JsonlContents(tuple(records))


def _dropped(path: Path, records: list[dict[str, Any]], offset: int, size: int, quiet: bool) -> JsonlContents:
    if not quiet:
        warn(f"{path}: dropping a partial last line at byte offset {offset} ({size} bytes)")
    return JsonlContents(tuple(records), dropped_at=offset)


def write_jsonl_atomic(path: Path, records: list[dict[str, Any]] | tuple[dict[str, Any], ...]) -> None:
    """Replace ``path`` by ``records``, one JSON object per line, via a fsync'ed temporary file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as stream:
        stream.write("".join(json.dumps(record) + "\n" for record in records))
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def truncate_jsonl(path: Path, optimizer_step: int) -> None:
    """Keep the records of ``path`` at or before ``optimizer_step`` (atomically; module docstring)."""
    contents = read_jsonl(path)
    if not Path(path).is_file():
        return
    kept = [record for record in contents.records if record["optimizer_step"] <= optimizer_step]
    if len(kept) != len(contents.records) or contents.dropped_at is not None:
        write_jsonl_atomic(path, kept)
