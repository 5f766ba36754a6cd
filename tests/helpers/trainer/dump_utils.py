"""Two identical trainer runs dumped with ffdebug, compared (not a test module).

Each side is captured in this process with an explicit ``ffdebug.capture`` session (the trainer's
``ffdebug.install`` hooks the transformer's blocks into it, its taps land in it), then the two dump
directories are compared with ``ffdebug compare --json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ffdebug


def dumped_runs_compare(tmp_path: Path, config: Path, *overrides: str, max_steps: int = 2) -> dict[str, Any]:
    """Run ``config`` twice (sides ``ref`` and ``target``) and return ``ffdebug compare --json``'s result."""
    from typer.testing import CliRunner

    from ffdebug.cli.app import app
    from reference_trainer.config import load_config
    from reference_trainer.run import train

    dumps = tmp_path / "dumps"
    for side in ("ref", "target"):
        with ffdebug.capture(dir=str(dumps), side=side):
            train(load_config(config, overrides=overrides, max_steps=max_steps), tmp_path / f"run_{side}")
    result = CliRunner().invoke(app, ["compare", str(dumps / "ref"), str(dumps / "target"), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)
