"""`ffdebug inspect`: statistics of every tensor in a store or tensor file."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:  # types only: the command imports what it reads when it runs
    from ffdebug.io.record import Record
    from ffdebug.progress_hook import ProgressHook

HELP = """Print shape, dtype and statistics of every tensor in a dump store or tensor file.

[bold]Examples[/bold]

  ffdebug inspect /tmp/dump/ref
  ffdebug inspect /tmp/dump/target --stages 'L00*' --json
  ffdebug inspect model.safetensors --stages 'model.layers.0.*'
  ffdebug inspect hf_model/                  # also a sharded index or a diffusers component folder

Shape, dtype and statistics are recomputed from the payloads and every disagreement with the
manifest is flagged (exit 2); --manifest-only lists the manifest's own numbers without reading
payloads. Reads stores left by killed runs: only complete tensors are listed.

Progress goes to stderr: a bar on a terminal, else a line every FFDEBUG_PROGRESS_INTERVAL seconds
(0: one per tensor; docs/cli.md "Progress").
"""


def register(app: typer.Typer) -> None:
    @app.command("inspect", help=HELP)
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
        from ffdebug.report.progress import Progress
        from ffdebug.report.sink import Output
        from ffdebug.report.store_text import print_inspect
        from ffdebug.store.reader import open_side
        from ffdebug.weights.sources import checkpoint_side_store

        store = checkpoint_side_store(path) or open_side(path)
        selected = [
            r for r in store.records if not stages or any(fnmatch.fnmatchcase(r.key, g) for g in stages)
        ]
        with Progress("inspect", "tensors") as progress:
            rows = _rows(selected, manifest_only, progress)
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
        Output(json=json_out).show(info, print_inspect)
        if bad:
            first = bad[0]
            raise FFDebugError(
                f"{store.path}: {len(bad)} record(s) disagree with their payloads, first {first['key'][:80]!r} "
                f"({first['disagreements'][0]}); the manifest is damaged or was edited — re-run the dump"
            )


def _rows(records: list[Record], manifest_only: bool, progress: ProgressHook) -> list[dict]:
    """One row per record: shape, dtype and statistics recomputed from its payload (unless
    `manifest_only`), with every field the manifest gets wrong."""
    from ffdebug.io.prefetch import record_bytes
    from ffdebug.store.recheck import disagreements, payload_facts

    checked = [r.has_payload and not manifest_only for r in records]
    progress.begin(len(records), sum(record_bytes(r) for r, c in zip(records, checked) if c))
    rows = []
    for rec, check in zip(records, checked):
        shape, dtype, stats, wrong = list(rec.shape), rec.dtype, rec.stats, []
        if check:
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
                "checked": check,
                "disagreements": wrong,
            }
        )
        progress.advance(record_bytes(rec) if check else 0)
    return rows
