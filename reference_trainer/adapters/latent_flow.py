"""``LatentFlowAdapter``: what the built-in tiny SD3- and Flux-style adapters share.

Both are text-to-image flow-matching transformers in the latent space of one tiny ``AutoencoderKL``,
conditioned by one tiny CLIP (``adapters.text``) and sampled on a ``FlowMatchEulerDiscreteScheduler``
σ schedule. They differ only in the transformer: its class and how ``forward`` feeds it (SD3 takes
``timestep = σ·1000`` on [B, C, H, W] latents; Flux takes σ on 2×2-packed latents with position ids).
So this class implements ``load_pipeline`` (text stack, VAE, scheduler, then the subclass's
``load_transformer``), ``decode_latents``, ``encode_images``, ``encode_prompt`` and ``inference``; a
model adapter implements ``load_transformer`` and ``forward``.

VAE conventions follow diffusers ``StableDiffusion3Pipeline``: latents are decoded as
``vae.decode(x / scaling_factor + shift_factor)`` and encoded as ``(mode(q(z|x)) − shift)·scale``.
Shapes: latents [B, 4, 8, 8] <-> images [B, 3, 32, 32] in [0, 1].
"""

from __future__ import annotations

import json
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from typing import ClassVar

import torch
from torch import nn

from reference_trainer.adapters.base import BaseAdapter, Condition, SamplingInputs, Trajectory
from reference_trainer.adapters.sampling import sample_trajectory
from reference_trainer.adapters.text import encode_with_clip, load_text_stack, token_ids
from reference_trainer.errors import ConfigError

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


class LatentFlowAdapter(BaseAdapter):
    """Tiny CLIP + tiny VAE + flow-match scheduler around a model-specific transformer (module docstring)."""

    fixture_components: ClassVar[tuple[str, ...]] = (
        "tokenizer",
        "text_encoder",
        "vae",
        "scheduler",
        "transformer",
    )

    def fixture_latent_shape(self) -> tuple[int, int, int]:
        """(latent_channels, sample_size / f, sample_size / f) of the fixture's VAE, f = 2^(blocks − 1)."""
        path = self.fixture_dir / "vae" / "config.json"
        try:
            config = json.loads(path.read_text())
            factor = 2 ** (len(config["block_out_channels"]) - 1)
            side = int(config["sample_size"]) // factor
            return (int(config["latent_channels"]), side, side)
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ConfigError("model.fixture_dir", f"{path}: not a readable VAE config ({error})") from None

    def load_pipeline(self) -> None:
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler

        tokenizer, text_encoder = load_text_stack(self.fixture_dir)
        self.register_component("tokenizer", tokenizer)
        self.register_component("text_encoder", text_encoder)
        vae = AutoencoderKL.from_pretrained(self.fixture_dir / "vae")
        # eval(): AutoencoderKL.decode differs between train() and eval() (build-machine.md §4.1)
        self.register_component("vae", vae.requires_grad_(False).eval())
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(self.fixture_dir / "scheduler")
        self.register_component("scheduler", scheduler)
        transformer = self.load_transformer()
        self.register_component("transformer", transformer.requires_grad_(True).eval())

    @abstractmethod
    def load_transformer(self) -> nn.Module:
        """The transformer from ``self.fixture_dir / "transformer"``; also sets ``self._latent_shape``."""

    def encode_prompt(self, prompts: Sequence[str]) -> Condition:
        embeds, pooled = encode_with_clip(
            self._require_component("tokenizer"), self._require_component("text_encoder"), prompts
        )
        return Condition(prompt_embeds=embeds, pooled=pooled)

    @torch.no_grad()
    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """x̂_0 [B, 4, 8, 8] -> images [B, 3, 32, 32] in [0, 1] (diffusers SD3 pipeline + image processor)."""
        vae = self._require_component("vae")
        config = vae.config  # type: ignore[attr-defined]
        scaled = latents.float() / config.scaling_factor + config.shift_factor
        images = vae.decode(scaled, return_dict=False)[0]  # type: ignore[attr-defined]
        return (images / 2 + 0.5).clamp(0, 1)

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images (uint8, or float in [0, 1]) [B, 3, 32, 32] -> x_0 = (mode(q(z|x)) − shift)·scale [B, 4, 8, 8]."""
        vae = self._require_component("vae")
        config = vae.config  # type: ignore[attr-defined]
        pixels = images.float() / 255.0 if images.dtype == torch.uint8 else images.float()
        posterior = vae.encode(pixels * 2.0 - 1.0).latent_dist  # type: ignore[attr-defined]
        return (posterior.mode() - config.shift_factor) * config.scaling_factor

    def inference(
        self,
        condition: Condition,
        *,
        num_steps: int,
        noise_level: float,
        generator: torch.Generator | Sequence[torch.Generator],
        module: nn.Module | None = None,
        parameters: Mapping[str, torch.Tensor] | None = None,
        given: SamplingInputs | None = None,
        guidance_scale: float = 1.0,
    ) -> Trajectory:
        def velocity(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
            return self.guided_forward(
                x, sigma, condition, guidance_scale=guidance_scale, module=module, parameters=parameters
            )

        return sample_trajectory(
            velocity,
            batch_size=len(condition),
            latent_shape=self.latent_shape,
            sigmas=given.sigmas if given is not None else self.sigmas(num_steps),
            noise_level=noise_level,
            generator=generator,
            given=given,
        )

    def prompt_token_ids(self, prompts: Sequence[str]) -> torch.Tensor:
        """The CLIP token ids ``encode_prompt`` feeds the text encoder, [B, L] int64 (``rollout.prompt_ids``)."""
        return token_ids(self._require_component("tokenizer"), prompts)
