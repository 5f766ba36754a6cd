"""Errors that the CLI maps to exit codes (DESIGN §5).

`FFDebugError` (exit 2) is bad input or usage: the message is one line that names the file or
variable and says how to fix it. `InputIdsMismatch` (exit 3) is the gate before numerics: the two
sides were not fed the same tokens, so no per-stage number can be trusted.
"""

from __future__ import annotations


class FFDebugError(Exception):
    """Usage error or unreadable / invalid input. Exit code 2."""

    exit_code = 2


class InputIdsMismatch(FFDebugError):
    """The two sides saw different input ids. Exit code 3."""

    exit_code = 3
