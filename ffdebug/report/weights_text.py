"""Text output of `ffdebug weights-diff` and `ffdebug load-audit` (from their JSON dicts; no torch).

The schema block is printed before any number; the numerics table lists the tensors that are not
byte-equal (all of them with `show_all`), then one plain conclusion sentence ending in PASSED or
FAILED.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ffdebug.report.safe_text import esc, key_markup
from ffdebug.report.text import fmt, severity_cell
from ffdebug.verdict import Severity

LIST_LIMIT = 12


def _names(items: list, limit: int = LIST_LIMIT) -> str:
    shown = ", ".join(key_markup(i) for i in items[:limit])
    return shown + (f", … (+{len(items) - limit} more)" if len(items) > limit else "")


def print_weights_schema(res: dict, console: Console | None = None) -> None:
    console = console or Console()
    ref, tgt = res["ref"], res["target"]
    console.print(
        Text.assemble(
            ("Schema", "bold"),
            f"  ref {ref['path']} ({ref['kind']}, {ref['tensors']} tensors"
            + (f", {ref['world_size']} ranks" if ref.get("world_size", 1) > 1 else "")
            + f")  vs  target {tgt['path']} ({tgt['kind']}, {tgt['tensors']} tensors"
            + (f", {tgt['world_size']} ranks" if tgt.get("world_size", 1) > 1 else "")
            + ")",
        )
    )
    for r in res.get("restricted") or []:
        other = "target" if r["side"] == "reference" else "reference"
        console.print(
            f"  [dim]{r['side']} restricted to layers {', '.join(map(str, r['layers'])) or 'none'}: the {other} "
            f"is a weight dump of FFDEBUG_WEIGHT_DUMP_LAYERS={r['because']} ({r['left_out']} tensor(s) of "
            "other layers left out)[/dim]",
            highlight=False,
        )
    buffers = res.get("buffers_not_in_checkpoint") or []
    if buffers:
        console.print(
            f"  [dim]buffers not in checkpoints ({len(buffers)}, dump only, not compared): "
            f"{_names([b['name'] for b in buffers])}[/dim]",
            highlight=False,
        )
    clean = True
    if res["only_ref"]:
        clean = False
        console.print(f"  [yellow]only in ref ({len(res['only_ref'])}):[/yellow] {_names(res['only_ref'])}")
    if res["only_target"]:
        clean = False
        console.print(
            f"  [yellow]only in target ({len(res['only_target'])}):[/yellow] {_names(res['only_target'])}"
        )
    for s in res["shape_mismatch"]:
        clean = False
        note = f" ({s['note']})" if s.get("note") else ""
        console.print(
            f"  [red]shape mismatch:[/red] {key_markup(s['name'])}  ref {s['shape_ref']}  target {s['shape_target']}{esc(note)}",
            highlight=False,
        )
    for s in res["dtype_mismatch"]:
        tag = " (dequantised for the comparison)" if s.get("dequantized") else ""
        console.print(
            f"  [yellow]dtype mismatch:[/yellow] {key_markup(s['name'])}  ref {s['dtype_ref']}  target {s['dtype_target']}{tag}",
            highlight=False,
        )
    for r in res["renames"]:
        to = r["to"] if isinstance(r["to"], str) else " + ".join(r["to"])
        frm = r["from"] if isinstance(r["from"], str) else " + ".join(r["from"])
        console.print(
            f"  [cyan]suggestion:[/cyan] {esc(frm)} → {esc(to)}  ({r['matches']} match{'es' if r['matches'] != 1 else ''})"
            f"  apply with [bold]{esc(r['apply'])}[/bold]",
            highlight=False,
        )
    if res.get("apply"):
        console.print(f"  re-run with: {res['apply']}", highlight=False, markup=False)
    print_content(res.get("content"), console)
    for w in res.get("warnings") or []:
        console.print(f"  warning: {w}", style="yellow", highlight=False, markup=False)
    for d in res.get("dequantized") or []:
        scale = f"scale {d['scale']} {d['scale_shape']}" if d.get("scale") else "no scale found"
        console.print(
            f"  [dim]dequantised {d['side']} {key_markup(d['name'])} ({d['dtype']}, {esc(scale)})[/dim]",
            highlight=False,
        )
    if res.get("skipped"):
        console.print(f"  [dim]skipped {len(res['skipped'])} tensor(s) (--skip)[/dim]")
    if clean and not res["dtype_mismatch"]:
        console.print("  [green]names and shapes match[/green]")


def print_content(content: dict | None, console: Console) -> None:
    """Content matching's plan: the rules it learned (the map it applied) and what is left."""
    if not content:
        return
    rels = content["relations"]
    paired = sum(len(r["parts"]) for r in rels)
    by_rule = sum(1 for r in rels if r["how"] == "name rule")
    console.print(
        f"  [cyan]content matching:[/cyan] {len(rels)} tensor(s) related to {paired} of the other side"
        + (f" ({by_rule} by the learned rule, no content match)" if by_rule else "")
        + f" in {content['seconds']:.2f} s; map applied:",
        highlight=False,
    )
    for rule in content["rules"]:
        console.print(f"    {rule}", highlight=False, markup=False)
    for r in rels:
        if r.get("found"):
            found = ", ".join(f"{p['name']} at {p['at']}" for p in r["found"][:4])
            more = f", … (+{len(r['found']) - 4})" if len(r["found"]) > 4 else ""
            console.print(
                f"    [red]{r['tensor']} departs from the convention:[/red] holds {found}{more}",
                highlight=False,
            )
    left = content["unmatched_ref"] + content["unmatched_target"]
    if left:
        console.print(
            f"    unmatched by content ({len(left)}): {_names(left)}", highlight=False, markup=False
        )


def weights_table(tensors: list[dict], show_all: bool = False) -> Table:
    table = Table(header_style="bold")
    for col, justify in (
        ("", "left"),
        ("finding", "left"),
        ("tensor", "left"),
        ("dtype", "left"),
        ("shape", "left"),
        ("cos", "right"),
        ("rel", "right"),
        ("max_abs", "right"),
    ):
        table.add_column(
            col,
            justify=justify,
            overflow="fold",  # names and numbers wrap at 80 columns, never cut (no_wrap would cut)
        )
    for t in tensors:
        if not show_all and t["finding"] == "equal":
            continue
        dtype = (
            t["dtype_ref"] if t["dtype_ref"] == t["dtype_target"] else f"{t['dtype_ref']}→{t['dtype_target']}"
        )
        shape = (
            str(t["shape_ref"])
            if t["shape_ref"] == t["shape_target"]
            else f"{t['shape_ref']}→{t['shape_target']}"
        )
        finding = t["finding"]
        if t.get("scale_factor") is not None:
            finding += f" ×{t['scale_factor']:.4g}"
        table.add_row(
            severity_cell(t["severity"]),
            finding,
            key_markup(t["name"]),
            dtype,
            shape,
            fmt(t.get("cos")),
            fmt(t.get("rel"), "%"),
            fmt(t.get("max_abs"), ".3g"),
        )
    return table


def weights_conclusion(res: dict) -> str:
    word = "PASSED" if res["passed"] else "FAILED"
    tensors = res["tensors"]
    counts: dict[str, int] = {}
    for t in tensors:
        counts[t["finding"]] = counts.get(t["finding"], 0) + 1
    summary = ", ".join(f"{n} {f}" for f, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    schema = []
    if res["only_ref"]:
        schema.append(f"{len(res['only_ref'])} only in ref")
    if res["only_target"]:
        schema.append(f"{len(res['only_target'])} only in target")
    if res["shape_mismatch"]:
        schema.append(f"{len(res['shape_mismatch'])} shape mismatch(es)")
    allowed = ""
    if res["dtype_mismatch"]:
        if res.get("allow_dtype"):
            allowed = f"{len(res['dtype_mismatch'])} dtype difference(s) allowed (--allow-dtype)."
        else:
            schema.append(f"{len(res['dtype_mismatch'])} dtype mismatch(es)")
    parts = [allowed] if allowed else []
    if schema:
        fix = " — apply the suggested mapping and re-run" if res.get("apply") else ""
        parts.append(f"Schema differs: {', '.join(schema)}{fix}.")
    if res.get("replica_mismatch"):
        r = res["replica_mismatch"][0]
        parts.append(
            f"{len(res['replica_mismatch'])} replicated tensor(s) differ across ranks "
            f"(first {r['name']} on the {r['side']} side, ranks {r['ranks']})."
        )
    if res.get("schema_only"):
        parts.append("Numerics not run (--schema-only).")
    elif tensors:
        parts.append(_numerics_sentence(res, tensors, summary))
    elif not schema:
        parts.append("No tensors to compare.")
    return " ".join(parts) + f" {word}"


LOADED = ("equal", "dtype_only", "rounding")
NAMED = ("swapped", "permuted", "not_loaded", "scaled")  # findings whose note says what happened


def _numerics_sentence(res: dict, tensors: list[dict], summary: str) -> str:
    """Beyond-rounding differences (a layout, sign, scale or value change) are counted apart from
    rounding-level ones, which the cos / rel bands may still grade drift (fp8, a bf16 round trip)."""
    beyond = [t for t in tensors if t["finding"] not in LOADED and Severity(t["severity"]) is not Severity.OK]
    graded = [t for t in tensors if t["finding"] in LOADED and Severity(t["severity"]) is not Severity.OK]
    if beyond:
        first = beyond[0]
        worst = max(beyond, key=lambda t: Severity(t["severity"]).rank)["severity"]
        more = f"; {len(graded)} more within rounding but graded {_sev(graded)}" if graded else ""
        return (
            f"{len(beyond)} of {len(tensors)} tensors differ beyond rounding, worst {worst}; first "
            f"{first['name']} ({first['finding']}, {first['severity']}){more} [{summary}]."
        )
    if graded:
        return (
            f"All {len(tensors)} compared tensors match within rounding; {len(graded)} of them graded "
            f"{_sev(graded)} by cos / rel (the precision of the coarser side) [{summary}]."
        )
    return f"All {len(tensors)} compared tensors match ({summary})."


def _sev(tensors: list[dict]) -> str:
    sevs = sorted({t["severity"] for t in tensors}, key=lambda s: Severity(s).rank)
    return " to ".join([sevs[0], sevs[-1]]) if len(sevs) > 1 else sevs[0]


def print_weights_numerics(res: dict, console: Console | None = None, show_all: bool = False) -> None:
    console = console or Console()
    tensors = res["tensors"]
    equal = sum(1 for t in tensors if t["finding"] == "equal")
    if tensors and (show_all or equal < len(tensors)):
        console.print(weights_table(tensors, show_all))
    if equal and not show_all:
        console.print(f"[green]{equal} tensor(s) byte-equal[/green] (--all lists them)")
    for t in tensors:
        if t["finding"] == "transposed" and t.get("after_transpose"):
            console.print(
                f"[dim]{key_markup(t['name'])}: after .T cos {fmt(t['after_transpose']['cos'])}[/dim]"
            )
        if t["finding"] in NAMED:
            for note in (t.get("notes") or [])[-1:]:
                console.print(f"  {t['finding']}: {note}", highlight=False, markup=False)
    for note in res.get("notes") or []:
        console.print(f"[dim]note: {esc(note)}[/dim]", highlight=False)
    console.print(weights_conclusion(res), highlight=False, markup=False)


def print_load_audit(res: dict, console: Console | None = None) -> None:
    console = console or Console()
    console.print(
        Text.assemble(("Load audit", "bold"), f"  model {res['model']}  checkpoint {res['checkpoint']}")
    )
    for s in res["shape_mismatch"]:
        console.print(
            f"  [red]shape mismatch (skipped by the load):[/red] {key_markup(s['name'])} "
            f"({s['module_class'] or '?'} at {s['module'] or '<root>'}): model {s['shape_model']} "
            f"vs checkpoint {s['shape_checkpoint']}",
            highlight=False,
        )
    if res["never_loaded"]:
        names = [n["name"] for n in res["never_loaded"]]
        console.print(f"  [red]never loaded ({len(names)}):[/red] {_names(names)}", highlight=False)
    if res["not_covered"]:
        names = [f"{n['name']} ({n['module_class'] or n['kind']})" for n in res["not_covered"]]
        console.print(
            f"  [red]not in the checkpoint, left at initialisation ({len(names)}):[/red] {_names(names)}",
            highlight=False,
        )
    for n in res.get("not_loaded") or []:
        ckpt = (n.get("origin") or {}).get("target", n["name"])
        console.print(
            f"  [red]not loaded:[/red] {(n.get('origin') or {}).get('ref', n['name'])} "
            f"({n.get('module_class') or '?'}) still equals its initialisation; the checkpoint holds it as {ckpt}",
            highlight=False,
        )
    if res["value_mismatch"]:
        console.print(weights_table(res["value_mismatch"], show_all=True))
    print_content(res.get("content"), console)
    for w in res.get("warnings") or []:
        console.print(f"  warning: {w}", style="yellow", highlight=False, markup=False)
    for t in res["tied"]:
        console.print(
            f"  [dim]tied: {key_markup(t['name'])} shares storage with {key_markup(t['tied_to'])}[/dim]",
            highlight=False,
        )
    for r in res["renames"]:
        console.print(
            f"  [cyan]suggestion:[/cyan] apply with [bold]{esc(r['apply'])}[/bold] ({r['matches']} matches)"
        )
    for note in res.get("notes") or []:
        console.print(f"  [dim]note: {esc(note)}[/dim]", highlight=False)
    word = "PASSED" if res["passed"] else "FAILED"
    problems = []
    if res["shape_mismatch"]:
        first = res["shape_mismatch"][0]
        problems.append(
            f"{len(res['shape_mismatch'])} shape mismatch(es), first {first['name']} model "
            f"{first['shape_model']} vs checkpoint {first['shape_checkpoint']}"
        )
    if res["never_loaded"]:
        problems.append(f"{len(res['never_loaded'])} checkpoint tensor(s) never loaded")
    if res["not_covered"]:
        problems.append(f"{len(res['not_covered'])} model tensor(s) left at initialisation")
    if res.get("not_loaded"):
        first = res["not_loaded"][0]
        problems.append(
            f"{len(res['not_loaded'])} model tensor(s) not loaded (still at initialisation), first "
            f"{(first.get('origin') or {}).get('ref', first['name'])}"
        )
    if res["value_mismatch"]:
        problems.append(f"{len(res['value_mismatch'])} tensor(s) loaded with other values")
    if problems:
        sentence = "The model did not load the checkpoint faithfully: " + "; ".join(problems) + "."
    else:
        sentence = f"All {res['loaded']} checkpoint tensors were loaded as stored."
    console.print(f"{sentence} {word}", highlight=False, markup=False)
