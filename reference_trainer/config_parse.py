"""Generic parsing of YAML values into the config dataclasses, naming the field of every error.

``parse_dataclass`` builds a frozen dataclass (``config_schema``, or a trainer's TrainingArguments) from
a mapping: unknown and missing keys are errors, each value is converted to its field's annotation by
``parse_value`` (dataclass, Literal, Optional, tuple, dict, scalar; float fields also take PyYAML's
numeric strings such as ``1e-3`` and must be finite), and an error raised by a ``__post_init__`` gets
the full dotted path. ``check_rewards`` builds every configured reward once, at load.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

from reference_trainer.config_schema import RewardSpec, RunConfig
from reference_trainer.errors import ConfigError


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def parse_value(annotation: Any, value: Any, path: str) -> Any:
    """Convert a YAML value to ``annotation`` (a dataclass, Literal, Optional, tuple, scalar)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if dataclasses.is_dataclass(annotation):
        return parse_dataclass(annotation, value, path)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [arg for arg in args if arg is not type(None)]
        if len(options) != 1:
            raise ConfigError(path, f"unsupported union type {annotation}")
        return parse_value(options[0], value, path)
    if origin is Literal:
        if value not in args:
            raise ConfigError(path, f"must be one of {list(args)}, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(path, f"must be a list, got {_describe(value)}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(parse_value(args[0], item, f"{path}[{i}]") for i, item in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(path, f"must be a list of {len(args)} values, got {len(value)}")
        return tuple(parse_value(arg, item, f"{path}[{i}]") for i, (arg, item) in enumerate(zip(args, value)))
    if origin is dict or annotation is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(path, f"must be a mapping, got {_describe(value)}")
        return dict(value)
    return _parse_scalar(annotation, value, path)


def _parse_scalar(annotation: Any, value: Any, path: str) -> Any:
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"must be true or false, got {_describe(value)}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"must be an integer, got {_describe(value)}")
        return value
    if annotation is float:
        number = _parse_float(value, path)
        if not math.isfinite(number):
            raise ConfigError(path, f"must be a finite number, got {value!r}")
        return number
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"must be a string, got {_describe(value)}")
        return value
    if annotation is Any:
        return value
    raise ConfigError(path, f"unsupported field type {annotation}")


def _parse_float(value: Any, path: str) -> float:
    if isinstance(value, str):  # PyYAML reads 1e-3 as a string (see the module docstring)
        try:
            return float(value)
        except ValueError:
            raise ConfigError(path, f"must be a number, got {_describe(value)}") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(path, f"must be a number, got {_describe(value)}")
    try:
        return float(value)
    except OverflowError:  # an integer beyond the float range
        raise ConfigError(path, f"must be a finite number, got {value!r}") from None


def parse_dataclass(cls: type, data: Any, path: str = "") -> Any:
    """Build the frozen dataclass ``cls`` from a mapping, naming the field of every error."""
    if not isinstance(data, Mapping):
        raise ConfigError(path, f"must be a mapping, got {_describe(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields), key=str)  # YAML keys need not be strings
    if unknown:
        raise ConfigError(
            _join(path, str(unknown[0])), f"unknown field; valid fields: {', '.join(sorted(fields))}"
        )
    kwargs = {}
    for name, spec in fields.items():
        if name in data:
            kwargs[name] = parse_value(hints[name], data[name], _join(path, name))
        elif spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
            raise ConfigError(_join(path, name), "required field is missing")
    try:
        return cls(**kwargs)
    except ConfigError as error:  # __post_init__ names the field relative to ``cls``
        raise ConfigError(_join(path, error.field), error.message) from None


def _reward_specs(value: Any, path: str) -> typing.Iterator[tuple[str, RewardSpec]]:
    """Every ``RewardSpec`` inside a parsed config, with its dotted path (``train.rewards[0]``)."""
    if isinstance(value, RewardSpec):
        yield path, value
    elif dataclasses.is_dataclass(value):
        for spec in dataclasses.fields(value):
            yield from _reward_specs(getattr(value, spec.name), _join(path, spec.name))
    elif isinstance(value, tuple):
        for index, item in enumerate(value):
            yield from _reward_specs(item, f"{path}[{index}]")


def check_rewards(config: RunConfig) -> None:
    """Build every configured reward once: an unknown name or bad kwargs is a ``ConfigError`` at load.

    (Here rather than in ``RewardSpec.__post_init__``: the reward registry imports torch, this module
    does not.)
    """
    from reference_trainer.rewards import check_reward

    for path, spec in _reward_specs(config, ""):
        try:
            check_reward(spec.name, spec.kwargs)
        except ConfigError as error:
            raise ConfigError(_join(path, error.field), error.message) from None
