"""Generate the seeded init fixtures: ``python -m reference_trainer.make_fixtures [--out DIR]``.

Writes, under ``reference_trainer/fixtures/`` (default) — every file deterministic given the pinned
torch / diffusers / transformers versions (no test regenerates them: run it with ``--out`` to a scratch
directory and diff against the committed files after a version bump):

* ``sd3_tiny/`` and ``flux_tiny/``: ``transformer/``, ``vae/``, ``text_encoder/`` (config.json +
  safetensors), ``tokenizer/`` (hand-built CLIP BPE), ``scheduler/scheduler_config.json``. Each
  component is built from its config right after ``torch.manual_seed(SEED + k)``, so the shared VAE and
  text encoder are byte-identical in both directories (git stores them once). The transformers and
  the text encoder keep their random init. The VAE is then fitted for ``VAE_FIT_STEPS`` AdamW steps
  to reconstruct the tiny dataset's images (``fit_vae``): a randomly initialised decoder maps every
  latent to nearly the same grey image (brightness std ~1e-3 across latents), which would leave image
  rewards almost constant; the fitted one decodes latents to distinct colours (std ~0.06), so a reward
  on decoded images gives the trainers a real signal.
* ``sd3_tiny_teacher/transformer/``: a second seeded init of the tiny SD3 transformer
  (``torch.manual_seed(SEED + 4)``): the frozen teacher of the example DiffusionOPD config, a model
  other than the student's init (``make_teacher_fixture``).
* ``prompts.txt``: the tiny generation prompt list.
* ``tiny_dataset/``: ``images.safetensors`` (``images`` uint8 [12, 3, 32, 32], procedural colour
  gradients: 8 training colours, which the VAE is fitted to, then 4 held-out colours);
  ``demonstrations.jsonl`` (``{"prompt", "image"}``, the 8 training images) and
  ``demonstrations_heldout.jsonl`` (the 4 held-out ones); ``preferences.jsonl`` and
  ``preferences_heldout.jsonl`` (``{"prompt", "chosen", "rejected"}``, indices into ``images``): pairs of
  training images under one neutral prompt, ``chosen`` = the image the registered ``brightness``
  reward (target 1) scores higher, so the preference is a known, learnable rule. Training pairs are
  the 8 cyclic neighbours (i, i+1 mod 8); the 8 held-out pairs (i, i+3 mod 8) are pairs never
  trained on, of the same images.

Run it after changing a tiny config; commit the result. Total size ~1.6 MB.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from reference_trainer.adapters.base import FIXTURES
from reference_trainer.adapters.flux import FLUX_TINY
from reference_trainer.adapters.latent_flow import SCHEDULER, VAE_TINY
from reference_trainer.adapters.sd3 import SD3_TINY
from reference_trainer.adapters.text import build_text_encoder, build_tokenizer

SEED = 1234
PROMPTS = (
    "a red cat",
    "a blue dog",
    "a green tree",
    "a yellow sun",
    "a white cloud",
    "a black cat",
    "a purple flower",
    "an orange fruit",
)
COLOURS = (
    (230, 40, 40),
    (40, 60, 220),
    (30, 170, 60),
    (250, 220, 30),
    (245, 245, 245),
    (15, 15, 15),
    (150, 50, 200),
    (250, 140, 20),
)


HELDOUT_PROMPTS = ("a pink flower", "a cyan sky", "an olive leaf", "a slate roof")
HELDOUT_COLOURS = ((220, 120, 150), (60, 200, 200), (130, 130, 40), (90, 90, 170))
PREFERENCE_PROMPT = "a bright picture"
VAE_FIT_STEPS = 200


def fit_vae(vae: torch.nn.Module, images: torch.Tensor, steps: int = VAE_FIT_STEPS) -> None:
    """Fit ``vae`` to reconstruct ``images`` (uint8 [N, 3, H, W]): MSE + 1e-6·KL, AdamW lr 3e-3, one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the fitted bits depend on the thread count
    pixels = images.float() / 255.0 * 2.0 - 1.0
    optimizer = torch.optim.AdamW(vae.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(SEED)
    try:
        for _ in range(steps):
            posterior = vae.encode(pixels).latent_dist
            reconstruction = vae.decode(posterior.sample(generator=generator)).sample
            loss = (reconstruction - pixels).pow(2).mean() + 1e-6 * posterior.kl().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)


def _build_vae() -> torch.nn.Module:
    from diffusers import AutoencoderKL

    torch.manual_seed(SEED + 1)
    vae = AutoencoderKL(**VAE_TINY)
    fit_vae(vae, procedural_images())
    return vae.eval()


def _save_shared(directory: Path, vae: torch.nn.Module) -> None:
    """VAE, text encoder, tokenizer and scheduler (identical for both adapters)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    vae.save_pretrained(directory / "vae")
    torch.manual_seed(SEED + 2)
    build_text_encoder().save_pretrained(directory / "text_encoder")
    build_tokenizer().save_pretrained(directory / "tokenizer")
    FlowMatchEulerDiscreteScheduler(**SCHEDULER).save_pretrained(directory / "scheduler")


def make_model_fixtures(root: Path) -> None:
    """Write ``sd3_tiny/`` and ``flux_tiny/`` under ``root``."""
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    vae = _build_vae()
    for name, build in (
        ("sd3_tiny", lambda: SD3Transformer2DModel(**SD3_TINY)),
        ("flux_tiny", lambda: FluxTransformer2DModel(**FLUX_TINY)),
    ):
        directory = root / name
        shutil.rmtree(directory, ignore_errors=True)
        _save_shared(directory, vae)
        torch.manual_seed(SEED + 3)
        build().save_pretrained(directory / "transformer")


def procedural_images(colours: tuple[tuple[int, int, int], ...] = COLOURS) -> torch.Tensor:
    """uint8 [N, 3, 32, 32]: colour i, brightened left to right by a linear ramp."""
    ramp = torch.linspace(0.6, 1.0, 32).view(1, 1, 32)
    images = [
        (torch.tensor(colour, dtype=torch.float32).view(3, 1, 1) * ramp).expand(3, 32, 32)
        for colour in colours
    ]
    return torch.stack(images).round().clamp(0, 255).to(torch.uint8)


def preference_pairs(images: torch.Tensor, offset: int) -> list[dict]:
    """Pairs (i, i + offset mod 8) of training images; ``chosen`` = the higher ``brightness`` reward."""
    from reference_trainer.rewards import build_reward

    scores = build_reward("brightness", target=1.0)(images.float() / 255.0, [""] * len(images))
    count = len(COLOURS)
    records = []
    for i in range(count):
        j = (i + offset) % count
        chosen, rejected = (i, j) if scores[i] > scores[j] else (j, i)
        records.append({"prompt": PREFERENCE_PROMPT, "chosen": chosen, "rejected": rejected})
    return records


def make_dataset(root: Path) -> None:
    """Write ``tiny_dataset/`` and ``prompts.txt`` under ``root``."""
    from safetensors.torch import save_file

    (root / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    directory = root / "tiny_dataset"
    directory.mkdir(parents=True, exist_ok=True)
    images = torch.cat([procedural_images(), procedural_images(HELDOUT_COLOURS)])
    save_file({"images": images}, directory / "images.safetensors")
    files = {
        "demonstrations.jsonl": [{"prompt": prompt, "image": i} for i, prompt in enumerate(PROMPTS)],
        "demonstrations_heldout.jsonl": [
            {"prompt": prompt, "image": len(PROMPTS) + i} for i, prompt in enumerate(HELDOUT_PROMPTS)
        ],
        "preferences.jsonl": preference_pairs(images, offset=1),
        "preferences_heldout.jsonl": preference_pairs(images, offset=3),
    }
    for filename, records in files.items():
        (directory / filename).write_text("".join(json.dumps(record) + "\n" for record in records))


def make_teacher_fixture(root: Path) -> None:
    """Write ``sd3_tiny_teacher/transformer/`` under ``root`` (module docstring)."""
    from diffusers import SD3Transformer2DModel

    directory = root / "sd3_tiny_teacher"
    shutil.rmtree(directory, ignore_errors=True)
    torch.manual_seed(SEED + 4)
    SD3Transformer2DModel(**SD3_TINY).save_pretrained(directory / "transformer")


def main(argv: list[str] | None = None) -> None:
    """CLI: write the model fixtures, ``tiny_dataset/`` and ``prompts.txt`` under ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=FIXTURES, help="output directory (default: the package fixtures)"
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    make_model_fixtures(args.out)
    make_teacher_fixture(args.out)
    make_dataset(args.out)
    print(f"fixtures written to {args.out}")


if __name__ == "__main__":
    main()
