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

Reads stores left by killed runs: only complete tensors are listed.
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
        json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
    ) -> None:
        import fnmatch

        from ffdebug.store.reader import open_side
        from ffdebug.store.schema import tensor_stats
        from ffdebug.weights.sources import checkpoint_side_store

        store = checkpoint_side_store(path) or open_side(path)
        rows = []
        for rec in store.records:
            if stages and not any(fnmatch.fnmatchcase(rec.key, g) for g in stages):
                continue
            rec.verify()
            stats = rec.stats
            if stats is None and rec.has_payload:
                stats = tensor_stats(rec.load())
            rows.append(
                {
                    "key": rec.key,
                    "layer": rec.layer,
                    "io": rec.io,
                    "call": rec.call,
                    "step": rec.step,
                    "rank": rec.rank,
                    "dtype": rec.dtype,
                    "shape": list(rec.shape),
                    "stats": stats,
                    "payload": rec.has_payload,
                }
            )
        complete = all(s.get("complete") for s in store.status.values()) if store.status else False
        info = {
            "path": store.path,
            "kind": store.kind,
            "side": store.side,
            "records": len(rows),
            "complete": complete if store.kind == "store" else None,
            "incomplete_lines": store.incomplete_lines,
            "status": store.status,
            "tensors": rows,
        }
        if json_out:
            emit_json(info)
            return
        from rich.console import Console
        from rich.table import Table

        from ffdebug.report.text import fmt

        console = Console()
        table = Table(title=f"{store.path} ({store.kind}, side {store.side})", header_style="bold")
        for col in ("key", "dtype", "shape", "mean", "std", "min", "max", "absmax", "nan/inf"):
            table.add_column(col, justify="left" if col in ("key", "dtype", "shape") else "right")
        for r in rows:
            s = r["stats"] or {}
            table.add_row(
                r["key"] + ("" if r["payload"] else " [dim](stats)[/dim]"),
                r["dtype"] or "-",
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
        for rank, st in sorted(store.status.items()):
            if st.get("over_budget"):
                console.print(
                    f"[yellow]note: {rank}: {st['over_budget']} capture(s) over the byte budget "
                    "were counted, not written[/yellow]"
                )
