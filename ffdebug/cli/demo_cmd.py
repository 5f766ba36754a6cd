"""`ffdebug demo`: the main job end to end on the embedded default model."""

from __future__ import annotations

import typer

from ffdebug.cli.common import emit_json

HELP = """Run the whole job on a built-in tiny model: dump a reference and a buggy target through the
FFDEBUG_* env vars (one process each), compare them, and point at the first divergent layer.

The target forgets DeepSeek-V3's routed_scaling_factor in its MoE layers (layers 1-3; layer 0 is
dense), so the first divergence must be layer 1, class moe, stage ffn_out.

[bold]Examples[/bold]

  ffdebug demo
  ffdebug demo --dir /tmp/demo && ffdebug compare ref-vs-target --dir /tmp/demo
"""


def register(app: typer.Typer) -> None:
    @app.command("demo", help=HELP)
    def demo_command(
        dir: str = typer.Option(None, "--dir", help="Keep the dumps here (default: a temp directory)."),
        json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
    ) -> None:
        import time

        from rich.console import Console

        from ffdebug.demo import EXPECTED, located_expected, run_demo

        console = Console(stderr=json_out)
        start = time.perf_counter()
        console.print(
            "[bold]ffdebug demo[/bold]: tiny DeepSeek-V3-style LM (1 dense + 3 MoE layers); "
            "target forgets routed_scaling_factor in the MoE router."
        )
        console.print("dumping ref and target (one process each, FFDEBUG_FWD_DUMP_* env vars) …")
        result, directory = run_demo(dir)
        ok = located_expected(result)
        from ffdebug.bisect.engine import bisect
        from ffdebug.report.bisect_text import conclude

        b = conclude(bisect(result.ref_path, result.target_path)).to_json()
        keys = ("verdict", "first_divergence", "pattern", "per_class", "sub_stage", "conclusion")
        summary = {k: b[k] for k in keys}
        if json_out:
            demo = {"dir": directory, "expected": EXPECTED, "located": ok}
            emit_json(dict(result.to_json(), demo=demo, bisect=summary))
        else:
            from ffdebug.report.text import print_compare

            print_compare(result, console=console)
            first = result.first_divergence
            where = (first.layer, first.layer_class, first.stage) if first else (None, None, None)
            console.print(
                f"\nDumps in {directory}. The injected bug was expected at layer {EXPECTED['layer']} "
                f"({EXPECTED['layer_class']}), {EXPECTED['stage']}; ffdebug's first divergence is layer "
                f"{where[0]} ({where[1]}), {where[2]}: "
                f"{'located' if ok else 'NOT located'} in {time.perf_counter() - start:.1f} s.",
                highlight=False,
            )
            console.print(f"\nBisect: {summary['conclusion']}", highlight=False, markup=False)
            console.print(
                f"Re-run the comparison: ffdebug compare ref-vs-target --dir {directory}; the bisect: "
                f"ffdebug bisect --dir {directory} --html report.html",
                highlight=False,
            )
        raise typer.Exit(0 if ok else 1)
