"""The one error boundary of ffdebug's command-line programs (docs/cli.md "Troubleshooting",
docs/architecture.md "Layers", the cli/ row).

Every known error ends as one line `PROGRAM: error: MESSAGE` on stderr and its exit code; nothing
below the boundary prints errors or catches them to exit. `OneLineErrors` is the click group both
`ffdebug` and `reference-trainer` run under: usage errors (a bad option value, a missing argument)
and the program's known exceptions go through its `main`. `FFDEBUG_DEBUG=1` re-raises a known
exception instead, for the full traceback. Imports only typer: both programs' `--help` stays fast.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, NoReturn

import typer
from typer._click import exceptions as click_errors  # the click typer parses with (vendored)
from typer.core import TyperGroup

from ffdebug.cli.conventions import GLOBAL_OPTIONS


@dataclass(frozen=True)
class Failure:
    """A known error as the boundary reports it: one stderr line (plus the hint), and under
    `--json` the same facts as `{"error": {...}}` on stdout (docs/cli.md "CLI conventions")."""

    exit_code: int
    message: str
    hint: str | None = None
    where: str | None = None  # the command (and the option) the error belongs to
    inline_hint: bool = False  # the hint ends the stderr line (`; see '... --help'`), else a line of its own

    def to_json(self) -> dict[str, Any]:
        return {
            "error": {
                "exit_code": self.exit_code,
                "message": self.message,
                "hint": self.hint,
                "where": self.where,
            }
        }


def fail(program: str, failure: Failure, json_out: bool = False) -> NoReturn:
    """Print `PROGRAM: error: MESSAGE` (and the hint line, when there is one) on stderr, and the
    error object on stdout under `--json` unless a result document is already there; exit."""
    from ffdebug.report import sink

    if json_out and not sink.documents_written():
        sink.write_json(failure.to_json())
    if failure.hint and failure.inline_hint:
        print(f"{program}: error: {failure.message}; {failure.hint}", file=sys.stderr)
    else:
        print(f"{program}: error: {failure.message}", file=sys.stderr)
        if failure.hint:
            print(failure.hint, file=sys.stderr)
    sys.exit(failure.exit_code)


def json_requested(argv: list[str]) -> bool:
    """`--json` among the arguments (before a `--` that ends the options)."""
    options = argv[: argv.index("--")] if "--" in argv else argv
    return "--json" in options


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

    def command_path(self, argv: list[str]) -> str:
        """`PROGRAM COMMAND [SUBCOMMAND]` named by the arguments (the program alone when none is)."""
        path, group = [self.program], self
        for token in argv:
            command = group.commands.get(token) if isinstance(group, TyperGroup) else None
            if command is None:
                if not token.startswith("-") and len(path) > 1:
                    break
                continue
            path.append(token)
            group = command
        return " ".join(path)

    def main(self, args: Any = None, *rest: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        """Run the program; standalone, every outcome is a `SystemExit` with the exit code (known
        errors as one line first). `standalone_mode=False` hands errors to the caller unchanged."""
        from ffdebug.cli.conventions import plain_flags
        from ffdebug.report import sink

        plain_flags()
        if not standalone_mode:  # a caller that handles errors itself
            return super().main(args, *rest, standalone_mode=False, **kwargs)
        argv = [str(a) for a in (sys.argv[1:] if args is None else args)]
        json_out = json_requested(argv)
        sink.reset_documents()
        try:
            rv = super().main(args, *rest, standalone_mode=False, **kwargs)
        except click_errors.NoArgsIsHelpError as err:  # the program alone prints the help
            from typer import rich_utils

            rich_utils.rich_format_error(err)
            sys.exit(err.exit_code)
        except click_errors.ClickException as err:
            fail(self.program, self._usage_failure(err, argv), json_out)
        except typer.Abort:
            print(f"{self.program}: aborted", file=sys.stderr)
            sys.exit(1)
        except Exception as err:
            known = self.known_error(err)
            if known is None or _debug_tracebacks():
                raise
            where = getattr(err, "where", None) or self.command_path(argv)
            option = str(known[0]).split(" ", 1)[0]
            given = any(a == option or a.startswith(f"{option}=") for a in argv)  # --opt V or --opt=V
            if option.startswith("--") and given and " --" not in where:
                where += f" {option}"  # a value our own code refused names its option, as usage errors do
            fail(self.program, Failure(known[1], known[0], self.hint, where), json_out)
        sys.exit(rv if isinstance(rv, int) else 0)

    def _usage_failure(self, err: click_errors.ClickException, argv: list[str]) -> Failure:
        """A usage error: its message and the help to read (on the stderr line, the hint in JSON)."""
        message = " ".join(err.format_message().split()).rstrip(".")  # click's ends in "." before our "; see"
        ctx = getattr(err, "ctx", None)
        where = ctx.command_path if ctx is not None else self.command_path(argv)
        misplaced = getattr(err, "option_name", None)
        if isinstance(err, click_errors.NoSuchOption) and misplaced in GLOBAL_OPTIONS and ctx.parent:
            program, command = ctx.parent.command_path, ctx.info_name
            message = (
                f"{misplaced} is an option of {program} itself, not of {command}: put it before the "
                f"command, as in '{program} {misplaced} {command} …'"
            )
            return Failure(err.exit_code, message, None, where)
        param = getattr(err, "param", None)
        if param is not None and getattr(param, "opts", None):
            where += f" {param.opts[0]}"
        if ctx is None:
            return Failure(err.exit_code, message, None, where)
        return Failure(err.exit_code, message, f"see '{ctx.command_path} --help'", where, inline_hint=True)


def _debug_tracebacks() -> bool:
    from ffdebug._env import debug_tracebacks

    return debug_tracebacks()
