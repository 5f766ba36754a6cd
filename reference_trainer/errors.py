"""Config errors: the one exception type for an invalid value, ``require`` to raise it, and ``warn``.

A leaf module (no imports from the package), so maths modules (``flow_matching``, ``advantages``) and
the algorithm arguments can validate their fields without importing the YAML config loader.
``reference_trainer.config`` re-raises a nested ``ConfigError`` with the field's full dotted path
(``train.sigma_min: ...``); the CLI turns it into one line on stderr and exit code 2.
"""

from __future__ import annotations

import sys


class ConfigError(ValueError):
    """An invalid config value. ``field`` is the dotted path of the offending field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message


def require(condition: bool, field: str, message: str) -> None:
    """Raise ``ConfigError(field, message)`` unless ``condition``; used in ``__post_init__`` checks."""
    if not condition:
        raise ConfigError(field, message)


def warn(message: str) -> None:
    """One ``warning: ...`` line on stderr (a fault the run recovers from: a damaged checkpoint skipped
    by ``--resume latest``, a partial last log line dropped)."""
    print(f"warning: {message}", file=sys.stderr)
