"""The conventions both command-line programs share (docs/cli.md "CLI conventions"): the global options
`--version`, `-v` / `--verbose`, `-q` / `--quiet` (and typer's `--install-completion` /
`--show-completion`), and help that shows no `<bool>` type beside a flag. Imports only typer and the
package version: `--help` and `--version` stay fast."""

from __future__ import annotations

from typing import Any

import typer
from typer.core import TyperArgument, TyperOption

GLOBAL_HELP = (
    "\n\nGlobal options go before the command: [bold]{program} -q COMMAND ...[/bold] (errors only), "
    "[bold]{program} -v COMMAND ...[/bold] (debug messages). Shell completion: "
    "[bold]{program} --install-completion[/bold]."
)


def plain_flags() -> None:
    """Help shows no type beside a flag or a counter (`--json`, not `--json <bool>`; `-v`, not
    `-v <int>`): typer's rich help prints every option's type, flags included. A repeatable
    option or a variadic argument shows its element's type (`--stages <str>`, `sides... <str>`),
    not Python's `<list[str]>`: its help says "(repeatable)", its name ends in "..."."""
    if getattr(TyperOption.display_type_rich, "plain_flags", False):
        return
    typed_option = TyperOption.display_type_rich
    typed_argument = TyperArgument.display_type_rich

    def option_type(self: TyperOption, ctx: Any) -> str | None:
        if self.is_flag or self.count:
            return None
        return _element_type(typed_option(self, ctx))

    def argument_type(self: TyperArgument, ctx: Any) -> str | None:
        return _element_type(typed_argument(self, ctx))

    option_type.plain_flags = True  # type: ignore[attr-defined]
    TyperOption.display_type_rich = option_type  # type: ignore[method-assign]
    TyperArgument.display_type_rich = argument_type  # type: ignore[method-assign]


def _element_type(shown: str | None) -> str | None:
    """`<list[str]>` -> `<str>` (nested lists too); anything else as it is."""
    while shown and shown.startswith("<list[") and shown.endswith("]>"):
        shown = "<" + shown[len("<list[") : -len("]>")] + ">"
    return shown


GLOBAL_OPTIONS = ("--version", "--verbose", "-v", "--quiet", "-q")  # before the command, not after


def add_global_options(app: typer.Typer, program: str) -> None:
    """`--version`, `-v` and `-q` on `app` (a callback run before any command)."""

    def show_version(value: bool) -> None:
        if value:
            from ffdebug.version import __version__

            typer.echo(f"{program} {__version__}")
            raise typer.Exit(0)

    @app.callback()
    def global_options(
        version: bool = typer.Option(
            False, "--version", is_eager=True, callback=show_version, help="Print the version and exit."
        ),
        verbose: int = typer.Option(
            0, "--verbose", "-v", count=True, show_default=False, help="Debug messages on stderr as well."
        ),
        quiet: bool = typer.Option(
            False, "--quiet", "-q", help="Errors only on stderr: no warnings, no progress lines."
        ),
    ) -> None:
        from ffdebug.logs import configure

        if quiet and verbose:
            raise typer.BadParameter("give -q or -v, not both", param_hint="'-q' / '-v'")
        configure(-1 if quiet else verbose)
