"""`ffdebug playbook list | show | checklist | triage | validate`: the protocols as checklists."""

from __future__ import annotations

import sys
from typing import Optional

import typer

from ffdebug.cli.common import emit_json, handles_errors

HELP = """The debugging and development protocols, written as data (playbooks/*.yaml).

[bold]Examples[/bold]

  ffdebug playbook list
  ffdebug playbook show dump-bisect --phase 1
  ffdebug playbook checklist pre-commit --format md      # paste into a pull request
  ffdebug playbook triage --symptom wrong-output --deterministic --reference
"""

TRIAGE_HELP = """Walk the quick-start decision tree and print the phase to start at, with the exact commands.

Answer with flags; unanswered questions are asked when run in a terminal (or with --interactive),
else a question with a safe default (e.g. weights not verified) is assumed and reported as assumed.

[bold]Examples[/bold]

  ffdebug playbook triage --symptom wrong-output --deterministic --reference
  ffdebug playbook triage --symptom wrong-output --deterministic --batch-only
  ffdebug playbook triage --symptom training-divergence --deterministic --reference --weights-verified
  ffdebug playbook triage -i
"""


def _books():
    from ffdebug.review.playbooks import load_all

    return load_all()


# ---------------------------------------------------------------------------------------------
# verification of what playbooks name (used by `validate` and by the tests)


def _cli_root(program: str):
    """The click command tree of `program` (ffdebug or reference-trainer)."""
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
        cmd = _cli_root(program)
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

    books = books if books is not None else _books()
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


# ---------------------------------------------------------------------------------------------
# rendering


def _print_book(book, phase: int | None) -> None:
    from rich.console import Console
    from rich.markup import escape

    console = Console(highlight=False)
    console.print(f"[bold]{escape(book.title)}[/bold]  [dim]({book.name}, {book.kind})[/dim]")
    console.print(escape(book.summary))
    if phase is None:
        for label, lines in (
            ("Use when", book.use_when),
            ("Not for", book.not_for),
            ("Sources", book.sources),
        ):
            if lines:
                console.print(f"\n[bold]{label}[/bold]")
                for line in lines:
                    console.print(f"  • {escape(line)}")
    for section in book.select(phase):
        head = f"Phase {section.phase}: {section.title}" if section.phase is not None else section.title
        console.print(f"\n[bold underline]{escape(head)}[/bold underline]")
        for label, value in (
            ("Goal", section.goal),
            ("Move on when", section.done_when),
            ("Time", section.timebox),
        ):
            if value:
                console.print(f"  [bold]{label}:[/bold] {escape(value)}")
        for item in section.items:
            auto = f"  [green]\\[auto: {', '.join(item.checks)}][/green]" if item.checks else ""
            console.print(f"  [ ] {escape(item.text)}{auto} [dim]{item.id}[/dim]")
            console.print(f"      [dim italic]why: {escape(item.why)}[/dim italic]")
            for cmd in item.command:
                console.print(f"      [cyan]$ {escape(cmd)}[/cyan]")


def _checklist_json(book, phase: int | None) -> dict:
    return {
        "playbook": book.name,
        "title": book.title,
        "kind": book.kind,
        "items": [
            {
                "id": item.id,
                "section": section.id,
                "phase": section.phase,
                "text": item.text,
                "why": item.why,
                "command": list(item.command),
                "check": list(item.checks),
                "done": False,
            }
            for section in book.select(phase)
            for item in section.items
        ],
    }


def _print_triage(result) -> None:
    from rich.console import Console
    from rich.markup import escape

    console = Console(highlight=False)
    console.print(f"[bold]Start at:[/bold] {escape(result.title)}")
    console.print(f"  {escape(result.outcome.say)}")
    shown = []
    for s in result.steps:
        value = s.answer if isinstance(s.answer, str) else ("yes" if s.answer else "no")
        note = (
            f" [dim](assumed; pass --{s.flag if s.answer is False else 'no-' + s.flag} to change)[/dim]"
            if s.how == "assumed"
            else ""
        )
        shown.append(f"{s.flag}={value}{note}")
    console.print("[bold]Answers:[/bold] " + ", ".join(shown))
    if result.goal:
        console.print(f"[bold]Goal:[/bold] {escape(result.goal)}")
    if result.done_when:
        console.print(f"[bold]Move on when:[/bold] {escape(result.done_when)}")
    if result.commands:
        console.print("[bold]Commands:[/bold]")
        for cmd in result.commands:
            console.print(f"  [cyan]$ {escape(cmd)}[/cyan]")
    if result.next_phases:
        console.print("[bold]Then:[/bold] " + "; ".join(escape(p) for p in result.next_phases))
    o = result.outcome
    where = f" --phase {o.phase}" if o.phase is not None else ""
    console.print(f"[dim]Details: ffdebug playbook show {o.playbook}{where}[/dim]")


# ---------------------------------------------------------------------------------------------
# commands


def register(app: typer.Typer) -> None:
    """Add the `playbook` command group to `app`."""
    playbook_app = typer.Typer(help=HELP, no_args_is_help=True, rich_markup_mode="rich")
    app.add_typer(playbook_app, name="playbook")

    @playbook_app.command("list", help="List the playbooks: name, kind, sections, items, title.")
    @handles_errors
    def list_command(json_out: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
        books = _books()
        rows = [
            {
                "name": b.name,
                "title": b.title,
                "kind": b.kind,
                "sections": len(b.sections),
                "items": len(b.items),
                "phases": b.phases,
                "checks": sorted({c for i in b.items for c in i.checks}),
            }
            for b in books.values()
        ]
        if json_out:
            emit_json({"playbooks": rows})
            return
        from rich.console import Console
        from rich.table import Table

        table = Table(header_style="bold")
        for col in ("name", "kind", "sections", "items", "automated", "title"):
            table.add_column(col, justify="right" if col in ("sections", "items", "automated") else "left")
        for r, b in zip(rows, books.values()):
            auto = sum(1 for i in b.items if i.checks)
            table.add_row(r["name"], r["kind"], str(r["sections"]), str(r["items"]), str(auto), r["title"])
        Console().print(table)

    @playbook_app.command("show", help="Print a playbook (or one phase of it) with rationale and commands.")
    @handles_errors
    def show_command(
        name: str = typer.Argument(..., help="Playbook name (see `ffdebug playbook list`)."),
        phase: Optional[int] = typer.Option(None, "--phase", help="Only this phase."),
        json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
    ) -> None:
        from ffdebug.review.playbooks import load

        book = load(name)
        if json_out:
            emit_json(book.to_json(phase))
        else:
            _print_book(book, phase)

    @playbook_app.command(
        "checklist", help="Print a playbook as a checklist: markdown (ready for a pull request) or JSON."
    )
    @handles_errors
    def checklist_command(
        name: str = typer.Argument(..., help="Playbook name (see `ffdebug playbook list`)."),
        fmt: str = typer.Option("md", "--format", help="md or json."),
        phase: Optional[int] = typer.Option(None, "--phase", help="Only this phase."),
    ) -> None:
        from ffdebug.errors import FFDebugError
        from ffdebug.review.playbooks import load, render_markdown

        if fmt not in ("md", "json"):
            raise FFDebugError(f"--format {fmt!r} is invalid: use md or json")
        book = load(name)
        if fmt == "json":
            emit_json(_checklist_json(book, phase))
        else:
            sys.stdout.write(render_markdown(book, phase))

    @playbook_app.command("triage", help=TRIAGE_HELP)
    @handles_errors
    def triage_command(
        symptom: Optional[str] = typer.Option(
            None, "--symptom", help="crash, wrong-output or training-divergence."
        ),
        local: Optional[bool] = typer.Option(
            None, "--local/--no-local", help="Crash: reproducible, one rank, one owner?"
        ),
        deterministic: Optional[bool] = typer.Option(
            None, "--deterministic/--no-deterministic", help="Same input, same output, run after run?"
        ),
        batch_only: Optional[bool] = typer.Option(
            None, "--batch-only/--no-batch-only", help="Single prompt right, wrong only when batched?"
        ),
        reference: Optional[bool] = typer.Option(
            None, "--reference/--no-reference", help="A verified reference (model or trainer run) exists?"
        ),
        weights_verified: Optional[bool] = typer.Option(
            None, "--weights-verified/--no-weights-verified", help="weights-diff / load-audit already clean?"
        ),
        dumps_agree: Optional[bool] = typer.Option(
            None, "--dumps-agree/--no-dumps-agree", help="Both sides dump the same stage names?"
        ),
        layer_known: Optional[bool] = typer.Option(
            None, "--layer-known/--no-layer-known", help="First layer introducing error known?"
        ),
        substage_known: Optional[bool] = typer.Option(
            None, "--substage-known/--no-substage-known", help="Sub-stage inside the layer known?"
        ),
        fix_ready: Optional[bool] = typer.Option(
            None, "--fix-ready/--no-fix-ready", help="Candidate fixes to verify?"
        ),
        step_known: Optional[bool] = typer.Option(
            None, "--step-known/--no-step-known", help="Trainer: first divergent optimizer step known?"
        ),
        answer: list[str] = typer.Option(
            None, "--answer", "-a", help="QUESTION=VALUE for any question (repeatable)."
        ),
        interactive: bool = typer.Option(False, "--interactive", "-i", help="Ask every unanswered question."),
        json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
    ) -> None:
        from ffdebug.errors import FFDebugError
        from ffdebug.review.triage import load_tree, walk

        tree = load_tree()
        answers: dict[str, object] = {}
        for item in answer or []:
            if "=" not in item:
                raise FFDebugError(
                    f"--answer {item!r} is invalid: use QUESTION=VALUE, e.g. --answer reference=yes"
                )
            k, v = item.split("=", 1)
            answers[k.strip()] = v.strip()
        flags = {
            "symptom": symptom,
            "local": local,
            "deterministic": deterministic,
            "batch-only": batch_only,
            "reference": reference,
            "weights-verified": weights_verified,
            "dumps-agree": dumps_agree,
            "layer-known": layer_known,
            "substage-known": substage_known,
            "fix-ready": fix_ready,
            "step-known": step_known,
        }
        answers.update({k: v for k, v in flags.items() if v is not None})
        ask = None
        if interactive or (sys.stdin.isatty() and not json_out):

            def ask(q):
                hint = f" ({q.hint})" if q.hint else ""
                if q.is_choice:
                    return typer.prompt(f"{q.ask}{hint} [{'/'.join(q.branches)}]", err=True)
                default = q.default if isinstance(q.default, bool) else None
                return typer.confirm(f"{q.ask}{hint}", default=default, err=True)

        result = walk(tree, answers, ask)
        if json_out:
            emit_json(result.to_json())
        else:
            _print_triage(result)

    @playbook_app.command(
        "validate", help="Check the playbooks: schema, named commands and options, check ids, triage flags."
    )
    @handles_errors
    def validate_command(
        json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
    ) -> None:
        books = _books()
        problems = verify_playbooks(books)
        if json_out:
            emit_json({"passed": not problems, "playbooks": list(books), "problems": problems})
        else:
            for p in problems:
                print(p)
            word = "PASSED" if not problems else "FAILED"
            print(
                f"{len(books)} playbooks, {sum(len(b.items) for b in books.values())} items: {len(problems)} problem(s). {word}"
            )
        raise typer.Exit(1 if problems else 0)
