"""The one error boundary of ffdebug's command-line programs (README "Troubleshooting",
docs/architecture.md "cli/").

Every known error ends as one line `PROGRAM: error: MESSAGE` on stderr and its exit code; nothing
below the boundary prints errors or catches them to exit. `OneLineErrors` is the click group both
`ffdebug` and `reference-trainer` run under: usage errors (a bad option value, a missing argument)
and the program's known exceptions go through its `main`. `FFDEBUG_DEBUG=1` re-raises a known
exception instead, for the full traceback. Imports only typer: both programs' `--help` stays fast.
"""

from __future__ import annotations

import sys
from typing import Any, NoReturn

import typer
from typer._click import exceptions as click_errors  # the click typer parses with (vendored)
from typer.core import TyperGroup


def fail(program: str, message: str, code: int, hint: str | None = None) -> NoReturn:
    """Print `PROGRAM: error: MESSAGE` (and a `hint` line, when given) on stderr; exit `code`."""
    print(f"{program}: error: {message}", file=sys.stderr)
    if hint:
        print(hint, file=sys.stderr)
    sys.exit(code)


class OneLineErrors(TyperGroup):
    """A typer group whose `main` is the error boundary. Subclasses name their `program` and map
    their own exception types to exit codes in `known_error`."""

    program = "ffdebug"
    hint: str | None = None  # printed under the error line (the trainer names FFDEBUG_DEBUG)

    def known_error(self, err: Exception) -> tuple[str, int] | None:
        """(message, exit code) for a known exception, None for anything else (re-raised)."""
        from ffdebug.errors import FFDebugError

        if isinstance(err, FFDebugError):
            return str(err), err.exit_code
        return None

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        """Run the program; standalone, every outcome is a `SystemExit` with the exit code (known
        errors as one line first). `standalone_mode=False` hands errors to the caller unchanged."""
        if not standalone_mode:  # a caller that handles errors itself
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            rv = super().main(*args, standalone_mode=False, **kwargs)
        except click_errors.NoArgsIsHelpError as err:  # the program alone prints the help
            from typer import rich_utils

            rich_utils.rich_format_error(err)
            sys.exit(err.exit_code)
        except click_errors.ClickException as err:
            message = " ".join(err.format_message().split())
            ctx = getattr(err, "ctx", None)
            see = f"; see '{ctx.command_path} --help'" if ctx is not None else ""
            fail(self.program, f"{message}{see}", err.exit_code)
        except typer.Abort:
            print(f"{self.program}: aborted", file=sys.stderr)
            sys.exit(1)
        except Exception as err:
            known = self.known_error(err)
            if known is None or _debug_tracebacks():
                raise
            fail(self.program, known[0], known[1], self.hint)
        sys.exit(rv if isinstance(rv, int) else 0)


def _debug_tracebacks() -> bool:
    from ffdebug._env import debug_tracebacks

    return debug_tracebacks()
