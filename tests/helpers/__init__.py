"""Helpers of the test suite (not test modules), one package with a submodule per area.

Imported as ``from helpers.tiny_models import tiny_llama``: ``pythonpath = ["tests"]`` in
``pyproject.toml`` puts ``tests/`` on ``sys.path`` for pytest. A script a test runs as its own process
(the torchrun drivers in ``helpers/trainer/``, the hunt run scripts) gets it through ``PYTHONPATH``,
set by the test that launches it with ``subprocess_env``.

Areas: models (``tiny_models``, ``llama_ports``, ``moe_port``), ``trainer/``, ``hunt/``, ``bisect/``,
``review/``, ``peers/``, ``fuzz/``, ``weights/``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
TIMEOUT_SCALE_ENV = "FFDEBUG_TEST_TIMEOUT_SCALE"


def _timeout_scale() -> float:
    text = os.environ.get(TIMEOUT_SCALE_ENV, "").strip()
    try:
        scale = float(text) if text else 1.0
    except ValueError:
        scale = -1.0
    if not (0 < scale < float("inf")):
        raise ValueError(f"{TIMEOUT_SCALE_ENV}={text!r} is invalid: use a positive factor, e.g. 3")
    return scale


TIMEOUT_SCALE = _timeout_scale()  # read when the suite is collected (the autouse fixture clears FFDEBUG_*)


def hang_timeout(seconds: float) -> float:
    """How long a test waits before it calls something hung: ``seconds`` x ``FFDEBUG_TEST_TIMEOUT_SCALE``
    (default 1; docs/install.md "Tests"). A deadline detects a hang, never a slow machine: each ``seconds`` is set
    so that a 2-core machine at load 10 (interpreter start-up and ``import torch`` alone take 20-40 s
    there) stays well inside it; raise the factor on a slower one."""
    return seconds * TIMEOUT_SCALE


def subprocess_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) with ``tests/`` first on ``PYTHONPATH``, so a
    child process imports ``helpers`` as the tests do."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), env.get("PYTHONPATH", "")) if p)
    return env


def load_script(path: Path, name: str) -> ModuleType:
    """A fresh module from the script at ``path`` (an example a test runs in process and patches),
    registered as ``name`` so that its dataclasses resolve their module."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, f"{path} is no Python script"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
