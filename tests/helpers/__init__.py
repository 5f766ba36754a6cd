"""Helpers of the test suite (not test modules), one package with a submodule per area.

Imported as ``from helpers.tiny_models import tiny_llama``: ``pythonpath = ["tests"]`` in
``pyproject.toml`` puts ``tests/`` on ``sys.path`` for pytest. A script a test runs as its own process
(the torchrun drivers in ``helpers/trainer/``, the hunt run scripts) gets it through ``PYTHONPATH``,
set by the test that launches it with ``subprocess_env``.

Areas: models (``tiny_models``, ``llama_ports``, ``moe_port``), ``trainer/``, ``hunt/``, ``bisect/``,
``review/``, ``peers/``, ``fuzz/``, ``weights/``.
"""

from __future__ import annotations

import os
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent


def subprocess_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) with ``tests/`` first on ``PYTHONPATH``, so a
    child process imports ``helpers`` as the tests do."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), env.get("PYTHONPATH", "")) if p)
    return env
