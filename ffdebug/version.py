"""The ffdebug version: the installed package's metadata, or, when ffdebug runs from a checkout
that was never installed, the `version` line of the checkout's pyproject.toml. Recorded as
`tool_version` in every run.json (docs/architecture.md "Layers", the store/ row)."""

from __future__ import annotations

import os
import re
from importlib import metadata

_PYPROJECT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")
_VERSION_LINE = re.compile(r'^version\s*=\s*"([^"]+)"\s*$', re.M)


def source_version(pyproject: str = _PYPROJECT) -> str | None:
    """The `[project]` version of a pyproject.toml (its first `version = "…"` line), None if unreadable."""
    try:
        with open(pyproject, encoding="utf-8") as f:
            match = _VERSION_LINE.search(f.read())
    except OSError:
        return None
    return match.group(1) if match else None


def installed_version() -> str:
    """The version pip installed; the checkout's pyproject version; "0+unknown" with neither."""
    try:
        return metadata.version("ffdebug")
    except metadata.PackageNotFoundError:
        return source_version() or "0+unknown"


__version__ = installed_version()
