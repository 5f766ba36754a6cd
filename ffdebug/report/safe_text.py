"""Keys and values from untrusted inputs, made safe for rich output (docs/architecture.md,
"Hostile stores"): rich markup escaped (a key holding `[/]` is printed as is, never parsed), and a
key longer than `MAX_SHOWN_KEY` characters elided in the middle with "…" plus an 8-hex hash of the
full key, so two long keys stay distinguishable. JSON output always holds the full key."""

from __future__ import annotations

import hashlib

from rich.markup import escape

MAX_SHOWN_KEY = 200


def shown_key(key: str) -> str:
    """`key` as displayed (plain text, no markup): whole up to MAX_SHOWN_KEY characters, else
    head…tail plus `#` and the first 8 hex digits of the key's sha256."""
    key = str(key)
    if len(key) <= MAX_SHOWN_KEY:
        return key
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    keep = (MAX_SHOWN_KEY - 11) // 2
    return f"{key[:keep]}…{key[-keep:]} #{digest}"


def key_markup(key: str) -> str:
    """A key for a rich markup string or table cell."""
    return escape(shown_key(key))


def esc(value) -> str:
    """Any value for a rich markup string (escaped, never elided)."""
    return escape(str(value))
