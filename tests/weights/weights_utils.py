"""Helpers for the weights tests (imported by name: pytest puts this folder on sys.path)."""

from __future__ import annotations


def tiny_llama_model(seed: int = 0, layers: int = 2):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).eval()


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
