"""`ffdebug demo`: the main job end to end on the embedded default model."""

from __future__ import annotations

import typer

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

        from ffdebug.bisection.engine import bisect
        from ffdebug.demo import DemoRun, located_expected, run_demo
        from ffdebug.report.bisect_text import conclude
        from ffdebug.report.demo_text import print_demo, print_demo_start
        from ffdebug.report.sink import Output

        out = Output(json=json_out)
        console = out.console
        start = time.perf_counter()
        print_demo_start(console)
        result, directory = run_demo(dir)
        b = conclude(bisect(result.ref_path, result.target_path)).to_json()
        keys = ("verdict", "first_divergence", "pattern", "per_class", "sub_stage", "conclusion")
        summary = {k: b[k] for k in keys}
        run = DemoRun(result, directory, located_expected(result), summary, time.perf_counter() - start)
        out.show(run, print_demo, console=console)
        raise typer.Exit(0 if run.located else 1)
