"""The model families selftest builds, and the inputs each one's forward is given.

| family | models | forward inputs (batch B, `SelftestOptions.seq` S) |
|---|---|---|
| `causal_lm` | transformers' causal LM classes | `input_ids` [B, S] |
| `seq2seq_lm` | transformers' encoder-decoder LM classes (T5, BART, ...) | `input_ids` [B, S], `decoder_input_ids` [B, S / 2] |
| `image_classification` | transformers' image classifiers (ViT, ConvNeXt, ...) | `pixel_values` [B, C, image_size, image_size] |
| `diffusers` | diffusers' transformer and UNet denoisers (`selftest/diffusers_zoo.py`) | by forward signature: latents, timestep, text states, ... |

A transformers config maps to the first family, in this order, whose auto class knows it (a
multimodal config's text model for `causal_lm`); a model class name is its own family. Token ids and
pixels are drawn from a generator seeded by the options' seed, so the reference and every target of a
model see the same inputs.
"""

from __future__ import annotations

from typing import Any

CAUSAL_LM = "causal_lm"
SEQ2SEQ_LM = "seq2seq_lm"
IMAGE_CLASSIFICATION = "image_classification"
DIFFUSERS = "diffusers"
FAMILIES = (CAUSAL_LM, SEQ2SEQ_LM, IMAGE_CLASSIFICATION, DIFFUSERS)
TRANSFORMERS_FAMILIES = (CAUSAL_LM, SEQ2SEQ_LM, IMAGE_CLASSIFICATION)


def auto_class(family: str) -> Any:
    """The transformers auto class of a transformers family."""
    import transformers

    return {
        CAUSAL_LM: transformers.AutoModelForCausalLM,
        SEQ2SEQ_LM: transformers.AutoModelForSeq2SeqLM,
        IMAGE_CLASSIFICATION: transformers.AutoModelForImageClassification,
    }[family]


def mapping_names(family: str) -> dict[str, Any]:
    """`model_type` -> model class name(s) of a transformers family, read from transformers."""
    from transformers.models.auto import modeling_auto as auto

    return dict(
        {
            CAUSAL_LM: auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
            SEQ2SEQ_LM: auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
            IMAGE_CLASSIFICATION: auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
        }[family]
    )


def class_names(family: str) -> list[str]:
    """Every model class name of a transformers family (a model_type may map to several), sorted."""
    names: set[str] = set()
    for value in mapping_names(family).values():
        names.update([value] if isinstance(value, str) else value)
    return sorted(names)


def family_of_class(model_class: Any) -> str | None:
    """The transformers family whose auto mapping holds `model_class`, else None."""
    name = getattr(model_class, "__name__", "")
    return next((f for f in TRANSFORMERS_FAMILIES if name in class_names(f)), None)


def model_class_for(config: Any) -> tuple[str, Any, Any] | None:
    """(family, config, model class) of the first transformers family that knows `config`; a
    multimodal config whose own type none knows falls back to its text config as a causal LM."""
    for family in TRANSFORMERS_FAMILIES:
        mapping = auto_class(family)._model_mapping
        try:
            return family, config, mapping[type(config)]
        except KeyError:
            pass
    text = getattr(config, "text_config", None)
    if text is not None:
        try:
            return CAUSAL_LM, text, auto_class(CAUSAL_LM)._model_mapping[type(text)]
        except KeyError:
            pass
    return None


def _ids(model: Any, batch: int, seq: int, seed: int, fallback_vocab: int):
    import torch

    vocab = int(getattr(model.config, "vocab_size", 0) or fallback_vocab)
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, max(4, vocab - 1), (batch, seq), generator=generator)


def inputs(family: str, model: Any, batch: int, seq: int, seed: int, fallback_vocab: int) -> dict[str, Any]:
    """The forward's keyword arguments for one model of `family` (module docstring)."""
    import torch

    if family == CAUSAL_LM:
        return {"input_ids": _ids(model, batch, seq, seed + 7, fallback_vocab)}
    if family == SEQ2SEQ_LM:
        return {
            "input_ids": _ids(model, batch, seq, seed + 7, fallback_vocab),
            "decoder_input_ids": _ids(model, batch, max(2, seq // 2), seed + 8, fallback_vocab),
        }
    if family == IMAGE_CLASSIFICATION:
        config = model.config
        size = getattr(config, "image_size", 32)
        size = size[0] if isinstance(size, (list, tuple)) else int(size or 32)
        channels = int(getattr(config, "num_channels", 3) or 3)
        generator = torch.Generator().manual_seed(seed + 9)
        return {"pixel_values": torch.randn(batch, channels, size, size, generator=generator)}
    if family == DIFFUSERS:
        from ffdebug.selftest.diffusers_zoo import denoiser_inputs

        return denoiser_inputs(model, batch, seed)
    raise ValueError(f"family {family!r}: not one of {', '.join(FAMILIES)}")
