"""Entry point of the `ffdebug` command: wiring only (docs/architecture.md "Layers", the cli/ row). Imports only
typer and rich at module level: every command imports torch and friends inside its own body, so
`ffdebug --help` stays fast. Errors end at one boundary (`ffdebug.cli.boundary.OneLineErrors`);
results go to one sink (`ffdebug.report.sink.Output`)."""

from __future__ import annotations

import os

from ffdebug.cli import deferred_rich

deferred_rich.install()  # before typer's help formatter imports rich.markdown and rich.traceback (~95 ms)

import typer  # noqa: E402

from ffdebug.cli import (  # noqa: E402
    bisect_cmd,
    compare_cmd,
    demo_cmd,
    hunt_cmd,
    import_cmd,
    inspect_cmd,
    invariance_cmd,
    isolate_cmd,
    playbook_cmd,
    review_cmd,
    selftest_cmd,
    trace_cmd,
    weights_diff_cmd,
)
from ffdebug.cli.boundary import OneLineErrors  # noqa: E402  (every error, usage or FFDebugError, ends there)
from ffdebug.cli.conventions import GLOBAL_HELP, add_global_options  # noqa: E402

app = typer.Typer(
    cls=OneLineErrors,
    name="ffdebug",
    help=(
        "Numerical debugging and dump-bisect for PyTorch models and training loops: dump the same "
        "named stages from a reference and a target, compare them in float64, and find where they "
        "part ways.\n\nStart with [bold]ffdebug demo[/bold]." + GLOBAL_HELP.format(program="ffdebug")
    ),
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion (docs/cli.md "CLI conventions")
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
)

add_global_options(app, "ffdebug")

# One line per command module; each registers its command(s) on `app`.
for _module in (
    compare_cmd,
    inspect_cmd,
    demo_cmd,
    weights_diff_cmd,
    bisect_cmd,
    invariance_cmd,
    hunt_cmd,
    isolate_cmd,
    playbook_cmd,
    review_cmd,
    trace_cmd,
    import_cmd,
    selftest_cmd,
):
    _module.register(app)


def main() -> None:
    # numpy's BLAS runs the chunk loops' dot products; a thread team per 256 Ki-element dot gains
    # nothing and spins on a busy machine (`ffdebug._chunks`). Set before numpy loads; a user's
    # own setting wins.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    app()


if __name__ == "__main__":
    main()
