"""Tiny Hugging Face causal LMs built from configs (no download), shared by the test suites.

Imported as `from helpers.tiny_models import tiny_llama` (`tests/helpers/__init__.py`). Sizes are the smallest that keep every stage of a decoder block (two-core CPU
machines, seconds per model).
"""

from __future__ import annotations


def lm_tiny(num_layers: int = 4, hidden: int = 32, vocab: int = 1000, max_positions: int = 128) -> dict:
    """Config kwargs of a tiny decoder LM: 4 heads, 2 KV heads, MLP width 2 × hidden, untied head."""
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
    )


def tiny_llama(
    num_layers: int = 4, hidden: int = 32, vocab: int = 1000, max_positions: int = 128, seed: int = 0
):
    """A seeded `LlamaForCausalLM` in eval mode."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**lm_tiny(num_layers, hidden, vocab, max_positions))).eval()


def block_stack(block, n: int = 2):
    """A model that runs `n` fresh instances of the module class `block` one after the other in a
    `ModuleList` named `layers` (the blocks capture numbers L000, L001, ...)."""
    import torch

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([block() for _ in range(n)])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    return Stack()
