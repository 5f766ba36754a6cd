"""Shared fixtures for weights-diff / load-audit tests: a tiny HF Llama saved once per session."""

from __future__ import annotations

import pytest
from helpers.weights.weights_utils import tiny_llama_model


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory):
    """A tiny Llama saved with save_pretrained (model.safetensors + config.json)."""
    path = tmp_path_factory.mktemp("hf") / "llama"
    tiny_llama_model().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def hf_state(hf_dir):
    from safetensors.torch import load_file

    return load_file(str(hf_dir / "model.safetensors"))
