"""The Typer app: `care reduce`, and the entry point that turns user errors into one line + exit 2."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import typer

from care_cli.commands import csr as csr_command
from care_cli.commands import flops as flops_command
from care_cli.commands import methods as methods_command
from care_cli.commands import reduce as reduce_command
from care_cli.commands import visualize as visualize_command
from care_core.errors import CareError

app = typer.Typer(
    name="care",
    help="CaRe (Calibrate Before Reason): visual token reduction for vision-language models, measured.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.command("reduce", no_args_is_help=True)(reduce_command.reduce)
app.command("csr", no_args_is_help=True)(csr_command.csr)
app.command("methods")(methods_command.methods)
app.command("flops")(flops_command.flops)
app.command("visualize", no_args_is_help=True)(visualize_command.visualize)


@app.callback()
def _root() -> None:
    """CaRe (Calibrate Before Reason): visual token reduction for vision-language models, measured."""


def _one_line(message: object) -> str:
    return " ".join(str(message).split())


def _help_for_no_args(command: Any, args: Sequence[str]) -> str | None:
    """The command whose help a bare invocation prints: "" for `care`, "reduce" for `care reduce`; else None.

    The parser signals this with a usage error whose class (``NoArgsIsHelpError``) lives in a private module
    (click's, or typer's vendored copy since 0.29), so it is recognised from the arguments instead, by the
    parser's own rule: no arguments for a command with ``no_args_is_help``.
    """
    if not args:
        return "" if getattr(command, "no_args_is_help", False) else None
    if len(args) == 1:
        sub = getattr(command, "commands", {}).get(args[0])
        if sub is not None and getattr(sub, "no_args_is_help", False):
            return str(args[0])
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; bad input gives `error: ...` on one line of stderr and exit code 2."""
    command = typer.main.get_command(app)
    bare = _help_for_no_args(command, list(argv) if argv is not None else sys.argv[1:])
    try:
        result = command.main(args=list(argv) if argv is not None else None, prog_name="care", standalone_mode=False)
    except CareError as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except typer.Exit as exc:
        return int(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        print("aborted", file=sys.stderr)
        return 130
    except typer.TyperException as exc:  # the parser's usage errors (bad option value, unknown option, …)
        if bare is not None:  # help was printed for a bare `care` (bare == "") / `care reduce` (bare == "reduce")
            return 0
        context = getattr(exc, "ctx", None)
        hint = f" (see 'care {context.info_name} --help')" if context is not None and context.parent else ""
        print(f"error: {_one_line(exc.format_message())}{hint}", file=sys.stderr)  # type: ignore[attr-defined]
        return int(getattr(exc, "exit_code", 2))
    return result if isinstance(result, int) else 0
