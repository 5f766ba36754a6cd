"""Errors that the CLI maps to exit codes (docs/comparing.md "Comparing" and "--json" keys).

`FFDebugError` (exit 2) is bad input or usage: the message is one line that names the file or
variable and says how to fix it. `InputIdsMismatch` (exit 3) is the gate before numerics: the two
sides were not fed the same tokens, so no per-stage number can be trusted.
"""

from __future__ import annotations

import re


class FFDebugError(Exception):
    """Usage error or unreadable / invalid input. Exit code 2."""

    exit_code = 2


class InputIdsMismatch(FFDebugError):
    """The two sides saw different input ids. Exit code 3."""

    exit_code = 3


_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(\[`'\"])|\n")


def short_reason(err: BaseException | str, limit: int = 120) -> str:
    """A clean one-sentence reason from a library's exception message, for a one-line error.

    ANSI escapes (torch bolds part of its weights-only message) are stripped and whitespace is
    collapsed; the first sentence is kept, cut at a word boundary with "…" past `limit`. For
    torch's weights-only refusal the sentence that names the offending global ("Unsupported global:
    GLOBAL mymod.MyClass …") is kept instead of the generic preamble. An empty message gives the
    exception's type name.
    """
    text = _ANSI.sub("", str(err)).strip()
    marker = "WeightsUnpickler error:"
    if marker in text:
        text = text.split(marker, 1)[1].strip()
    first = _SENTENCE_END.split(text, 1)[0] if text else ""
    first = " ".join(first.split()).rstrip(" .;:,")
    if not first:
        return type(err).__name__ if isinstance(err, BaseException) else "no reason given"
    if len(first) > limit:
        cut = first[: limit - 1]
        cut = cut.rsplit(" ", 1)[0] if " " in cut[limit // 2 :] else cut
        first = cut.rstrip(" .;:,") + "…"
    return first
