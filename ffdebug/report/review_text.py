"""`ffdebug review`'s text: the pre-commit checklist with items ticked, failed or left for a human,
as rich text or Markdown (docs/architecture.md "Layers", the report/ row)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ffdebug.review.runner import ReviewReport

_MARK = {
    "ticked": "[green]✓[/green]",
    "failed": "[red]✗[/red]",
    "not-run": "[yellow]?[/yellow]",
    "human": "☐",
    "skipped": "[dim]–[/dim]",
}


def checks_json() -> dict:
    """`ffdebug review --list --json`: every check's id, title, why and scope."""
    from ffdebug.review.checks import CHECKS

    return {
        "checks": [
            {
                "id": c.id,
                "title": c.title,
                "why": c.why,
                "scope": c.scope,
                "tool": c.tool,
                "codes": list(c.codes),
            }
            for c in CHECKS.values()
        ]
    }


def print_checks(listing: dict) -> None:
    """`ffdebug review --list`: one bold id and title per check, its why below."""
    from rich.console import Console
    from rich.markup import escape

    console = Console(highlight=False)
    for c in listing["checks"]:
        rules = f"  [dim]({c['tool']} {', '.join(c['codes'])})[/dim]" if c["tool"] else ""
        console.print(f"[bold]{c['id']}[/bold]  {escape(c['title'])}{rules}")
        console.print(f"    [dim]{escape(c['why'])}[/dim]")


def print_review(report: ReviewReport, fmt: str = "text") -> None:
    """The checklist ticked, failed at file:line or left for a human; `fmt="md"`: as Markdown."""
    if fmt == "md":
        import sys

        sys.stdout.write(review_markdown(report))
        return
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
    for tool in report.tools:
        if tool.error:
            ids = ", ".join(c for c, why in report.not_run.items() if why == tool.error)
            console.print(f"[yellow]{escape(tool.error)}[/yellow] [dim]({ids} not run)[/dim]")
    commands = {i.id: i.command for i in book.items}
    listed: set = set()
    for item in report.checklist:
        tag = f" [dim]\\[{', '.join(item.checks)}][/dim]" if item.checks else " [dim](for a human)[/dim]"
        console.print(f" {_MARK[item.status]} {escape(item.text)}{tag}")
        if item.status == "skipped":
            reasons = {report.skipped[c] for c in item.checks if c in report.skipped}
            console.print(f"     [dim]skipped: {escape('; '.join(sorted(reasons)))}[/dim]")
        if item.status == "not-run":
            reasons = {report.not_run[c] for c in item.checks if c in report.not_run}
            console.print(f"     [yellow]not run: {escape('; '.join(sorted(reasons)))}[/yellow]")
        for f in item.findings:
            listed.add(f)
            console.print(f"     [red]{escape(f.location)}[/red]  {escape(f.message)}")
        if item.status == "human":
            for cmd in commands.get(item.id, ()):
                console.print(f"     [cyan]$ {escape(cmd)}[/cyan]", soft_wrap=True)  # one line to copy
    others = [f for f in report.findings if f not in listed]
    if others:
        console.print(" [red]✗[/red] Checks outside this checklist")
        for f in others:
            console.print(f"     [red]{escape(f.location)}[/red]  [{f.check}] {escape(f.message)}")
    human = sum(1 for i in report.checklist if i.status == "human")
    note = f" ({report.suppressed} suppressed)" if report.suppressed else ""
    if report.passed:
        console.print(f"No automated check failed{note}; {human} item(s) left for a human. PASSED")
    elif not report.findings:
        console.print(
            f"No finding, but {len(report.not_run)} check(s) not run{note}; {human} item(s) left for a "
            "human. INCOMPLETE"
        )
    else:
        files = len({f.path for f in report.findings})
        missing = f", {len(report.not_run)} check(s) not run" if report.not_run else ""
        console.print(
            f"{len(report.findings)} finding(s) in {files} file(s){missing}{note}; {human} item(s) left "
            "for a human. FAILED"
        )


def review_markdown(report: ReviewReport) -> str:
    """The checklist as a Markdown list to paste into a pull request."""
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
        elif item.status == "not-run":
            reasons = sorted({report.not_run[c] for c in item.checks if c in report.not_run})
            note = f" _(auto: not run: {'; '.join(reasons)})_"
        else:
            note = ""
        lines.append(f"- [{box}] {item.text}{note}")
        for f in item.findings:
            lines.append(f"  - `{f.location}` {f.message}")
    if report.passed:
        verdict = "PASSED"
    elif report.findings:
        verdict = f"FAILED: {len(report.findings)} finding(s)"
    else:
        verdict = f"INCOMPLETE: {len(report.not_run)} check(s) not run"
    lines += ["", f"{len(report.files)} file(s) reviewed. {verdict}"]
    return "\n".join(lines) + "\n"
