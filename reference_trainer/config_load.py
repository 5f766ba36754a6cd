"""Loading a run configuration: YAML file -> ``--set`` overrides -> validated ``RunConfig``.

The file is read with a ``yaml.SafeLoader`` that refuses a key given twice (``parse_yaml``; libyaml's
parser when PyYAML has it, PyYAML's own for the error message); ``apply_overrides`` sets dotted keys
on the raw mapping; ``parse_run_config`` validates it, ``train:`` with the trainer's TrainingArguments
class; ``load_config`` does all of it (format: the ``reference_trainer.config`` docstring).
"""

from __future__ import annotations

import copy
import dataclasses
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from reference_trainer.config_parse import _describe, check_rewards, parse_dataclass, parse_value
from reference_trainer.config_schema import FSDP1_ONLY_FIELDS, RunConfig
from reference_trainer.errors import ConfigError


class _NoDuplicateKeys:
    """A loader mixin that refuses a key given twice in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            if not isinstance(key, typing.Hashable):
                continue  # SafeLoader itself refuses an unhashable key
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"key {key!r} is given twice",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)  # type: ignore[misc]


class _StrictLoader(_NoDuplicateKeys, yaml.SafeLoader):
    """``yaml.SafeLoader`` without duplicate keys: PyYAML's own parser, whose error messages the
    config errors quote."""


class _FastStrictLoader(_NoDuplicateKeys, getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """The same loader on libyaml's parser when PyYAML has it (several times faster; the same
    safe constructor and resolver, so the same values); a document it refuses is re-read by
    ``_StrictLoader`` for the error message."""


def _yaml_problem(error: yaml.YAMLError) -> tuple[str, str]:
    """(``line:column`` or "", the problem in one line) of a PyYAML error."""
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    where = f"{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
    if isinstance(error, yaml.reader.ReaderError):
        where = f"byte {error.position}"
        problem = f"unacceptable character #x{error.character:04x}: {error.reason}"
    else:
        parts = [getattr(error, "context", None), getattr(error, "problem", None)]
        problem = "; ".join(part for part in parts if part) or str(error)
    return where, " ".join(problem.split())


def parse_yaml(text: str, where: str) -> Any:
    """``text`` as YAML (safe, no duplicate keys); a ``ConfigError`` naming ``where`` and the line."""
    try:
        return yaml.load(text, Loader=_FastStrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError:
        pass  # the message comes from PyYAML's own parser, the same with or without libyaml
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as error:
        position, problem = _yaml_problem(error)
        hint = " (YAML indents with spaces, never tabs)" if "'\\t'" in problem else ""
        raise ConfigError("", f"{where}{':' + position if position else ''}: {problem}{hint}") from None


def apply_overrides(raw: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Apply ``dotted.key=value`` overrides to a raw config mapping (returns a new mapping)."""
    result = copy.deepcopy(dict(raw))  # the caller's mapping is left as it was
    for override in overrides:
        key, sep, text = override.partition("=")
        if not sep or not key:
            raise ConfigError("--set", f"expected dotted.key=value, got {override!r}")
        value = parse_yaml(text, f"--set {key}")
        node: Any = result
        parts = key.split(".")
        for depth, part in enumerate(parts):
            last = depth == len(parts) - 1
            if isinstance(node, list):  # ``optimizers.0.lr=...`` indexes a list
                if not part.isdigit() or int(part) >= len(node):
                    where = ".".join(parts[: depth + 1])
                    raise ConfigError(where, f"is not an index of a list of {len(node)} entries")
                if last:
                    node[int(part)] = value
                else:
                    node = node[int(part)]
            elif isinstance(node, dict):
                if last:
                    node[part] = value
                else:
                    node = node.setdefault(part, {})
            else:
                where = ".".join(parts[:depth])
                raise ConfigError(where, "is not a mapping or a list; cannot set a key inside it")
    return result


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping from ``path`` (every failure is one ``ConfigError`` naming the file)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("", f"config file not found: {path}")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            "", f"{path}: not a UTF-8 text file (byte {error.start}); give a YAML config"
        ) from None
    parsed = parse_yaml(text, str(path))
    if not isinstance(parsed, dict):
        raise ConfigError(
            "", f"{path}: the top level must be a mapping of config fields, got {_describe(parsed)}"
        )
    return parsed


def parse_run_config(raw: Mapping[str, Any], arguments_cls: type) -> RunConfig:
    """Validate a raw mapping into a ``RunConfig``; ``train:`` is parsed with ``arguments_cls``."""
    if not isinstance(raw, Mapping):
        raise ConfigError("", "the config must be a mapping")
    data = dict(raw)
    backend = data.get("backend")
    if isinstance(backend, Mapping):
        for name in FSDP1_ONLY_FIELDS:
            if name in backend:
                raise ConfigError(
                    f"backend.{name}",
                    "is an FSDP1 option and FSDP1 is refused; fsdp2 shards per parameter and has no such field",
                )
    train = parse_dataclass(arguments_cls, data.pop("train", {}) or {}, "train")
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    unknown = sorted(set(data) - fields, key=str)
    if unknown:
        raise ConfigError(
            str(unknown[0]), f"unknown top-level field; valid fields: {', '.join(sorted(fields))}"
        )
    hints = typing.get_type_hints(RunConfig)
    kwargs: dict[str, Any] = {"train": train}
    for spec in dataclasses.fields(RunConfig):
        if spec.name == "train":
            continue
        if spec.name in data:
            kwargs[spec.name] = parse_value(hints[spec.name], data[spec.name], spec.name)
        elif spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
            raise ConfigError(spec.name, "required field is missing")
    try:
        return RunConfig(**kwargs)
    except ConfigError as error:
        raise ConfigError(error.field, error.message) from None


def load_config(
    path: str | Path | None = None,
    *,
    raw: Mapping[str, Any] | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    max_steps: int | None = None,
) -> RunConfig:
    """Load a config file (or a raw mapping), apply overrides, and validate it.

    The trainer name selects the TrainingArguments class from the registry; the contract equality
    between trainer and arguments is checked later, by ``build_run``, still before any model loads.
    """
    from reference_trainer.registry import resolve_trainer

    data = dict(raw) if raw is not None else read_yaml(path)  # type: ignore[arg-type]
    data = apply_overrides(data, overrides)
    if max_steps is not None:
        data["max_steps"] = max_steps
    trainer_name = data.get("trainer")
    if not isinstance(trainer_name, str):
        raise ConfigError("trainer", f"required string field is missing or invalid: {trainer_name!r}")
    try:
        _, arguments_cls = resolve_trainer(trainer_name)
    except KeyError as error:
        raise ConfigError("trainer", str(error)) from None
    config = parse_run_config(data, arguments_cls)
    check_rewards(config)
    return config
