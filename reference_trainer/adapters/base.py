"""``BaseAdapter``: component runtime plus the four abstract methods every model adapter implements.

Contract (Flow-Factory ``BaseAdapter``, ``.agents/knowledge/constraints.md`` #12): ``load_pipeline()``,
``decode_latents()``, ``inference()``, ``forward()`` are abstract; encoders are opt-in. Components are
resolved through the runtime (``has_component`` / ``get_component`` / ``_require_component``), never with
``hasattr(adapter, name)``: a declared-but-absent optional component (``None``) and an undeclared name are
different answers.

Notation (flow matching, Flow-Factory / diffusers conventions):
    x_0: clean latent; ε: noise; σ ∈ [0, 1] noise level; x_σ = (1 − σ)·x_0 + σ·ε;
    v = ε − x_0: velocity target; the model predicts v_θ(x_σ, σ, c). Sampling runs σ from 1 to 0.
Shapes: latents [B, C, H, W]; prompt_embeds [B, L, D]; pooled [B, P]; images [B, 3, 32, 32] in [0, 1].
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from reference_trainer.errors import ConfigError

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


class ComponentError(LookupError):
    """A component is undeclared, or required but absent."""


@dataclass(frozen=True)
class Condition:
    """Cached prompt condition (frozen text-encoder output): embeds [B, L, D], pooled [B, P]."""

    prompt_embeds: torch.Tensor
    pooled: torch.Tensor

    def __len__(self) -> int:
        return self.prompt_embeds.shape[0]

    def select(self, index: torch.Tensor | slice | Sequence[int]) -> Condition:
        """Rows ``index`` of both tensors.

        Args:
            index: the rows to keep.

        Returns:
            A new ``Condition``.
        """
        if isinstance(index, Sequence):
            index = torch.as_tensor(index, dtype=torch.long)
        return Condition(prompt_embeds=self.prompt_embeds[index], pooled=self.pooled[index])

    @staticmethod
    def cat(conditions: Sequence[Condition]) -> Condition:
        """Concatenate along the batch dimension.

        Args:
            conditions: conditions with the same trailing shapes.

        Returns:
            One ``Condition`` holding all their rows, in order.
        """
        return Condition(
            prompt_embeds=torch.cat([c.prompt_embeds for c in conditions]),
            pooled=torch.cat([c.pooled for c in conditions]),
        )


@dataclass(frozen=True)
class Trajectory:
    """A sampled trajectory. T = number of denoising steps.

    latents:   [B, T + 1, C, H, W]  x at σ_0 = 1 (noise), σ_1, ..., σ_T = 0 (sample), storage dtype
    log_probs: [B, T] fp32 per-step log-prob of latents[:, j + 1] given latents[:, j] (SDE), or None (ODE)
    sigmas:    [T + 1] the noise-level schedule
    velocities: [B, T, C, H, W] fp32 v(latents[:, j], σ_j) of the sampling policy, or None when not recorded
    noise:     [B, C, H, W] fp32 the initial noise x_0 was drawn as (None when not recorded)
    sde_noise: [B, T, C, H, W] fp32 the ε of each SDE step (None for the ODE or when not recorded)
    """

    latents: torch.Tensor
    log_probs: torch.Tensor | None
    sigmas: torch.Tensor
    velocities: torch.Tensor | None = None
    noise: torch.Tensor | None = None
    sde_noise: torch.Tensor | None = None

    @property
    def final(self) -> torch.Tensor:
        """The generated clean latent x̂_0, [B, C, H, W].

        Returns:
            The last latent of the trajectory.
        """
        return self.latents[:, -1]


@dataclass(frozen=True)
class SamplingInputs:
    """The random inputs of a rollout given instead of drawn (``--inputs-from``, docs/trainer-taps.md):
    the σ schedule [T + 1], the initial noise [B, C, H, W] and the SDE steps' ε [B, T, C, H, W]
    (None: the ODE). A trajectory sampled with them uses no generator."""

    sigmas: torch.Tensor
    noise: torch.Tensor
    sde_noise: torch.Tensor | None


class BaseAdapter(ABC):
    """A model family's components and conventions behind one trainer-facing interface."""

    registry_name: str = ""
    fixture_name: str = ""
    """Sub-directory of ``reference_trainer/fixtures`` with this adapter's seeded init weights."""
    trainable_component: str = "transformer"
    """The component finetuned by the trainers (full finetune)."""
    fixture_components: ClassVar[tuple[str, ...]] = ()
    """Sub-directories every fixture of this adapter has (``check_fixture``, before loading)."""

    def __init__(self, fixture_dir: str | Path | None = None):
        self.fixture_dir = Path(fixture_dir) if fixture_dir is not None else FIXTURES / self.fixture_name
        self._components: dict[str, nn.Module | object | None] = {}
        self._latent_shape: tuple[int, int, int] | None = None

    # ---------------------------------------------------------------- component runtime
    def register_component(self, name: str, component: nn.Module | object | None) -> None:
        """Declare ``name``; ``None`` declares an optional component that is absent.

        Args:
            name: the component's name.
            component: the component, or ``None`` for an optional one that is absent.
        """
        self._components[name] = component

    def route_component(self, name: str, prepared: nn.Module) -> None:
        """After the backend's prepare: ``get_component(name)`` returns the prepared module (a wrapper
        of the declared one), so every adapter forward runs through it; a functional call with snapshot
        parameters unwraps it (``call_module``)."""
        if self.get_component(name) is not native_module(prepared):
            raise ComponentError(
                f"{type(self).__name__}: the prepared module does not wrap component {name!r}"
            )
        self._components[name] = prepared

    def has_component(self, name: str) -> bool:
        """True when ``name`` is declared and present (not ``None``).

        Args:
            name: a component name.

        Returns:
            Whether it is declared and present.
        """
        return self._components.get(name) is not None

    def get_component(self, name: str) -> nn.Module | object | None:
        """The component ``name`` (``None`` when declared optional and absent); error when undeclared.

        Args:
            name: a declared component name.

        Returns:
            The component, or ``None``.
        """
        if name not in self._components:
            raise ComponentError(
                f"{type(self).__name__} declares no component {name!r}; declared: {sorted(self._components)}"
            )
        return self._components[name]

    def _require_component(self, name: str) -> nn.Module | object:
        """The component ``name``; error when undeclared or absent."""
        component = self.get_component(name)
        if component is None:
            raise ComponentError(f"{type(self).__name__}: component {name!r} is required but absent")
        return component

    def component_names(self) -> list[str]:
        """All declared component names, in declaration order.

        Returns:
            The names.
        """
        return list(self._components)

    def trainable_module(self) -> nn.Module:
        """The live trainable component (the base variant of ``ComponentVariantRegistry``).

        Returns:
            The trainable ``nn.Module``.
        """
        module = self._require_component(self.trainable_component)
        assert isinstance(module, nn.Module)
        return module

    # ---------------------------------------------------------------- the four abstract methods
    @abstractmethod
    def load_pipeline(self) -> None:
        """Build every component from ``self.fixture_dir`` (configs + safetensors); no downloads.

        Frozen components are put in ``eval()`` mode with ``requires_grad=False``; the trainable
        component gets ``requires_grad=True``.
        """

    @abstractmethod
    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Clean latents [B, C, H, W] -> images [B, 3, H·8, W·8] in [0, 1] (no gradient).

        Args:
            latents: clean latents, [B, C, H, W].

        Returns:
            Images, [B, 3, 8H, 8W] in [0, 1].
        """

    @abstractmethod
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
        """Sample one trajectory per condition row, from pure noise to a clean latent.

        ``noise_level > 0`` uses the Flow-SDE (per-step log-probs); ``0`` the deterministic ODE.
        ``module`` / ``parameters`` select the variant / snapshot that predicts the velocity.

        Args:
            condition: one row per trajectory.
            num_steps: T denoising steps.
            noise_level: the SDE's a (0: the ODE).
            generator: the RNG of the initial noise and the SDE noise: one for the batch, or one per
                condition row (``adapters.sampling.sample_trajectory``).
            module: the variant that predicts the velocity (default: the trainable one).
            parameters: a snapshot used functionally instead of ``module``'s weights.
            given: schedule and noise to use instead of ``num_steps``' schedule and ``generator``'s draws.
            guidance_scale: classifier-free guidance of every step's velocity (``guided_forward``; the
                empty prompt as the unconditional row); ≤ 1: none.

        Returns:
            The ``Trajectory`` (latents [B, T + 1, C, H, W], log-probs [B, T] for the SDE).
        """

    def prompt_token_ids(self, prompts: Sequence[str]) -> torch.Tensor | None:
        """The token ids the text encoder is fed, [B, L] int64 (tapped as ``rollout.prompt_ids``);
        None for an adapter without a tokenizer."""
        return None

    @abstractmethod
    def forward(
        self,
        latents: torch.Tensor,
        sigma: torch.Tensor,
        condition: Condition,
        *,
        module: nn.Module | None = None,
        parameters: Mapping[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Velocity prediction v_θ(x_σ, σ, c): latents [B, C, H, W], sigma [B] -> [B, C, H, W] fp32.

        ``module`` defaults to the live trainable component; ``parameters`` (a snapshot) are used
        through ``torch.func.functional_call`` without touching the live weights.

        Args:
            latents: x_σ, [B, C, H, W].
            sigma: σ per sample, [B].
            condition: one row per sample.
            module: the variant to run (default: the trainable one).
            parameters: a snapshot used functionally instead of ``module``'s weights.

        Returns:
            The velocity, [B, C, H, W] fp32.
        """

    # ---------------------------------------------------------------- classifier-free guidance
    def unconditional(self, batch_size: int) -> Condition:
        """The unconditional (empty-prompt) condition, ``batch_size`` rows: the negative prompt "" of
        diffusers' SD3 / Flux pipelines when no negative prompt is given.

        Args:
            batch_size: rows.

        Returns:
            ``encode_prompt([""] * batch_size)``.
        """
        return self.encode_prompt([""] * batch_size)

    def guided_forward(
        self,
        latents: torch.Tensor,
        sigma: torch.Tensor,
        condition: Condition,
        *,
        guidance_scale: float,
        uncondition: Condition | None = None,
        module: nn.Module | None = None,
        parameters: Mapping[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Classifier-free guided velocity v_u + s·(v_c − v_u) (Ho & Salimans 2022, arXiv 2207.12598; the
        diffusers SD3 pipeline's ``noise_pred_uncond + guidance_scale * (noise_pred_text − noise_pred_uncond)``),
        computed like diffusers in one forward of the doubled batch [uncond, cond]. ``guidance_scale`` ≤ 1
        is no guidance: the plain conditional ``forward``.

        Args:
            latents: x_σ, [B, C, H, W].
            sigma: σ per sample, [B].
            condition: the conditional rows, [B].
            guidance_scale: s.
            uncondition: the unconditional rows (default: ``unconditional(B)``).
            module: the variant to run (default: the trainable one).
            parameters: a snapshot used functionally instead of ``module``'s weights.

        Returns:
            The guided velocity, [B, C, H, W] fp32.
        """
        if guidance_scale <= 1.0:
            return self.forward(latents, sigma, condition, module=module, parameters=parameters)
        uncondition = uncondition if uncondition is not None else self.unconditional(len(condition))
        if len(uncondition) != len(condition):
            raise ValueError(f"{len(uncondition)} unconditional rows for {len(condition)} conditional ones")
        both = self.forward(
            torch.cat([latents, latents]),
            torch.cat([sigma, sigma]),
            Condition.cat([uncondition, condition]),
            module=module,
            parameters=parameters,
        )
        v_uncond, v_cond = both.chunk(2)
        return v_uncond + guidance_scale * (v_cond - v_uncond)

    # ---------------------------------------------------------------- shared helpers
    def encode_prompt(self, prompts: Sequence[str]) -> Condition:
        """Text conditions for ``prompts``; adapters without text conditioning do not override it.

        Args:
            prompts: one text per row.

        Returns:
            The ``Condition``, one row per prompt.
        """
        raise NotImplementedError(f"{type(self).__name__} has no text conditioning")

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images (uint8 [B, 3, H, W], or float in [0, 1]) -> clean latents x_0 [B, C, H/8, W/8].

        Args:
            images: [B, 3, H, W].

        Returns:
            Clean latents x_0, [B, C, H/8, W/8].
        """
        raise NotImplementedError(f"{type(self).__name__} has no image encoder")

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of one latent; known once ``load_pipeline`` ran.

        Returns:
            ``(C, H, W)``.
        """
        if self._latent_shape is None:
            raise ComponentError(
                f"{type(self).__name__}: call load_pipeline() before asking for latent_shape"
            )
        return self._latent_shape

    def schedule_source(self) -> str:
        """Where the σ schedule comes from besides the step count (the ``derived_from`` of
        ``rollout.timesteps``): the scheduler of ``model.fixture_dir`` and its shift."""
        scheduler = self._require_component("scheduler")
        config = getattr(scheduler, "config", {})  # diffusers' FrozenDict
        how = f"shift={config.get('shift')}" + (" (dynamic)" if config.get("use_dynamic_shifting") else "")
        return f"the scheduler of model.fixture_dir ({type(scheduler).__name__}, {how})"

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The σ schedule [num_steps + 1] from 1 to 0 (diffusers ``FlowMatchEulerDiscreteScheduler``).

        Args:
            num_steps: T.

        Returns:
            σ_0 = 1 > ... > σ_T = 0, [T + 1] fp32.
        """
        scheduler = self._require_component("scheduler")
        scheduler.set_timesteps(num_steps)  # type: ignore[attr-defined]
        return scheduler.sigmas.detach().to(torch.float32).clone()  # type: ignore[attr-defined]

    def check_fixture(self) -> None:
        """``ConfigError`` on ``model.fixture_dir`` unless the fixture directory holds its components:
        a wrong path is one line before loading, not a loader's traceback."""
        where = self.fixture_dir
        if not where.is_dir():
            what = "is not a directory" if where.exists() else "does not exist"
            raise ConfigError(
                "model.fixture_dir",
                f"{where} {what}; point it at a {self.registry_name} fixture or leave it out for the packaged one",
            )
        missing = [name for name in self.fixture_components if not (where / name).is_dir()]
        if missing:
            raise ConfigError(
                "model.fixture_dir",
                f"{where} has no {', '.join(missing)} director{'ies' if len(missing) > 1 else 'y'}; "
                f"a {self.registry_name} fixture has {', '.join(self.fixture_components)}",
            )

    def fixture_latent_shape(self) -> tuple[int, int, int] | None:
        """(C, H, W) of one latent, read from the fixture's configs without loading weights (the
        rollout memory check, ``resources``); ``None`` when the adapter cannot tell before loading."""
        return None

    def fixture_files(self) -> list[Path]:
        """Every weight/config file of the fixture (hashed into the run identity)."""
        return sorted(path for path in self.fixture_dir.rglob("*") if path.is_file())

    def model_configs(self) -> dict[str, dict]:
        """The component configs, as saved in the fixture."""
        configs = {}
        for path in sorted(self.fixture_dir.glob("*/config.json")):
            configs[path.parent.name] = json.loads(path.read_text())
        return configs


def call_module(
    module: nn.Module, parameters: Mapping[str, torch.Tensor] | None, *args: object, **kwargs: object
) -> object:
    """``module(*args, **kwargs)``, with ``parameters`` substituted functionally when given.

    Args:
        module: the module to call.
        parameters: its parameters and buffers to use instead of its own (``functional_call``), or ``None``.
        *args: positional arguments of the call.
        **kwargs: keyword arguments of the call.

    Returns:
        What the module returns.
    """
    if parameters is None:
        return module(*args, **kwargs)
    # snapshot parameters are named as in the unwrapped module, and need no gradient synchronisation
    return torch.func.functional_call(functional_module(module), dict(parameters), args, kwargs, strict=False)


def native_module(module: nn.Module) -> nn.Module:
    """The module a prepared wrapper (DDP, FSDP2's ``ShardedModule``, DeepSpeed's ``EngineModule``) wraps;
    ``module`` itself when it is not wrapped."""
    from reference_trainer.sharding import ShardedModule
    from reference_trainer.zero import EngineModule

    if isinstance(module, nn.parallel.DistributedDataParallel | ShardedModule | EngineModule):
        return module.module
    return module


def functional_module(module: nn.Module) -> nn.Module:
    """The module a functional call with snapshot parameters runs: the unwrapped one, or for a variant
    sharded by FSDP2 its unsharded template (FSDP2's pre-forward hook would swap the live parameters
    back in over the snapshot's). A sharded module reached without its wrapper is refused."""
    from torch.distributed.fsdp import FSDPModule

    from reference_trainer.sharding import ShardedModule

    if isinstance(module, ShardedModule):
        return module.template
    native = native_module(module)
    if isinstance(native, FSDPModule):
        raise TypeError(
            f"a functional call on the sharded {type(native).__name__} would run its live parameters; "
            "pass the routed variant (variants.variant(name)), which carries the unsharded template"
        )
    return native
