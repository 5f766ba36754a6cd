"""Helpers for the weights tests (`tests/helpers/__init__.py` says how they are imported)."""

from __future__ import annotations


def tiny_llama_model(seed: int = 0, layers: int = 2):
    from helpers.tiny_models import tiny_llama

    return tiny_llama(num_layers=layers, vocab=256, max_positions=64, seed=seed)


def run_cli(*args):
    """Invoke the ffdebug CLI in-process; returns the click Result (stdout / stderr apart)."""
    from typer.testing import CliRunner

    from ffdebug.cli.app import app

    return CliRunner().invoke(app, [str(a) for a in args])


def run_json(*args):
    import json

    r = run_cli(*args, "--json")
    assert r.exit_code in (0, 1), (r.exit_code, r.stdout, r.stderr)
    return r.exit_code, json.loads(r.stdout)
