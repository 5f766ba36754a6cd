"""Text output of `ffdebug playbook` (list, show, checklist, triage, validate); rich is imported
inside each printer, so `ffdebug --help` stays fast."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ffdebug.review.playbooks import Playbook
    from ffdebug.review.triage import TriageResult


def print_books_table(rows: list[dict]) -> None:
    """`playbook list`: one row per playbook (`automated`: items a check answers)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(header_style="bold")
    for col in ("name", "kind", "sections", "items", "automated", "title"):
        justify = "right" if col in ("sections", "items", "automated") else "left"
        table.add_column(col, justify=justify, overflow="fold")  # wrapped at 80 columns, never cut
    for r in rows:
        table.add_row(
            r["name"], r["kind"], str(r["sections"]), str(r["items"]), str(r["automated"]), r["title"]
        )
    Console().print(table)


def print_book(book: Playbook, phase: int | None) -> None:
    """`playbook show`: the playbook (or one phase) with each item's why and commands."""
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
                console.print(f"      [cyan]$ {escape(cmd)}[/cyan]", soft_wrap=True)  # one line to copy


def checklist_json(book: Playbook, phase: int | None) -> dict:
    """`playbook checklist --format json`: every item of the selected sections, not done."""
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


def print_triage(result: TriageResult) -> None:
    """`playbook triage`: the phase to start at, the answers (assumed ones marked), the commands."""
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
            console.print(f"  [cyan]$ {escape(cmd)}[/cyan]", soft_wrap=True)  # one line to copy
    if result.next_phases:
        console.print("[bold]Then:[/bold] " + "; ".join(escape(p) for p in result.next_phases))
    o = result.outcome
    where = f" --phase {o.phase}" if o.phase is not None else ""
    console.print(f"[dim]Details: ffdebug playbook show {o.playbook}{where}[/dim]")


def print_validation(books: dict, problems: list[str]) -> None:
    """`playbook validate`: each problem, then a closing line."""
    for p in problems:
        print(p)
    word = "PASSED" if not problems else "FAILED"
    items = sum(len(b.items) for b in books.values())
    print(f"{len(books)} playbooks, {items} items: {len(problems)} problem(s). {word}")
