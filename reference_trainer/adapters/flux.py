"""Tiny Flux-style adapter: ``FluxTransformer2DModel`` on 2×2-packed latents.

Conventions follow diffusers ``FluxPipeline``: latents [B, C, H, W] are packed into 2×2 patches,
[B, (H/2)(W/2), 4C] (``_pack_latents``), with 2-D position ids ``img_ids`` [(H/2)(W/2), 3] (row, column in
channels 1 and 2) and ``txt_ids`` [L, 3] of zeros; ``timestep`` is σ in [0, 1]; no guidance embedding
(FLUX.1-schnell style). The real Flux takes T5 hidden states and CLIP's pooled output; the tiny model
takes both from the one tiny CLIP. The text stack, the VAE and sampling are ``LatentFlowAdapter``'s
(``adapters.latent_flow``). Shapes: latents [B, 4, 8, 8] -> packed [B, 16, 16].
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from reference_trainer.adapters.base import Condition, call_module
from reference_trainer.adapters.latent_flow import LatentFlowAdapter
from reference_trainer.registry import register_adapter

FLUX_TINY = dict(
    patch_size=1,
    in_channels=16,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=32,
    guidance_embeds=False,
    axes_dims_rope=(4, 4, 8),
)
"""``reference/build-machine.md`` §4 ``FLUX_TINY``."""
LATENT_SHAPE = (4, 8, 8)


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, (H/2)(W/2), 4C] (diffusers ``FluxPipeline._pack_latents``)."""
    b, c, h, w = latents.shape
    latents = latents.view(b, c, h // 2, 2, w // 2, 2)
    latents = latents.permute(0, 2, 4, 1, 3, 5)  # [B, H/2, W/2, C, 2, 2]
    return latents.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(packed: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[B, (H/2)(W/2), 4C] -> [B, C, H, W] (diffusers ``FluxPipeline._unpack_latents``)."""
    b, _, channels = packed.shape
    latents = packed.view(b, height // 2, width // 2, channels // 4, 2, 2)
    latents = latents.permute(0, 3, 1, 4, 2, 5)  # [B, C, H/2, 2, W/2, 2]
    return latents.reshape(b, channels // 4, height, width)


def image_ids(height: int, width: int) -> torch.Tensor:
    """Position ids of the packed latent tokens, [(H/2)(W/2), 3] (``_prepare_latent_image_ids``)."""
    ids = torch.zeros(height // 2, width // 2, 3)
    ids[..., 1] = torch.arange(height // 2)[:, None]
    ids[..., 2] = torch.arange(width // 2)[None, :]
    return ids.reshape(-1, 3)


@register_adapter("flux-tiny")
class FluxTinyAdapter(LatentFlowAdapter):
    """Tiny Flux: one double-stream and one single-stream block on packed 4×8×8 latents."""

    fixture_name = "flux_tiny"

    def load_transformer(self) -> nn.Module:
        from diffusers import FluxTransformer2DModel

        transformer = FluxTransformer2DModel.from_pretrained(self.fixture_dir / "transformer")
        self._latent_shape = LATENT_SHAPE
        self._img_ids = image_ids(LATENT_SHAPE[1], LATENT_SHAPE[2])  # [(H/2)(W/2), 3]
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
        _, _, height, width = latents.shape
        txt_ids = torch.zeros(condition.prompt_embeds.shape[1], 3)
        output = call_module(
            module,
            parameters,
            hidden_states=pack_latents(latents),
            encoder_hidden_states=condition.prompt_embeds,
            pooled_projections=condition.pooled,
            timestep=sigma,  # Flux timesteps are σ in [0, 1]
            img_ids=self._img_ids,
            txt_ids=txt_ids,
            return_dict=False,
        )
        return unpack_latents(output[0], height, width).float()  # type: ignore[index]
