"""`ffdebug review`: the automated checks, printed as the pre-commit checklist."""

from __future__ import annotations

from typing import Optional

import typer

from ffdebug.cli.common import emit_json, handles_errors

HELP = """Run the automated review checks (AST-based) over Python files and print the pre-commit
checklist with items ticked, failed at file:line with a one-line why, or left for a human.

[bold]Examples[/bold]

  ffdebug review reference_trainer
  ffdebug review --diff main                  # files changed since main, untracked included
  ffdebug review src/ --format md > review.md # paste into a pull request
  ffdebug review --list                       # the checks and their ids

Silence one finding with a comment on its line: `# ffdebug: ignore[check-id]`.
Settings: [tool.ffdebug.review] in pyproject.toml (license-header, license-scope, license-lines,
disable, exclude, playbook). Exit codes: 0 no check failed, 1 a check failed, 2 usage error.
"""

_MARK = {"ticked": "[green]✓[/green]", "failed": "[red]✗[/red]", "human": "☐", "skipped": "[dim]–[/dim]"}


def _print_checks_list(json_out: bool) -> None:
    from ffdebug.review.checks import CHECKS

    if json_out:
        emit_json(
            {
                "checks": [
                    {"id": c.id, "title": c.title, "why": c.why, "scope": c.scope} for c in CHECKS.values()
                ]
            }
        )
        return
    from rich.console import Console
    from rich.markup import escape

    console = Console(highlight=False)
    for c in CHECKS.values():
        console.print(f"[bold]{c.id}[/bold]  {escape(c.title)}")
        console.print(f"    [dim]{escape(c.why)}[/dim]")


def _print_report(report) -> None:
    from rich.console import Console
    from rich.markup import escape

    from ffdebug.review.playbooks import load

    console = Console(highlight=False)
    book = load(report.playbook)
    scope = f"changed since {report.base}" if report.base else "given paths"
    console.print(
        f"[bold]ffdebug review[/bold]: {len(report.files)} file(s) ({scope}), {len(report.checks_run)} check(s), "
        f"checklist [bold]{book.name}[/bold]"
    )
    commands = {i.id: i.command for i in book.items}
    listed: set = set()
    for item in report.checklist:
        tag = f" [dim]\\[{', '.join(item.checks)}][/dim]" if item.checks else " [dim](for a human)[/dim]"
        console.print(f" {_MARK[item.status]} {escape(item.text)}{tag}")
        if item.status == "skipped":
            reasons = {report.skipped[c] for c in item.checks if c in report.skipped}
            console.print(f"     [dim]skipped: {escape('; '.join(sorted(reasons)))}[/dim]")
        for f in item.findings:
            listed.add(f)
            console.print(f"     [red]{escape(f.location)}[/red]  {escape(f.message)}")
        if item.status == "human":
            for cmd in commands.get(item.id, ()):
                console.print(f"     [cyan]$ {escape(cmd)}[/cyan]")
    others = [f for f in report.findings if f not in listed]
    if others:
        console.print(" [red]✗[/red] Checks outside this checklist")
        for f in others:
            console.print(f"     [red]{escape(f.location)}[/red]  [{f.check}] {escape(f.message)}")
    human = sum(1 for i in report.checklist if i.status == "human")
    note = f" ({report.suppressed} suppressed)" if report.suppressed else ""
    if report.passed:
        console.print(f"No automated check failed{note}; {human} item(s) left for a human. PASSED")
    else:
        files = len({f.path for f in report.findings})
        console.print(
            f"{len(report.findings)} finding(s) in {files} file(s){note}; {human} item(s) left for a human. FAILED"
        )


def _markdown(report) -> str:
    from ffdebug.review.playbooks import load

    book = load(report.playbook)
    lines = [f"## {book.title} (ffdebug review)", ""]
    for item in report.checklist:
        box = "x" if item.status == "ticked" else " "
        if item.status == "ticked":
            note = f" _(auto: {', '.join(f'`{c}`' for c in item.checks)})_"
        elif item.status == "failed":
            note = " _(auto: failed)_"
        elif item.status == "skipped":
            note = " _(auto: skipped)_"
        else:
            note = ""
        lines.append(f"- [{box}] {item.text}{note}")
        for f in item.findings:
            lines.append(f"  - `{f.location}` {f.message}")
    verdict = "PASSED" if report.passed else f"FAILED: {len(report.findings)} finding(s)"
    lines += ["", f"{len(report.files)} file(s) reviewed. {verdict}"]
    return "\n".join(lines) + "\n"


def register(app: typer.Typer) -> None:
    """Add the `review` command to `app`."""

    @app.command("review", help=HELP)
    @handles_errors
    def review_command(
        paths: list[str] = typer.Argument(
            None, help="Files or directories (default: the working directory)."
        ),
        diff: Optional[str] = typer.Option(
            None, "--diff", help="Review the files changed since this git revision."
        ),
        fmt: str = typer.Option("text", "--format", help="text or md."),
        playbook: Optional[str] = typer.Option(
            None, "--playbook", help="Checklist to fill in (default pre-commit)."
        ),
        disable: list[str] = typer.Option(None, "--disable", help="Check id to skip (repeatable)."),
        license_header: Optional[str] = typer.Option(
            None, "--license-header", help="Required header text (overrides pyproject)."
        ),
        list_checks: bool = typer.Option(False, "--list", help="List the checks and exit."),
        json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
    ) -> None:
        import sys

        from ffdebug.errors import FFDebugError
        from ffdebug.review.runner import load_config, review

        if list_checks:
            _print_checks_list(json_out)
            return
        if fmt not in ("text", "md"):
            raise FFDebugError(f"--format {fmt!r} is invalid: use text or md")
        config = load_config()
        if playbook:
            config.playbook = playbook
        if disable:
            config.disable |= set(disable)
        if license_header:
            config.license_header = license_header
        report = review(list(paths or []), diff, config)
        if json_out:
            emit_json(report.to_json())
        elif fmt == "md":
            sys.stdout.write(_markdown(report))
        else:
            _print_report(report)
        raise typer.Exit(0 if report.passed else 1)
