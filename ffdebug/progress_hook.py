"""What long analysis work tells whoever watches it (docs/cli.md "Progress").

`compare`, `bisect`, `weights_diff` and `inspect` take an optional `progress`: any object with
`begin(total, total_bytes)` and `advance(nbytes)`. The analysis packages know only this protocol;
the bar and the stderr lines of the CLI are `ffdebug.report.progress.Progress`, so nothing under
`comparison/`, `bisection/`, `weights/` or `store/` imports rendering.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

# A thread that shows progress marks itself with this attribute (true): it holds nothing a forked
# compare worker uses, so `ffdebug.comparison.forked` may fork beside it.
FORK_SAFE = "ffdebug_fork_safe"


@runtime_checkable
class ProgressHook(Protocol):
    """Receives the size of a piece of work, then one call per item done (from any thread)."""

    def begin(self, total: int, total_bytes: int = 0) -> None:
        """`total` items start, reading `total_bytes` payload bytes in all (0: not known)."""
        ...

    def advance(self, nbytes: int = 0) -> None:
        """One item is done; `nbytes` of payload were read for it."""
        ...
