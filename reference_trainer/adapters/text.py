"""The tiny offline text stack shared by the built-in adapters: a hand-built CLIP BPE tokenizer and a
tiny ``CLIPTextModelWithProjection``.

No hub access: the tokenizer is built from a byte-level alphabet (GPT-2 / CLIP ``bytes_to_unicode``)
plus a handful of merges, so every prompt tokenizes, and it round-trips through
``save_pretrained`` / ``from_pretrained`` (``reference/build-machine.md`` §5, recipe 2). In
transformers 5, merges must be tuples and every merge result must be in the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # transformers is imported lazily, inside the functions that use it
    from transformers import CLIPTextModelWithProjection, CLIPTokenizer

BOS, EOS = "<|startoftext|>", "<|endoftext|>"
MAX_LENGTH = 8
"""Tokens per prompt (incl. BOS/EOS), so prompt_embeds are [B, 8, D]."""
MERGES = (("a", "t</w>"), ("c", "at</w>"), ("d", "og</w>"), ("o", "g</w>"), ("r", "ed</w>"), ("e", "d</w>"))

CLIP_TEXT_TINY = dict(
    vocab_size=1000,
    hidden_size=32,
    intermediate_size=37,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=77,
    projection_dim=32,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=1,
)
"""``reference/build-machine.md`` §4 ``CLIP_TEXT_TINY`` with our tokenizer's special-token ids (eos 1,
so CLIP pools at the first EOS rather than the legacy argmax rule for eos id 2)."""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map (openai/gpt-2 ``encoder.py``), used by CLIP BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return dict(zip(printable, [chr(code) for code in codes]))


def build_tokenizer() -> CLIPTokenizer:
    """The hand-built CLIP tokenizer: 2 special tokens + 256 byte symbols (+ ``</w>`` forms) + merges."""
    from transformers import CLIPTokenizer

    symbols = list(bytes_to_unicode().values())
    vocab = {BOS: 0, EOS: 1}
    for symbol in symbols + [symbol + "</w>" for symbol in symbols]:
        vocab[symbol] = len(vocab)
    for left, right in MERGES:
        vocab.setdefault(left + right, len(vocab))
    return CLIPTokenizer(
        vocab=vocab,
        merges=list(MERGES),
        model_max_length=MAX_LENGTH,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,
        unk_token=EOS,
    )


def build_text_encoder() -> CLIPTextModelWithProjection:
    """A randomly initialised tiny ``CLIPTextModelWithProjection`` (seed the RNG before calling)."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    return CLIPTextModelWithProjection(CLIPTextConfig(**CLIP_TEXT_TINY))


def load_text_stack(fixture_dir: Path) -> tuple[CLIPTokenizer, CLIPTextModelWithProjection]:
    """(tokenizer, text encoder) loaded from ``fixture_dir/tokenizer`` and ``fixture_dir/text_encoder``.

    The encoder is frozen (``requires_grad_(False)``) and in eval mode.
    """
    from transformers import CLIPTextModelWithProjection, CLIPTokenizer

    tokenizer = CLIPTokenizer.from_pretrained(fixture_dir / "tokenizer")
    encoder = CLIPTextModelWithProjection.from_pretrained(fixture_dir / "text_encoder")
    encoder.requires_grad_(False).eval()
    return tokenizer, encoder


def token_ids(tokenizer: CLIPTokenizer, prompts: Sequence[str]) -> torch.Tensor:
    """The prompts' token ids, padded to ``MAX_LENGTH`` (truncated past it), [B, L] int64."""
    tokens = tokenizer(
        list(prompts), padding="max_length", max_length=MAX_LENGTH, truncation=True, return_tensors="pt"
    )
    return tokens.input_ids


@torch.no_grad()
def encode_with_clip(
    tokenizer: CLIPTokenizer, encoder: CLIPTextModelWithProjection, prompts: Sequence[str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(penultimate hidden states [B, L, 32], projected pooled output [B, 32]) as SD3 uses CLIP."""
    output = encoder(token_ids(tokenizer, prompts), output_hidden_states=True)
    return output.hidden_states[-2].float(), output.text_embeds.float()
