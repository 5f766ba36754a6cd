"""Tiny SD3-style adapter: ``SD3Transformer2DModel`` + ``AutoencoderKL`` + a tiny CLIP text encoder.

Conventions follow diffusers ``StableDiffusion3Pipeline``: the transformer takes ``timestep = σ·1000``,
``encoder_hidden_states`` (CLIP penultimate hidden states, [B, L, 32]) and ``pooled_projections`` (CLIP
projected pooled output, [B, 32]); latents are decoded as ``vae.decode(x / scaling_factor +
shift_factor)``. The real SD3 concatenates two CLIPs and T5; the tiny model uses one CLIP, whose widths
match the tiny transformer's ``joint_attention_dim`` and ``pooled_projection_dim``.
Shapes: latents [B, 4, 8, 8] <-> images [B, 3, 32, 32].
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from reference_trainer.adapters.base import BaseAdapter, Condition, Trajectory, call_module
from reference_trainer.adapters.sampling import sample_trajectory
from reference_trainer.adapters.text import encode_with_clip, load_text_stack
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

VAE_TINY = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 3,
    up_block_types=("UpDecoderBlock2D",) * 3,
    block_out_channels=(8, 16, 16),
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=8,
    sample_size=32,
    scaling_factor=1.5305,
    shift_factor=0.0609,
)
"""32×32 image <-> 4×8×8 latent, with SD3's scaling and shift factors."""

SCHEDULER = dict(num_train_timesteps=1000, shift=3.0)


def load_vae_and_scheduler(adapter: BaseAdapter) -> None:
    """Register ``vae`` and ``scheduler`` from the fixture (shared by the SD3 and Flux adapters)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler

    vae = AutoencoderKL.from_pretrained(adapter.fixture_dir / "vae")
    # eval(): AutoencoderKL.decode differs between train() and eval() (build-machine.md §4.1)
    adapter.register_component("vae", vae.requires_grad_(False).eval())
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(adapter.fixture_dir / "scheduler")
    adapter.register_component("scheduler", scheduler)


@torch.no_grad()
def decode_with_vae(adapter: BaseAdapter, latents: torch.Tensor) -> torch.Tensor:
    """x̂_0 [B, 4, 8, 8] -> images [B, 3, 32, 32] in [0, 1] (diffusers SD3 pipeline + image processor)."""
    vae = adapter._require_component("vae")
    config = vae.config  # type: ignore[attr-defined]
    scaled = latents.float() / config.scaling_factor + config.shift_factor
    images = vae.decode(scaled, return_dict=False)[0]  # type: ignore[attr-defined]
    return (images / 2 + 0.5).clamp(0, 1)


@torch.no_grad()
def encode_with_vae(adapter: BaseAdapter, images: torch.Tensor) -> torch.Tensor:
    """Images (uint8, or float in [0, 1]) [B, 3, 32, 32] -> x_0 = (mode(q(z|x)) − shift)·scale [B, 4, 8, 8]."""
    vae = adapter._require_component("vae")
    config = vae.config  # type: ignore[attr-defined]
    pixels = images.float() / 255.0 if images.dtype == torch.uint8 else images.float()
    posterior = vae.encode(pixels * 2.0 - 1.0).latent_dist  # type: ignore[attr-defined]
    return (posterior.mode() - config.shift_factor) * config.scaling_factor


@register_adapter("sd3-tiny")
class SD3TinyAdapter(BaseAdapter):
    """Tiny SD3: a 2-layer MMDiT on 4×8×8 latents, tiny VAE, one tiny CLIP."""

    fixture_name = "sd3_tiny"

    def load_pipeline(self) -> None:
        from diffusers import SD3Transformer2DModel

        tokenizer, text_encoder = load_text_stack(self.fixture_dir)
        self.register_component("tokenizer", tokenizer)
        self.register_component("text_encoder", text_encoder)
        load_vae_and_scheduler(self)
        transformer = SD3Transformer2DModel.from_pretrained(self.fixture_dir / "transformer")
        self.register_component("transformer", transformer.requires_grad_(True).eval())
        config = transformer.config
        self._latent_shape = (config.in_channels, config.sample_size, config.sample_size)

    def encode_prompt(self, prompts: Sequence[str]) -> Condition:
        embeds, pooled = encode_with_clip(
            self._require_component("tokenizer"), self._require_component("text_encoder"), prompts
        )
        return Condition(prompt_embeds=embeds, pooled=pooled)

    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        return decode_with_vae(self, latents)

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        return encode_with_vae(self, images)

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

    def inference(
        self,
        condition: Condition,
        *,
        num_steps: int,
        noise_level: float,
        generator: torch.Generator,
        module: nn.Module | None = None,
        parameters: Mapping[str, torch.Tensor] | None = None,
    ) -> Trajectory:
        def velocity(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
            return self.forward(x, sigma, condition, module=module, parameters=parameters)

        return sample_trajectory(
            velocity,
            batch_size=len(condition),
            latent_shape=self.latent_shape,
            sigmas=self.sigmas(num_steps),
            noise_level=noise_level,
            generator=generator,
        )
