"""Trainer registry checks (project scope): every trainer registered with its arguments, and the
two declaring the same ExecutionContract."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from ffdebug.review.checks import Finding, at, check
from ffdebug.review.classes import ClassIndex, describe

if TYPE_CHECKING:
    from ffdebug.review.runner import Project


@check(
    "trainer-registered",
    "every concrete trainer is registered, with TrainingArguments under the same name",
    "Trainers are derived from the registries, never from a hard-coded list: an unregistered trainer "
    "is unreachable from configs, and a name registered on one side only fails at run time.",
    scope="project",
)
def check_trainer_registered(project: Project) -> Iterator[Finding]:
    """A concrete BaseTrainer subclass without @register_trainer, or a name registered on one side only."""
    model = ClassIndex(project)
    trainers, arguments = model.registered("trainer"), model.registered("arguments")
    for infos in model.classes.values():
        for info in infos:
            if not project.scanned(info.src):
                continue
            if model.is_trainer(info) and not info.registered.get("trainer") and not info.abstract:
                yield at(
                    "trainer-registered",
                    info.src,
                    info.node,
                    f"trainer {info.node.name} is not registered: add "
                    "@register_trainer(NAME, arguments=ITS_TRAINING_ARGUMENTS)",
                )
            name = info.registered.get("trainer")
            if name and name not in arguments and info.arguments_class is None:
                yield at(
                    "trainer-registered",
                    info.src,
                    info.node,
                    f"trainer {name!r} has no TrainingArguments: register them with "
                    f"@register_trainer({name!r}, arguments=...)",
                )
            name = info.registered.get("arguments")
            if name and name not in trainers:
                yield at(
                    "trainer-registered",
                    info.src,
                    info.node,
                    f"arguments {name!r} ({info.node.name}) have no trainer registered with @register_trainer({name!r})",
                )


@check(
    "trainer-contract-match",
    "a trainer and its TrainingArguments declare the same ExecutionContract",
    "The contract, not the batch contents, decides the execution path; when the two declarations "
    "differ the run is rejected before loading (or, worse, takes the other path where unchecked).",
    scope="project",
)
def check_trainer_contract(project: Project) -> Iterator[Finding]:
    """Registered trainer / arguments pairs whose execution_contract values differ or are missing."""
    model = ClassIndex(project)
    arguments = model.registered("arguments")
    for name, trainer in model.registered("trainer").items():
        args = arguments.get(name)
        if args is None:
            continue  # trainer-registered reports it
        t_value, t_owner = model.contract(trainer)
        a_value, a_owner = model.contract(args)
        for value, info in ((t_value, trainer), (a_value, args)):
            if value is None and project.scanned(info.src):
                yield at(
                    "trainer-contract-match",
                    info.src,
                    info.node,
                    f"{info.node.name} ({name!r}) declares no execution_contract",
                )
        if t_value is None or a_value is None or t_value == a_value:
            continue
        for owner in (a_owner, t_owner):
            if project.scanned(owner.src):
                yield at(
                    "trainer-contract-match",
                    owner.src,
                    owner.contract_node or owner.node,
                    f"{name!r}: trainer {trainer.node.name} declares {describe(t_value)} but "
                    f"{args.node.name} declares {describe(a_value)}",
                )
                break
