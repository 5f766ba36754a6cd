"""Tiny SD3-style adapter: ``SD3Transformer2DModel`` + ``AutoencoderKL`` + a tiny CLIP text encoder.

Conventions follow diffusers ``StableDiffusion3Pipeline``: the transformer takes ``timestep = σ·1000``,
``encoder_hidden_states`` (CLIP penultimate hidden states, [B, L, 32]) and ``pooled_projections`` (CLIP
projected pooled output, [B, 32]); the text stack, the VAE (``vae.decode(x / scaling_factor +
shift_factor)``) and sampling are ``LatentFlowAdapter``'s (``adapters.latent_flow``). The real SD3 concatenates two CLIPs and T5; the tiny model uses one CLIP, whose widths
match the tiny transformer's ``joint_attention_dim`` and ``pooled_projection_dim``.
Shapes: latents [B, 4, 8, 8] <-> images [B, 3, 32, 32].
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from reference_trainer.adapters.base import Condition, call_module
from reference_trainer.adapters.latent_flow import LatentFlowAdapter
from reference_trainer.registry import register_adapter

SD3_TINY = dict(
    sample_size=8,
    patch_size=2,
    in_channels=4,
    num_layers=2,
    attention_head_dim=8,
    num_attention_heads=4,
    joint_attention_dim=32,
    caption_projection_dim=32,
    pooled_projection_dim=32,
    out_channels=4,
    pos_embed_max_size=16,
)
"""``reference/build-machine.md`` §4 ``SD3_TINY`` with ``pooled_projection_dim`` = the tiny CLIP's 32."""


@register_adapter("sd3-tiny")
class SD3TinyAdapter(LatentFlowAdapter):
    """Tiny SD3: a 2-layer MMDiT on 4×8×8 latents, tiny VAE, one tiny CLIP."""

    fixture_name = "sd3_tiny"

    def load_transformer(self) -> nn.Module:
        from diffusers import SD3Transformer2DModel

        transformer = SD3Transformer2DModel.from_pretrained(self.fixture_dir / "transformer")
        config = transformer.config
        self._latent_shape = (config.in_channels, config.sample_size, config.sample_size)
        return transformer

    def forward(
        self,
        latents: torch.Tensor,
        sigma: torch.Tensor,
        condition: Condition,
        *,
        module: nn.Module | None = None,
        parameters: Mapping[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        module = module if module is not None else self.trainable_module()
        output = call_module(
            module,
            parameters,
            hidden_states=latents,
            encoder_hidden_states=condition.prompt_embeds,
            pooled_projections=condition.pooled,
            timestep=sigma * 1000.0,  # diffusers SD3 timesteps are σ·1000
            return_dict=False,
        )
        return output[0].float()  # type: ignore[index]
