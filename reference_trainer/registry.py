"""Registries: trainers with their TrainingArguments, and model adapters, each keyed by a short name.

One decorator registers a trainer and its arguments together::

    @register_trainer("grpo", arguments=GRPOArguments)
    class GRPOTrainer(BaseTrainer): ...

Both classes keep declaring their own ``execution_contract`` (``reference_trainer.contracts``); the
pair is checked for equality before any model loads (``run.build_trainer``) and statically by
``ffdebug review`` (``trainer-contract-match``). The list of trainers is *derived* from the registries,
never hard-coded (``trainer_names``); a name registered on one side only (possible only by editing the
tables directly) is an error that ``resolve_trainer`` reports. Built-in trainers and adapters register
themselves when their modules are imported; ``load_builtins`` imports every module of
``reference_trainer.trainers`` and ``reference_trainer.adapters`` (discovered with ``pkgutil``), so a
new algorithm file is picked up by being added to that package.

Rewards have their own registry in ``reference_trainer.rewards``.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

TRAINERS: dict[str, type] = {}
ARGUMENTS: dict[str, type] = {}
ADAPTERS: dict[str, type] = {}


class RegistryError(KeyError):
    """Unknown or half-registered name."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


def _check_free(table: dict[str, type], kind: str, name: str, cls: type) -> None:
    existing = table.get(name)
    if existing is not None and existing is not cls:
        raise RegistryError(f"{kind} {name!r} is already registered to {existing.__qualname__}")


def _register(table: dict[str, type], name: str, cls: type) -> None:
    table[name] = cls
    cls.registry_name = name  # type: ignore[attr-defined]


def register_trainer(name: str, *, arguments: type) -> Callable[[type[T]], type[T]]:
    """Class decorator: register a ``BaseTrainer`` subclass under ``name`` together with ``arguments``,
    the TrainingArguments dataclass its ``train:`` section is parsed into (module docstring).

    Args:
        name: the trainer's name (the config's ``trainer:``).
        arguments: its TrainingArguments class.

    Returns:
        The class decorator (it returns the class unchanged).
    """
    if not isinstance(arguments, type):
        raise RegistryError(
            f"trainer {name!r}: arguments= must be a TrainingArguments class, got {arguments!r}"
        )

    def decorator(cls: type[T]) -> type[T]:
        _check_free(TRAINERS, "trainer", name, cls)
        _check_free(ARGUMENTS, "arguments", name, arguments)
        _register(TRAINERS, name, cls)
        _register(ARGUMENTS, name, arguments)
        return cls

    return decorator


def register_adapter(name: str) -> Callable[[type[T]], type[T]]:
    """Class decorator: register a ``BaseAdapter`` subclass under ``name``.

    Args:
        name: the adapter's name (the config's ``model.adapter``).

    Returns:
        The class decorator (it returns the class unchanged).
    """

    def decorator(cls: type[T]) -> type[T]:
        _check_free(ADAPTERS, "adapter", name, cls)
        _register(ADAPTERS, name, cls)
        return cls

    return decorator


def load_builtins() -> None:
    """Import every module of the built-in trainer and adapter packages so they register."""
    for package_name in ("reference_trainer.adapters", "reference_trainer.trainers"):
        package = importlib.import_module(package_name)
        for module in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{package_name}.{module.name}")


def trainer_names() -> list[str]:
    """Names registered as both a trainer and a TrainingArguments class, sorted.

    Returns:
        The sorted trainer names.
    """
    load_builtins()
    return sorted(set(TRAINERS) & set(ARGUMENTS))


def resolve_trainer(name: str) -> tuple[type, type]:
    """Return ``(trainer_class, arguments_class)`` for ``name``; error if either side is missing.

    Args:
        name: a registered trainer name.

    Returns:
        ``(trainer_class, arguments_class)``.
    """
    load_builtins()
    trainer_cls, arguments_cls = TRAINERS.get(name), ARGUMENTS.get(name)
    if trainer_cls is None and arguments_cls is None:
        raise RegistryError(f"unknown trainer {name!r}; registered trainers: {', '.join(trainer_names())}")
    if trainer_cls is None or arguments_cls is None:
        missing = "trainer class" if trainer_cls is None else "TrainingArguments class"
        raise RegistryError(f"trainer {name!r} has no registered {missing}")
    return trainer_cls, arguments_cls


def resolve_adapter(name: str) -> type:
    """Return the adapter class registered as ``name``.

    Args:
        name: a registered adapter name.

    Returns:
        The adapter class.
    """
    load_builtins()
    if name not in ADAPTERS:
        raise RegistryError(f"unknown adapter {name!r}; registered adapters: {', '.join(sorted(ADAPTERS))}")
    return ADAPTERS[name]


def describe_registries() -> dict[str, Any]:
    """Everything ``reference-trainer list`` shows: trainers with their contracts and roles, adapters.

    Returns:
        ``{"trainers": [{name, contract, roles, arguments}, ...], "adapters": [names]}``.
    """
    trainers = []
    for name in trainer_names():
        trainer_cls, arguments_cls = TRAINERS[name], ARGUMENTS[name]
        trainers.append(
            {
                "name": name,
                "contract": trainer_cls.execution_contract.describe(),
                "roles": list(trainer_cls.roles),
                "arguments": arguments_cls.__qualname__,
            }
        )
    return {"trainers": trainers, "adapters": sorted(ADAPTERS)}
