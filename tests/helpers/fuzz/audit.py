"""The fuzz suite's `open` recorder: one audit hook for the whole process (an audit hook cannot be
removed), recording only inside `recording()`."""

from __future__ import annotations

import os
import sys

_RECORDING: list | None = None


def _hook(event: str, args: tuple) -> None:
    if _RECORDING is not None and event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        _RECORDING.append(os.fsdecode(args[0]))


sys.addaudithook(_hook)


class recording:
    """Collect the paths opened inside the `with` block."""

    def __enter__(self) -> list[str]:
        global _RECORDING
        _RECORDING = []
        return _RECORDING

    def __exit__(self, *exc) -> None:
        global _RECORDING
        _RECORDING = None
