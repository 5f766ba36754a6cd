"""Text and HTML of `ffdebug hunt`, `isolate` and `replay` (docs/hunt.md "Hunt: from symptom to root cause").

Each takes the typed result (or its JSON dict for the HTML page) and prints through rich with every
key and value escaped (`safe_text`)."""

from __future__ import annotations

import html

from rich.console import Console

from ffdebug.report.safe_text import esc as safe


def _console(err: bool = False) -> Console:
    """Prose wraps at the terminal's width (80 when piped) and long words fold, never cut
    (docs/cli.md "CLI conventions"); a reproduce command is printed with `soft_wrap=True`, one line to
    copy."""
    return Console(stderr=err, highlight=False)


def print_round(r, resumed: bool, err: bool = False, noise: str | None = None) -> None:
    """One round: its decision, its evidence, its bytes and the commands that reproduce it."""
    c = _console(err)
    tag = " (kept from the earlier run: --resume)" if resumed else ""
    c.print(f"[bold]round {r.round}[/bold]{tag}: {safe(r.decision)}  [dim]{r.bytes:,} bytes[/dim]")
    for line in r.evidence:
        c.print(f"  - {safe(line)}")
    for side in sorted(r.env):
        c.print(f"  [dim]$ {safe(r.reproduce(side, noise))}[/dim]", soft_wrap=True)


def conclusion(state) -> str:
    """One sentence: where the hunt ended."""
    limit = state.budget_limit
    budget = f"{state.used:,} bytes written" + (f" of a {limit:,}-byte budget" if limit else "")
    if not state.complete:
        if limit is not None and state.used >= limit:
            return (
                f"Hunt stopped: the byte budget is spent ({budget}); raise --budget and --resume. INCOMPLETE"
            )
        return f"Hunt interrupted after {len(state.rounds)} round(s) ({budget}); continue with --resume. INCOMPLETE"
    if state.layer is None and state.sub_stage is None:
        last = state.rounds[-1].decision if state.rounds else "no round ran"
        return f"Hunt finished: {last} ({budget})."
    if state.layer is None:
        return f"Hunt finished: the error starts at {state.sub_stage}, outside the layers ({budget}). FAILED"
    where = {
        True: "local to this layer",
        False: "inherited (on the reference's input the layer keeps under a tenth of its error: look before it)",
        None: "local or inherited not decided",
    }[state.local]
    return (
        f"Hunt finished: layer {state.layer} ({state.layer_class}), sub-stage {state.sub_stage}, {where}, "
        f"in {len(state.rounds)} round(s) ({budget}). FAILED"
    )


def print_hunt(state) -> None:
    c = _console()
    for note in state.notes:
        c.print(safe(note))
    c.print(safe(conclusion(state)))


def hunt_html(state, noise: str | None = None) -> str:
    """A self-contained page: the chain of evidence, one section per round."""
    e = html.escape
    parts = [
        "<!doctype html><meta charset='utf-8'><title>ffdebug hunt</title>",
        "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto}code{background:#eee}</style>",
        f"<h1>ffdebug hunt</h1><p>{e(conclusion(state))}</p>",
    ]
    for r in state.rounds:
        parts.append(f"<h2>Round {r.round}: {e(r.decision)}</h2><p>{r.bytes:,} bytes</p><ul>")
        parts.extend(f"<li>{e(line)}</li>" for line in r.evidence)
        parts.append("</ul>")
        parts.extend(f"<p><code>{e(r.reproduce(side, noise))}</code></p>" for side in sorted(r.env))
    return "\n".join(parts) + "\n"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.3g}%"


def print_isolate(result) -> None:
    """One row per fix: its class and what reverting it does to the final output."""
    from rich.table import Table

    table = Table(title=f"reverting each fix alone ({safe(result.stage)} against the all-fixes run)")
    for col in ("fix", "class", "cos", "rel", "bit-equal", "imported from outside"):
        table.add_column(col, overflow="fold")  # wrapped at 80 columns, never cut
    for f in result.fixes:
        cos = "-" if f.cos is None else f"{f.cos:.6f}"
        outside = ", ".join(f"{k} ({v})" for k, v in f.outside_imports.items()) or "-"
        table.add_row(safe(f.fix), f.effect, cos, _pct(f.rel), _pct(f.bit_equal), safe(outside))
    c = _console()
    c.print(table)
    same = "byte-equal to" if result.all_fixes_equal_reference else "not byte-equal to"
    c.print(f"All fixes together are {same} the reference ({result.reference_severity.value}).")
    if result.outside_imports:
        c.print(
            safe(f"warning: the all-fixes run imported {result.outside_imports} from outside its worktree")
        )


def print_replay(result) -> None:
    """The four runs against the reference function on the reference's inputs, and the verdict."""
    from rich.table import Table

    table = Table(title=f"replay of {safe(result.stage)} on {safe(', '.join(result.inputs))}")
    for col in ("function", "inputs", "cos", "rel", "bit-equal", "severity"):
        table.add_column(col, overflow="fold")  # wrapped at 80 columns, never cut
    for r in result.runs:
        cos = "-" if r.cos is None else f"{r.cos:.6f}"
        table.add_row(r.function, r.inputs, cos, _pct(r.rel), _pct(r.bit_equal), r.severity.value)
    c = _console()
    c.print(table)
    c.print(f"verdict {result.verdict}: {safe(result.reason)}")
