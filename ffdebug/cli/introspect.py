"""The click command trees of `ffdebug` and `reference-trainer`, read to check what the playbooks
name (`ffdebug playbook validate`, docs/playbooks.md): every command, option and triage flag exists."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typer._click import core as click  # the click typer vendors


@functools.cache
def cli_root(program: str) -> click.Command:
    """The click command tree of `program` (ffdebug or reference-trainer), built once per process:
    typer builds it anew on every call (tens of ms for ffdebug's), and the playbooks name hundreds of
    invocations. Commands are registered at import, so the tree does not change afterwards."""
    import importlib

    import typer.main

    if program == "ffdebug":
        from ffdebug.cli.app import app

        return typer.main.get_command(app)
    try:
        module = importlib.import_module("reference_trainer.cli")
    except ImportError as err:
        raise LookupError(f"reference_trainer.cli cannot be imported ({err})") from None
    target = getattr(module, "app", None)
    if target is None:
        raise LookupError("reference_trainer.cli has no `app`")
    return typer.main.get_command(target) if isinstance(target, typer.Typer) else target


def resolve_invocation(program: str, args: list[str]) -> tuple[list[str], list[str]]:
    """(command path, problems) for one named invocation: unknown subcommands and options."""
    try:
        cmd = cli_root(program)
    except LookupError as err:
        return [program], [str(err)]
    path = [program]
    rest = list(args)
    # Typer vendors its own click; a group is anything with a `commands` mapping.
    while isinstance(getattr(cmd, "commands", None), dict) and rest and not rest[0].startswith("-"):
        name = rest.pop(0)
        sub = cmd.commands.get(name)
        if sub is None:
            return path + [name], [
                f"`{' '.join(path)}` has no command {name!r} (has: {', '.join(sorted(cmd.commands))})"
            ]
        cmd = sub
        path.append(name)
    if isinstance(getattr(cmd, "commands", None), dict):
        return path, [f"`{' '.join(path)}` needs a subcommand"]
    known = {o for p in cmd.params for o in (*p.opts, *getattr(p, "secondary_opts", []))}
    problems = []
    for tok in rest:
        if tok.startswith("--"):
            opt = tok.split("=", 1)[0]
            if opt not in known:
                problems.append(f"`{' '.join(path)}` has no option {opt}")
    return path, problems


def verify_playbooks(books: dict | None = None) -> list[str]:
    """Every problem with what the playbooks name: commands, options, check ids, triage flags."""
    from ffdebug.review.checks import CHECKS
    from ffdebug.review.playbooks import parse_invocations, unknown_checks
    from ffdebug.review.triage import load_tree

    if books is None:
        from ffdebug.review.playbooks import load_all

        books = load_all()
    problems = [f"{b}: {i}: unknown check id {c!r}" for b, i, c in unknown_checks(books, set(CHECKS))]
    for book in books.values():
        for item in book.items:
            for program, args in item.invocations():
                _, bad = resolve_invocation(program, args)
                problems += [f"{book.name}: {item.id}: {p}" for p in bad]
    tree = load_tree()
    for outcome in tree.outcomes.values():
        for line in outcome.commands:
            for program, args in parse_invocations(line):
                _, bad = resolve_invocation(program, args)
                problems += [f"dump-bisect: triage outcome {outcome.id}: {p}" for p in bad]
    _, triage_problems = resolve_invocation(
        "ffdebug", ["playbook", "triage", *(f"--{f}" for f in tree.flags)]
    )
    problems += [
        f"dump-bisect: triage: {p} (add the flag to `ffdebug playbook triage`)" for p in triage_problems
    ]
    return problems
