"""Entry point of the `ffdebug` command. Imports only typer and rich at module level: every
command imports torch and friends inside its own body, so `ffdebug --help` stays fast."""

from __future__ import annotations

import sys

import typer
from typer._click import exceptions as click_errors  # the click typer parses with (vendored)
from typer.core import TyperGroup

from ffdebug.cli import (
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
    trace_cmd,
    weights_diff_cmd,
)


class OneLineErrors(TyperGroup):
    """Usage errors (a bad option value, a missing argument) answered like every other bad input:
    one line `ffdebug: error: …` and exit 2 (README, troubleshooting)."""

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            rv = super().main(*args, standalone_mode=False, **kwargs)
        except click_errors.NoArgsIsHelpError as err:  # `ffdebug` alone prints the help
            from typer import rich_utils

            rich_utils.rich_format_error(err)
            sys.exit(err.exit_code)
        except click_errors.ClickException as err:
            message = " ".join(err.format_message().split())
            ctx = getattr(err, "ctx", None)
            see = f"; see '{ctx.command_path} --help'" if ctx is not None else ""
            print(f"ffdebug: error: {message}{see}", file=sys.stderr)
            sys.exit(err.exit_code)
        except typer.Abort:
            print("ffdebug: aborted", file=sys.stderr)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


app = typer.Typer(
    cls=OneLineErrors,
    name="ffdebug",
    help=(
        "Numerical debugging and dump-bisect for PyTorch models and training loops: dump the same "
        "named stages from a reference and a target, compare them in float64, and find where they "
        "part ways.\n\nStart with [bold]ffdebug demo[/bold]."
    ),
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
)

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
):
    _module.register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
