"""Reading untrusted stores: plain names inside a directory, regular files only, bounded reads.

Every file of a store (manifest, `run.json`, `status.json`, payloads) is read through this module
(docs/architecture.md, "Hostile stores"):

- `contained(directory, name, what)`: a payload `file` of a manifest is a plain file name (no
  separator, no `..`, no NUL) and the path stays inside `directory`;
- `open_regular(path, what)`: `os.open` with `O_NOFOLLOW | O_NONBLOCK`, then `fstat` must say
  regular file — a symlink, FIFO, device or directory is refused with one line, without blocking;
- `read_bounded` / `read_json` / `loads_bounded`: at most `limit` bytes, JSON nested at most
  `MAX_JSON_DEPTH` levels (a 100,000-deep document is refused before the parser recurses).
"""

from __future__ import annotations

import json
import os
import re
import stat

from ffdebug.errors import FFDebugError

MAX_LINE_BYTES = 1 << 20  # one manifest line
MAX_JSON_FILE_BYTES = 1 << 20  # run.json, status.json
MAX_JSON_DEPTH = 64

_FOLLOW_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_OPEN_FLAGS = _FOLLOW_FLAGS | getattr(os, "O_NOFOLLOW", 0)


def contained(directory: str, name: str, what: str, kind: str = "payload file") -> str:
    """`directory/name` when `name` is a plain file name; else an FFDebugError naming `what`."""
    bad = (
        not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\0" in name
        or os.path.isabs(name)
        or os.path.basename(name) != name
    )
    if bad:
        raise FFDebugError(
            f"{what}: {kind} {name[:80]!r} is not a plain file name inside {directory}; "
            "files are named by file name only — the input is damaged or hostile"
        )
    return os.path.join(directory, name)


def _kind(mode: int) -> str:
    for test, word in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return word
    return "not a regular file"


def open_regular(path: str, what: str, missing: str = "", follow: bool = False) -> int:
    """A read-only descriptor of the regular file `path` (never blocks on a FIFO); the caller
    closes it. A final symlink is refused unless `follow` (files the user names directly, e.g. a
    Hugging Face cache snapshot, whose files are links to blobs). `missing`: the hint when the
    file does not exist."""
    try:
        fd = os.open(path, _FOLLOW_FLAGS if follow else _OPEN_FLAGS)
    except FileNotFoundError:
        raise FFDebugError(f"{path}: {what} is missing" + (f"; {missing}" if missing else "")) from None
    except OSError as err:
        if os.path.islink(path) and not follow:
            raise FFDebugError(
                f"{path}: {what} is a symbolic link; ffdebug reads only regular files inside the store"
            ) from None
        raise FFDebugError(f"{path}: cannot open {what} ({err.strerror})") from None
    try:
        mode = os.fstat(fd).st_mode
    except OSError as err:
        os.close(fd)
        raise FFDebugError(f"{path}: cannot stat {what} ({err.strerror})") from None
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise FFDebugError(f"{path}: {what} is {_kind(mode)}, not a regular file; the store is damaged")
    return fd


def check_regular(path: str, what: str) -> None:
    """`path` (a file the user named; symlinks followed) is a regular file, checked with
    `open_regular` before a library opens it by name: a FIFO or device would block or never end."""
    os.close(open_regular(path, what, follow=True))


def read_fd(fd: int, limit: int | None, path: str, what: str) -> bytes:
    """The bytes of `fd` from its current offset: at most `limit` (more is an error)."""
    chunks = []
    total = 0
    while True:
        want = 1 << 20 if limit is None else min(1 << 20, limit + 1 - total)
        if want <= 0:
            break
        try:
            chunk = os.read(fd, want)
        except BlockingIOError:
            raise FFDebugError(f"{path}: {what} would block; not a regular file") from None
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    data = b"".join(chunks)
    if limit is not None and len(data) > limit:
        raise FFDebugError(f"{path}: {what} is larger than {limit} bytes; the store is damaged or hostile")
    return data


def read_bounded(path: str, limit: int | None, what: str, missing: str = "", follow: bool = False) -> bytes:
    """The whole regular file `path` (at most `limit` bytes)."""
    fd = open_regular(path, what, missing, follow)
    try:
        return read_fd(fd, limit, path, what)
    finally:
        os.close(fd)


_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_BRACKETS = re.compile(r"[\[\]{}]")


def json_depth(text: str) -> int:
    """The deepest nesting of arrays / objects in `text` (strings skipped), without parsing."""
    depth = deepest = 0
    for m in _BRACKETS.finditer(_STRINGS.sub('""', text)):
        if m.group() in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def loads_bounded(text: str, where: str, what: str):
    """`json.loads(text)`, refusing nesting deeper than `MAX_JSON_DEPTH` first."""
    # the depth is at most the number of opening brackets: counting them (in C) spares the scan of
    # nearly every line (a manifest line opens about ten)
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and json_depth(text) > MAX_JSON_DEPTH:
        raise FFDebugError(
            f"{where}: {what} nests JSON deeper than {MAX_JSON_DEPTH} levels; the store is damaged or hostile"
        )
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as err:
        reason = _decode_reason(err) if isinstance(err, json.JSONDecodeError) else "nested too deep"
        raise FFDebugError(
            f"{where}: malformed {what} ({reason}); the store is damaged — re-run the dump"
        ) from None


def _decode_reason(err: json.JSONDecodeError) -> str:
    """json's message and where: "Expecting ',' delimiter at column 17" (a one-line document, a
    manifest line) or "… at line 3, column 5"."""
    one_line = "\n" not in err.doc.rstrip("\n")
    return f"{err.msg} at " + (
        f"column {err.colno}" if one_line else f"line {err.lineno}, column {err.colno}"
    )


def read_json(path: str, what: str, limit: int = MAX_JSON_FILE_BYTES, follow: bool = False):
    """The JSON document in the regular file `path` (≤ `limit` bytes, nesting ≤ MAX_JSON_DEPTH)."""
    data = read_bounded(path, limit, what, follow=follow)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise FFDebugError(
            f"{path}: {what} is not UTF-8 text; the store is damaged — re-run the dump"
        ) from None
    return loads_bounded(text, path, what)
