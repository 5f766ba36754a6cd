"""Running one side's command for a round: its `FFDEBUG_*` variables, its log, its bytes."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from ffdebug.errors import FFDebugError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNIT = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str | None, option: str = "--budget") -> int | None:
    """`64MiB`, `1.5G`, `500k`, `4096` into bytes (binary units); None for no limit."""
    if text is None or text == "":
        return None
    m = _SIZE.match(text)
    if not m:
        raise FFDebugError(f"{option} {text!r} is invalid: use a size such as 64MiB, 1G or 500k")
    size = int(float(m.group(1)) * _UNIT[m.group(2).lower()])
    if size <= 0:
        raise FFDebugError(f"{option} {text!r} is invalid: the budget must be more than 0 bytes")
    return size


def tree_bytes(path: str) -> int:
    """Bytes of every regular file under `path` (payloads, manifests, run.json, logs excluded)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            if name.endswith(".log"):
                continue
            full = os.path.join(root, name)
            if os.path.isfile(full) and not os.path.islink(full):
                total += os.path.getsize(full)
    return total


def fresh_dir(path: str) -> str:
    """An empty round directory (an interrupted round is redone from nothing)."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    os.makedirs(path)
    return path


def run_side(command: str, env: dict[str, str], log_path: str, what: str, cwd: str | None = None) -> None:
    """Run `command` through the shell with `env` added; stdout and stderr go to `log_path`.
    A failing command is one line naming it and its log (exit 2)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("FFDEBUG_", "ATOM_"))}
    full_env.update(env)
    with open(log_path, "wb") as log:
        proc = subprocess.run(
            command, shell=True, env=full_env, stdout=log, stderr=subprocess.STDOUT, cwd=cwd
        )
    if proc.returncode != 0:
        tail = _tail(log_path)
        raise FFDebugError(
            f"{what}: command exited with {proc.returncode} ({command!r}); see {log_path}"
            + (f": {tail}" if tail else "")
        )


def _tail(path: str) -> str:
    try:
        with open(path, "rb") as f:
            lines = f.read()[-2000:].decode("utf-8", "replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1][:200] if lines else ""
