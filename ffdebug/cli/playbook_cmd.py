"""`ffdebug playbook list | show | checklist | triage | validate`: the protocols as checklists
(rendering in `report/playbook_text.py`, the command-tree checks in `cli/introspect.py`)."""

from __future__ import annotations

import sys
from typing import Optional

import typer

from ffdebug.report.sink import write_json

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


def _list(json_out: bool) -> None:
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
        write_json({"playbooks": rows})
        return
    from ffdebug.report.playbook_text import print_books_table

    automated = [sum(1 for i in b.items if i.checks) for b in books.values()]
    print_books_table([dict(r, automated=n) for r, n in zip(rows, automated)])


def _triage(flags: dict, answer: list[str], interactive: bool, json_out: bool) -> None:
    """Walk the decision tree with the flags' answers (and --answer Q=V), asking the rest in a
    terminal or with --interactive."""
    from ffdebug.errors import FFDebugError
    from ffdebug.review.triage import load_tree, walk

    answers: dict[str, object] = {}
    for item in answer or []:
        if "=" not in item:
            raise FFDebugError(
                f"--answer {item!r} is invalid: use QUESTION=VALUE, e.g. --answer reference=yes"
            )
        k, v = item.split("=", 1)
        answers[k.strip()] = v.strip()
    answers.update({k: v for k, v in flags.items() if v is not None})
    ask = None
    if interactive or (sys.stdin.isatty() and not json_out):

        def ask(q):
            hint = f" ({q.hint})" if q.hint else ""
            if q.is_choice:
                return typer.prompt(f"{q.ask}{hint} [{'/'.join(q.branches)}]", err=True)
            default = q.default if isinstance(q.default, bool) else None
            return typer.confirm(f"{q.ask}{hint}", default=default, err=True)

    result = walk(load_tree(), answers, ask)
    if json_out:
        write_json(result.to_json())
    else:
        from ffdebug.report.playbook_text import print_triage

        print_triage(result)


def _register_reading(playbook_app: typer.Typer) -> None:
    """list, show, checklist."""

    @playbook_app.command("list", help="List the playbooks: name, kind, sections, items, title.")
    def list_command(json_out: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
        _list(json_out)

    @playbook_app.command("show", help="Print a playbook (or one phase of it) with rationale and commands.")
    def show_command(
        name: str = typer.Argument(..., help="Playbook name (see `ffdebug playbook list`)."),
        phase: Optional[int] = typer.Option(None, "--phase", help="Only this phase."),
        json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
    ) -> None:
        from ffdebug.review.playbooks import load

        book = load(name)
        if json_out:
            write_json(book.to_json(phase))
        else:
            from ffdebug.report.playbook_text import print_book

            print_book(book, phase)

    @playbook_app.command(
        "checklist", help="Print a playbook as a checklist: markdown (ready for a pull request) or JSON."
    )
    def checklist_command(
        name: str = typer.Argument(..., help="Playbook name (see `ffdebug playbook list`)."),
        fmt: str = typer.Option("md", "--format", help="md or json."),
        phase: Optional[int] = typer.Option(None, "--phase", help="Only this phase."),
    ) -> None:
        from ffdebug.errors import FFDebugError
        from ffdebug.report.playbook_text import checklist_json
        from ffdebug.review.playbooks import load, render_markdown

        if fmt not in ("md", "json"):
            raise FFDebugError(f"--format {fmt!r} is invalid: use md or json")
        book = load(name)
        if fmt == "json":
            write_json(checklist_json(book, phase))
        else:
            sys.stdout.write(render_markdown(book, phase))


def _register_triage(playbook_app: typer.Typer) -> None:
    @playbook_app.command("triage", help=TRIAGE_HELP)
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
        _triage(flags, answer, interactive, json_out)


def register(app: typer.Typer) -> None:
    """Add the `playbook` command group to `app`."""
    playbook_app = typer.Typer(help=HELP, no_args_is_help=True, rich_markup_mode="rich")
    app.add_typer(playbook_app, name="playbook")
    _register_reading(playbook_app)
    _register_triage(playbook_app)

    @playbook_app.command(
        "validate", help="Check the playbooks: schema, named commands and options, check ids, triage flags."
    )
    def validate_command(
        json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
    ) -> None:
        from ffdebug.cli.introspect import verify_playbooks

        books = _books()
        problems = verify_playbooks(books)
        if json_out:
            write_json({"passed": not problems, "playbooks": list(books), "problems": problems})
        else:
            from ffdebug.report.playbook_text import print_validation

            print_validation(books, problems)
        raise typer.Exit(1 if problems else 0)
