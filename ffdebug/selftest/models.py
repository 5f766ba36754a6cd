"""Which model a selftest spec names, and the tiny seeded copy of it that the cases run.

A spec is one of (tried in this order):

- a path to a `config.json`, or to a directory holding one (a checkpoint folder: only its config is read);
- a transformers class name: a config class (`Qwen2Config`) or a model class (`Qwen2ForCausalLM`,
  `T5ForConditionalGeneration`, `ViTForImageClassification`);
- a diffusers denoiser class name (`SD3Transformer2DModel`, `UNet2DConditionModel`), or a diffusers
  `config.json` (it names its `_class_name`);
- a transformers `model_type` (`qwen2`, `gemma3_text`, `t5`);
- a model id in the local Hugging Face cache (`Qwen/Qwen2-0.5B`; never downloaded: `HF_HUB_OFFLINE`).

A model class is built as itself; a transformers config as the first family that knows it
(`families.model_class_for`: causal LM, then encoder-decoder LM, then image classifier; a multimodal
config's text model), shrunk by `shrink.shrink` (diffusers: `diffusers_zoo.shrink`), seeded, in eval
mode, float32, eager attention. Anything that cannot be resolved or built is a `SelftestError` naming
the spec and why (exit 2).
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ffdebug.errors import FFDebugError, short_reason
from ffdebug.selftest import diffusers_zoo
from ffdebug.selftest.families import CAUSAL_LM, DIFFUSERS, family_of_class, model_class_for
from ffdebug.selftest.shrink import Sizes, shrink

MAX_PARAMETERS = 20_000_000  # a shrunk model is about 0.2-1 M; more means a size field was missed


class SelftestError(FFDebugError):
    """A spec that names no model, or a model the shrinker cannot build (exit 2)."""


@dataclass(frozen=True)
class ModelSpec:
    """A resolved spec: the name to report, its config (full size) and the model class to build."""

    name: str
    config: Any = field(repr=False)  # a transformers config, or a diffusers model's keyword arguments
    model_class: Any = field(repr=False)
    family: str = CAUSAL_LM

    @property
    def model_type(self) -> str:
        if self.family == DIFFUSERS:
            return self.model_class.__name__
        return str(getattr(self.config, "model_type", "") or "")

    def shrunk(self, sizes: Sizes | None = None) -> tuple[Any, list[str]]:
        """(the tiny config, what changed)."""
        if self.family == DIFFUSERS:
            return diffusers_zoo.shrink(self.config)
        out = shrink(self.config, sizes)
        return out.config, out.changes


def _quiet_transformers() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", module="transformers")


def _model_class(config: Any, name: str) -> tuple[str, Any, Any]:
    """(family, config, class) for a transformers `config` (`families.model_class_for`)."""
    found = model_class_for(config)
    if found is None:
        raise SelftestError(
            f"{name}: {type(config).__name__} maps to no causal LM, encoder-decoder LM or image "
            "classification class in transformers (give the config of one, or a model class name)"
        )
    return found


def _from_class_name(spec: str) -> Any | None:
    """The default config of a transformers config or model class named `spec`, else None."""
    import transformers

    obj = getattr(transformers, spec, None) if spec.isidentifier() else None
    if obj is None:
        return None
    from transformers import PretrainedConfig

    config_class = (
        obj
        if isinstance(obj, type) and issubclass(obj, PretrainedConfig)
        else getattr(obj, "config_class", None)
    )
    if isinstance(config_class, type) and issubclass(config_class, PretrainedConfig):
        try:
            return config_class()
        except Exception as e:  # noqa: BLE001 - a foreign constructor: its reason, in one line
            raise SelftestError(
                f"{spec}: its default config does not build ({short_reason(e, 160)})"
            ) from None
    raise SelftestError(f"{spec}: a transformers name, but neither a config nor a model class")


def resolve(spec: str) -> ModelSpec:
    """The `ModelSpec` of `spec` (module docstring), else `SelftestError`."""
    _quiet_transformers()
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    path = Path(spec)
    config: PretrainedConfig | None = None
    denoiser = diffusers_zoo.model_class(spec)
    if denoiser is not None:
        return ModelSpec(spec, diffusers_zoo.default_config(denoiser), denoiser, DIFFUSERS)
    if path.is_file() or (path.is_dir() and (path / "config.json").is_file()):
        file = path if path.is_file() else path / "config.json"
        try:
            raw = json.loads(file.read_text())
        except (OSError, ValueError) as e:
            raise SelftestError(f"{file}: not a readable JSON config ({e})") from None
        if isinstance(raw, dict) and isinstance(raw.get("_class_name"), str):
            return _diffusers_file(file, raw)
        model_type = raw.get("model_type") if isinstance(raw, dict) else None
        if model_type not in CONFIG_MAPPING:
            raise SelftestError(f"{file}: model_type {model_type!r} is not one transformers knows")
        config = CONFIG_MAPPING[model_type].from_dict(raw)
    elif path.exists():
        raise SelftestError(f"{spec}: no config.json there; give a config file or a checkpoint directory")
    if config is None:
        config = _from_class_name(spec)
    if config is None and spec in CONFIG_MAPPING:
        try:
            config = CONFIG_MAPPING[spec]()
        except Exception as e:  # noqa: BLE001 - a foreign constructor: its reason, in one line
            raise SelftestError(
                f"{spec}: transformers' default config does not build ({short_reason(e, 160)})"
            ) from None
    if config is None and "/" in spec:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            config = AutoConfig.from_pretrained(spec, local_files_only=True)
        except Exception as e:  # noqa: BLE001 - the hub's errors vary; one line says what was tried
            raise SelftestError(
                f"{spec}: not in the local Hugging Face cache (selftest never downloads; {type(e).__name__})"
            ) from None
    if config is None:
        raise SelftestError(
            f"{spec}: not a config file, a transformers class name, a model_type or a cached model id "
            "(e.g. qwen2, LlamaForCausalLM, path/to/config.json)"
        )
    import transformers

    named = getattr(transformers, spec, None) if spec.isidentifier() else None
    family = family_of_class(named) if isinstance(named, type) else None
    if family is not None:  # a model class: built as itself
        return ModelSpec(spec, config, named, family)
    family, config, model_class = _model_class(config, spec)
    return ModelSpec(spec, config, model_class, family)


def _diffusers_file(file: Path, raw: dict) -> ModelSpec:
    """A diffusers config.json: its class, and its keyword arguments over the class defaults."""
    cls = diffusers_zoo.model_class(raw["_class_name"])
    if cls is None:
        raise SelftestError(
            f"{file}: _class_name {raw['_class_name']!r} is not a diffusers transformer or UNet"
        )
    config = diffusers_zoo.default_config(cls)
    config.update({k: v for k, v in raw.items() if k in config})
    return ModelSpec(str(file), config, cls, DIFFUSERS)


def _check_tiny(spec: ModelSpec, model: Any) -> None:
    """SelftestError when `model` has more parameters than the cap (a size field the shrinker missed)."""
    parameters = sum(p.numel() for p in model.parameters())
    if parameters > MAX_PARAMETERS:
        raise SelftestError(
            f"{spec.name}: not tiny after shrinking ({parameters:,} parameters, the cap is {MAX_PARAMETERS:,}): "
            "a size field the shrinker does not know"
        )


def _refuse_large(spec: ModelSpec, construct) -> None:
    """Check the size on the meta device (no memory) before the model is allocated: a size field
    the shrinker missed can make a model of billions of parameters, which would exhaust the
    machine's memory before the check after the build. A constructor that does not run on the meta
    device is built for real and checked after."""
    import torch

    try:
        with torch.device("meta"):
            model = construct()
    except Exception:  # noqa: BLE001 - a constructor that needs real tensors: checked after the build
        return
    _check_tiny(spec, model)


def build(spec: ModelSpec, sizes: Sizes | None = None, seed: int = 0, attn: str = "eager") -> Any:
    """The tiny seeded model of `spec` (float32, eval, `attn` attention), else `SelftestError` naming
    why the shrunk config does not build."""
    import torch

    torch.manual_seed(seed)
    try:
        shrunk, _ = spec.shrunk(sizes)

        def construct():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if spec.family == DIFFUSERS:
                    return spec.model_class(**shrunk)
                return spec.model_class._from_config(shrunk, attn_implementation=attn)

        _refuse_large(spec, construct)
        torch.manual_seed(seed)
        model = construct()
    except SelftestError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of a foreign constructor is "cannot build"
        raise SelftestError(
            f"{spec.name}: the shrunk config does not build ({type(e).__name__}: {short_reason(e, 160)})"
        ) from None
    _check_tiny(spec, model)
    return model.float().eval()
