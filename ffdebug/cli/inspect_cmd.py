"""`ffdebug inspect`: statistics of every tensor in a store or tensor file."""

from __future__ import annotations

import typer

from ffdebug.cli.common import emit_json, handles_errors

HELP = """Print shape, dtype and statistics of every tensor in a dump store or tensor file.

[bold]Examples[/bold]

  ffdebug inspect /tmp/dump/ref
  ffdebug inspect /tmp/dump/target --stages 'L00*' --json
  ffdebug inspect model.safetensors --stages 'model.layers.0.*'
  ffdebug inspect hf_model/                  # also a sharded index or a diffusers component folder

Shape, dtype and statistics are recomputed from the payloads and every disagreement with the
manifest is flagged (exit 2); --manifest-only lists the manifest's own numbers without reading
payloads. Reads stores left by killed runs: only complete tensors are listed.
"""


def register(app: typer.Typer) -> None:
    @app.command("inspect", help=HELP)
    @handles_errors
    def inspect_command(
        path: str = typer.Argument(
            ...,
            help="Side directory, weight dump, .safetensors / .pt file, HF or diffusers model folder, *.index.json.",
        ),
        stages: list[str] = typer.Option(None, "--stages", help="Glob over keys (repeatable)."),
        manifest_only: bool = typer.Option(
            False,
            "--manifest-only",
            help="List the manifest's shape, dtype and statistics without reading payloads.",
        ),
        json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
    ) -> None:
        import fnmatch

        from ffdebug.errors import FFDebugError
        from ffdebug.store.reader import open_side
        from ffdebug.store.recheck import disagreements, payload_facts
        from ffdebug.weights.sources import checkpoint_side_store

        store = checkpoint_side_store(path) or open_side(path)
        rows = []
        for rec in store.records:
            if stages and not any(fnmatch.fnmatchcase(rec.key, g) for g in stages):
                continue
            shape, dtype, stats, wrong = list(rec.shape), rec.dtype, rec.stats, []
            if rec.has_payload and not manifest_only:
                rec.verify()
                actual = payload_facts(rec.load())
                wrong = disagreements(rec, *actual)
                shape, dtype, stats = list(actual[0]), actual[1], actual[2]
            rows.append(
                {
                    "key": rec.key,
                    "layer": rec.layer,
                    "io": rec.io,
                    "call": rec.call,
                    "step": rec.step,
                    "rank": rec.rank,
                    "dtype": dtype,
                    "shape": shape,
                    "stats": stats,
                    "payload": rec.has_payload,
                    "checked": rec.has_payload and not manifest_only,
                    "disagreements": wrong,
                }
            )
        complete = all(s.get("complete") for s in store.status.values()) if store.status else False
        bad = [r for r in rows if r["disagreements"]]
        info = {
            "path": store.path,
            "kind": store.kind,
            "side": store.side,
            "records": len(rows),
            "complete": complete if store.kind == "store" else None,
            "incomplete_lines": store.incomplete_lines,
            "status": store.status,
            "manifest_only": manifest_only,
            "disagreeing": len(bad),
            "problems": store.problems,
            "tensors": rows,
        }
        if json_out:
            emit_json(info)
        else:
            _print(store, rows, complete)
        if bad:
            first = bad[0]
            raise FFDebugError(
                f"{store.path}: {len(bad)} record(s) disagree with their payloads, first {first['key'][:80]!r} "
                f"({first['disagreements'][0]}); the manifest is damaged or was edited — re-run the dump"
            )


def _where(row: dict) -> str:
    """Layer, call, rank and step tags of a row, e.g. `layer 2 call 1 rank 0 step=3`."""
    parts = [f"layer {row['layer']}"] if row["layer"] is not None else []
    parts += [f"call {row['call']}"] if row["call"] is not None else []
    parts.append(f"rank {row['rank']}")
    parts += [f"{k}={v}" for k, v in (row["step"] or {}).items()]
    return " ".join(parts)


def _print(store, rows: list[dict], complete: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    from ffdebug.report.safe_text import esc, key_markup
    from ffdebug.report.text import fmt

    console = Console()
    table = Table(title=esc(f"{store.path} ({store.kind}, side {store.side})"), header_style="bold")
    for col in ("key", "dtype", "shape", "mean", "std", "min", "max", "absmax", "nan/inf"):
        left = col in ("key", "dtype", "shape")
        table.add_column(col, justify="left" if left else "right", overflow="fold" if left else "ellipsis")
    for r in rows:
        s = r["stats"] or {}
        cell = key_markup(r["key"]) + ("" if r["payload"] else " [dim](stats)[/dim]")
        for wrong in r["disagreements"]:
            cell += f"\n[red]manifest disagrees: {esc(wrong)}[/red]"
        cell += f"\n[dim]{esc(_where(r))}[/dim]"
        table.add_row(
            cell,
            esc(r["dtype"] or "-"),
            str(r["shape"]),
            fmt(s.get("mean"), ".4g"),
            fmt(s.get("std"), ".4g"),
            fmt(s.get("min"), ".4g"),
            fmt(s.get("max"), ".4g"),
            fmt(s.get("absmax"), ".4g"),
            f"{s.get('nan', 0)}/{s.get('inf', 0)}",
        )
    console.print(table)
    if store.kind == "store" and not complete:
        console.print(
            f"[yellow]note: the run did not finish cleanly (no final status); {len(rows)} complete "
            f"tensors listed{', 1 partial manifest line skipped' if store.incomplete_lines else ''}[/yellow]"
        )
    for problem in store.problems:
        console.print(f"[yellow]problem: {esc(problem)}[/yellow]")
    for rank, st in sorted(store.status.items()):
        if st.get("over_budget"):
            console.print(
                f"[yellow]note: {esc(rank)}: {esc(st['over_budget'])} capture(s) over the byte budget "
                "were counted, not written[/yellow]"
            )
