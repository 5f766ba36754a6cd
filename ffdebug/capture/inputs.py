"""The root call's inputs as stages (docs/dumping.md "Inputs as stages").

Every root call dumps the external inputs it was given under `embed.<name>`: token ids
(`input_ids`, `decoder_input_ids`), `pixel_values`, `attention_mask`, `position_ids`, the
diffusion step's `timestep` and its latents (`hidden_states` / `sample` of a denoiser, as
`embed.latents`). They are compared like any stage; the external ones are also gated by compare
(docs/architecture.md "The input gate"): token ids, pixel values, attention mask and position ids
must be equal on the first call of each step-tag group. Latents and timesteps are never gated: a
scheduler that differs shows as a divergence of `embed.timestep` at the call where it starts.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InputStage:
    """One root input: the keyword it is passed as, its stage key, and how compare treats it."""

    kwarg: str
    key: str
    gated: bool  # checked by the input gate on the first call of each step-tag group
    tokens: bool = False  # token ids: a mismatch says "fix tokenization first"


INPUTS = (
    InputStage("input_ids", "embed.input_ids", gated=True, tokens=True),
    InputStage("decoder_input_ids", "embed.decoder_input_ids", gated=True, tokens=True),
    InputStage("pixel_values", "embed.pixel_values", gated=True),
    InputStage("attention_mask", "embed.attention_mask", gated=True),
    InputStage("position_ids", "embed.position_ids", gated=True),
    InputStage("timestep", "embed.timestep", gated=False),
)
LATENT_KWARGS = ("sample", "hidden_states", "latents")  # a denoiser's noisy input
SEQ_LENS_KEY = "embed.seq_lens"  # a packed side's sequence lengths (comparison/align.py)
CU_SEQLENS_KWARGS = ("cu_seqlens", "cu_seq_lens", "cu_seqlens_q", "cu_seq_lens_q")  # [0, l0, l0 + l1, ...]
SEQ_LENS_KWARGS = ("seq_lens", "seqlens", "seq_lengths")
LATENTS_KEY = "embed.latents"
GATED = {i.key: i for i in INPUTS if i.gated}


def root_inputs(named: dict, ids) -> list[tuple[InputStage | None, object]]:
    """(input, tensor) of the root call's inputs (`named`: its arguments by name) beyond
    `input_ids` (which the caller dumps), and `(None, latents)` for a denoiser's latents when the
    call has no token ids."""
    import torch

    kwargs = named
    out: list[tuple[InputStage | None, object]] = []
    for spec in INPUTS[1:]:
        v = kwargs.get(spec.kwarg)
        if isinstance(v, torch.Tensor):
            out.append((spec, v))
    if ids is None:
        latents = next((kwargs[n] for n in LATENT_KWARGS if isinstance(kwargs.get(n), torch.Tensor)), None)
        if latents is not None:
            out.append((None, latents))
    return out


def packed_lengths(named: dict):
    """A packed forward's sequence lengths, from its inputs: cumulative offsets (`cu_seqlens`, the
    flash-attention varlen convention, `[0, l0, l0 + l1, ...]`) or the lengths themselves
    (`seq_lens`); None when the forward takes neither. Recorded as `embed.seq_lens`, so a packed
    side aligns with a padded one without a tap (docs/comparing.md "Comparing", packed against padded)."""
    import torch

    for name in CU_SEQLENS_KWARGS:
        v = named.get(name)
        if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() >= 2 and not v.is_floating_point():
            return v.diff()
    for name in SEQ_LENS_KWARGS:
        v = named.get(name)
        if isinstance(v, torch.Tensor) and v.dim() == 1 and not v.is_floating_point():
            return v
    return None
