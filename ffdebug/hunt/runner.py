"""Running one side's command for a round: its `FFDEBUG_*` variables, its log, its bytes."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable

from ffdebug.errors import FFDebugError

# A side's command: a shell line, or (Python API only) a function of no arguments that builds the
# model, calls `ffdebug.install` and runs the forward in this process.
Command = str | Callable[[], object]

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


def command_text(command: Command) -> str:
    """How a command is recorded in hunt.json and the report: the shell line, or
    `python:<module>:<function>` for an in-process function."""
    if isinstance(command, str):
        return command
    name = getattr(command, "__qualname__", None) or type(command).__name__
    return f"python:{getattr(command, '__module__', '?')}:{name}"


def run_side(command: Command, env: dict[str, str], log_path: str, what: str, cwd: str | None = None) -> None:
    """Run `command` through the shell with `env` added; stdout and stderr go to `log_path`.
    A failing command is one line naming it and its log (exit 2). A function runs in this
    process instead (`run_in_process`)."""
    if not isinstance(command, str):
        run_in_process(command, env, log_path, what)
        return
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


def run_in_process(fn: Callable[[], object], env: dict[str, str], log_path: str, what: str) -> None:
    """Call `fn()` with `env` as this process's `FFDEBUG_*` variables (every other `FFDEBUG_*` /
    `ATOM_*` one removed, as for a shell command), the capture state re-read before and closed
    (dumps flushed) after; os.environ is restored afterwards. A `SystemExit(0)` (from
    `maybe_dump_weights_and_exit`) ends the run normally; any other failure is one line naming it."""
    from ffdebug.capture import state

    saved = {k: v for k, v in os.environ.items() if k.startswith(("FFDEBUG_", "ATOM_"))}
    for k in saved:
        del os.environ[k]
    os.environ.update(env)
    state.reset()
    failure = None
    try:
        fn()
    except SystemExit as err:
        if err.code not in (None, 0):
            failure = f"exited with {err.code}"
    except Exception as err:  # the user's function: any failure is reported, one line
        failure = f"raised {type(err).__name__}: {err}"
    finally:
        state.reset()
        for k in env:
            os.environ.pop(k, None)
        os.environ.update(saved)
    with open(log_path, "w", encoding="utf-8") as log:
        log.write(f"in process: {command_text(fn)}\n" + (failure or "finished") + "\n")
    if failure:
        raise FFDebugError(f"{what}: {command_text(fn)} {failure[:400]}; see {log_path}")


def _tail(path: str) -> str:
    try:
        with open(path, "rb") as f:
            lines = f.read()[-2000:].decode("utf-8", "replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1][:200] if lines else ""
