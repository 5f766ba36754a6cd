"""`ffdebug review`: the automated checks, printed as the pre-commit checklist."""

from __future__ import annotations

from typing import Optional

import typer

HELP = """Run the automated review checks over Python files and print the pre-commit checklist with
items ticked, failed at file:line with a one-line why, not run, or left for a human. The domain
checks are ffdebug's own (AST); the generic ones run ruff and bandit from this environment
(pip install 'ffdebug\\[review]'), isolated from the project's lint settings.

[bold]Examples[/bold]

  ffdebug review reference_trainer
  ffdebug review --diff main                  # files changed since main, untracked included
  ffdebug review src/ --format md > review.md # paste into a pull request
  ffdebug review --list                       # the checks and their ids

Silence one finding with a comment on its line: `# ffdebug: ignore\\[check-id]`.
Settings: \\[tool.ffdebug.review] in pyproject.toml (license-header, license-scope, license-lines,
disable, exclude, playbook). Exit codes: 0 every enabled check ran and none failed, 1 a check
failed or could not run (ruff / bandit not installed: the line says so), 2 usage error.
"""


def register(app: typer.Typer) -> None:
    """Add the `review` command to `app`."""

    @app.command("review", help=HELP)
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
        from ffdebug.errors import FFDebugError
        from ffdebug.report.review_text import checks_json, print_checks, print_review
        from ffdebug.report.sink import Output
        from ffdebug.review.runner import load_config, review

        out = Output(json=json_out)
        if list_checks:
            out.show(checks_json(), print_checks)
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
        out.show(report, print_review, fmt=fmt)
        raise typer.Exit(0 if report.passed else 1)
