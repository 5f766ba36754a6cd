"""The one output sink of the `ffdebug` commands (docs/architecture.md "Layers", the report/ row): built once from
`--json`, handed the command's typed result.

Human mode calls the result's renderer (rich text on stdout); JSON mode writes `result.to_json()`
(or a plain mapping) as one JSON document on stdout with the stable keys (pinned by tests/test_json_contract.py),
NaN refused. Progress that a human watches while a long command runs goes to `console`: stdout in
human mode, stderr in JSON mode, so stdout stays one parseable document. Imports no rich or torch
at module level: the CLI builds a sink before it knows the command succeeds.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rich.console import Console


class HasJSON(Protocol):
    """A typed result with the stable `--json` keys."""

    def to_json(self) -> Mapping[str, Any]:
        """The result as JSON-ready data with the stable keys."""
        ...


_documents = [0]  # JSON documents written since the CLI boundary started the command


def write_json(obj: Any) -> None:
    """One JSON document on stdout (indent 1, NaN refused, other types as their str)."""
    sys.stdout.write(json.dumps(obj, indent=1, allow_nan=False, default=str) + "\n")
    _documents[0] += 1


def reset_documents() -> None:
    """A new command starts (`ffdebug.cli.boundary`): no document written yet."""
    _documents[0] = 0


def documents_written() -> int:
    """JSON documents written since `reset_documents`: the boundary adds no error object after
    one, so stdout stays one parseable document (the result already says what failed)."""
    return _documents[0]


@dataclass(frozen=True)
class Output:
    """Where a command's result goes: `json=True` for `--json`, else rich text for a human."""

    json: bool = False

    def show(self, result: HasJSON | Mapping[str, Any], render: Callable[..., None], **options: Any) -> None:
        """JSON mode: the result's JSON. Human mode: `render(result, **options)`."""
        if self.json:
            write_json(result.to_json() if hasattr(result, "to_json") else result)
        else:
            render(result, **options)

    @property
    def console(self) -> Console:
        """A rich console for progress lines: stderr in JSON mode, stdout otherwise."""
        from rich.console import Console

        return Console(stderr=self.json)
