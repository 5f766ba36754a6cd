"""Files the CLI writes (`bisect --html`): checked before the analysis, written atomically, every
failure one line (docs/architecture.md, "Hostile stores")."""

from __future__ import annotations

import os
import stat

from ffdebug.errors import FFDebugError


def check_output_file(path: str, option: str) -> str:
    """`path` can be written as a regular file: not a directory / FIFO / device, its folder exists
    and is writable. Returns the absolute path."""
    full = os.path.abspath(path)
    where = f"{option} {path}"
    try:
        mode = os.lstat(full).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as err:
        raise FFDebugError(f"{where}: cannot check the output path ({err.strerror})") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise FFDebugError(
            f"{where}: is a directory; give a file name, e.g. {os.path.join(path, 'report.html')}"
        )
    if mode is not None and not stat.S_ISREG(mode):
        raise FFDebugError(f"{where}: exists and is not a regular file; give another file name")
    parent = os.path.dirname(full)
    if not os.path.isdir(parent):
        raise FFDebugError(f"{where}: directory {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK):
        raise FFDebugError(f"{where}: directory {parent} is not writable; choose a writable location")
    return full


def write_output_file(path: str, text: str, option: str) -> None:
    """Write `text` to `path` through a temp file renamed into place (a reader never sees half)."""
    full = check_output_file(path, option)
    tmp = f"{full}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, full)
    except OSError as err:
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise FFDebugError(f"{option} {path}: cannot write ({err.strerror})") from None
