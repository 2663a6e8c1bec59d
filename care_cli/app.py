"""The Typer app and the entry point that turns user errors into one line + exit 2.

Start-up stays light: command modules import typer, rich and the config dataclass only; torch and
transformers are imported when a command loads a model, after its arguments and files are checked.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import sys
import typing
import warnings
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Annotated, Any, Literal

import typer
import typer.core

from care_cli import options as opt
from care_cli import render
from care_cli.commands import csr as csr_command
from care_cli.commands import eval as eval_command
from care_cli.commands import flops as flops_command
from care_cli.commands import methods as methods_command
from care_cli.commands import reduce as reduce_command
from care_cli.commands import visualize as visualize_command
from care_cli.dataset_runs import Interrupted
from care_cli.errors import UserError
from care_core.errors import CareError, CareWarning, one_line
from care_core.home import cache_environment
from care_core.runs import scoped_environ

_EMOJI_CODE = re.compile(r"(:\S*?(?:-(?:emoji|text))?:)")  # the codes rich's markup turns into emoji
# An empty markup span: rich replaces emoji codes within each run of text between tags, so ``:[b][/b]B:`` is shown
# as ``:B:`` (nothing is added to what is shown or copied), where ``:B:`` would become an emoji.
_SPLIT_EMOJI = "[b][/b]"


def escape_help(text: str | None) -> str | None:
    """A help text shown as written: rich markup (``[tag]``) escaped, colon-delimited words that rich would turn
    into emoji (``A:B:STEP`` holds ``:B:``) kept as text, and each paragraph's lines joined (Typer keeps the line
    breaks of a description's later paragraphs, which would break a sentence where the source line ends)."""
    if not text:
        return text
    from rich.markup import escape

    text = escape(_join_lines(text))
    if ":" not in text:
        return text
    from rich.emoji import Emoji

    def keep(match: re.Match[str]) -> str:
        code = match.group(1)
        return code if Emoji.replace(code) == code else code[0] + _SPLIT_EMOJI + code[1:]

    return _EMOJI_CODE.sub(keep, text)


def _join_lines(text: str) -> str:
    """Each paragraph (blank-line separated) on one line; Typer's ``\\b`` paragraphs keep their lines."""
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(p if p.startswith("\b") else " ".join(p.split()) for p in paragraphs)


_EXPECTED = {int: "a whole number", float: "a number"}  # what an option of each type takes, in users' words


def value_problem(flag: str, annotation: Any, value: Any) -> str | None:
    """The one-line message for a value that an option's type refuses (``--keep takes a whole number, got
    '2.5'``), or None where every value given fits the type (the refusal was then about something else)."""
    if typing.get_origin(annotation) is list:
        (annotation,) = typing.get_args(annotation)
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if typing.get_origin(annotation) is Literal:
        choices = [str(choice) for choice in typing.get_args(annotation)]
        bad = [v for v in values if str(v) not in choices]
        return f"{flag} must be one of {', '.join(choices)}, got {bad[0]!r}" if bad else None
    expected = _EXPECTED.get(annotation)
    if expected is None:
        return None
    bad = [v for v in values if not _parses(annotation, v)]
    return f"{flag} takes {expected}, got {bad[0]!r}" if bad else None


def _parses(kind: type, value: Any) -> bool:
    try:
        kind(value)
    except (TypeError, ValueError):
        return False
    return True


class OptionValueError(typer.BadParameter):
    """A value an option's type refuses, shown as our one-line message (no parser prefix)."""

    def format_message(self) -> str:
        return self.message


class CareOption(typer.core.TyperOption):
    """--help in users' words: no ``<bool>`` for flags (they take no value), ``<int> (repeatable)`` for repeatable
    options instead of ``<list[int]>`` (typer versions that show types); a value the option's type refuses is
    reported by :func:`value_problem` rather than in the type checker's words."""

    def display_type_rich(self, ctx: Any) -> str | None:
        if self.is_flag:
            return None
        text = super().display_type_rich(ctx)
        if isinstance(text, str) and text.startswith("<list[") and text.endswith("]>"):
            return f"<{text[6:-2]}> (repeatable)"
        return text

    def process_value(self, ctx: Any, value: Any) -> Any:
        try:
            return super().process_value(ctx, value)
        except typer.BadParameter:
            problem = value_problem(max(self.opts, key=len), self.type_descriptor.annotation, value)
            if problem is None:
                raise
            raise OptionValueError(problem, ctx=ctx, param=self) from None


def _as_care_option(param: Any) -> None:
    if type(param) is typer.core.TyperOption:
        param.__class__ = CareOption  # the same option, shown through the subclass (it adds no state)


def _plain_help(command: typer.core.TyperCommand | typer.core.TyperGroup) -> None:
    """Every help text of a command escaped, and its options shown through :class:`CareOption`."""
    command.help = escape_help(command.help)
    for param in command.params:
        _as_care_option(param)
        if isinstance(param, (typer.core.TyperOption, typer.core.TyperArgument)):
            param.help = escape_help(param.help)


class _PlainHelp:
    """Help shown as written (see :func:`escape_help`), options through :class:`CareOption`, the help option too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _plain_help(self)  # type: ignore[arg-type]

    def get_help_option(self, ctx: Any) -> Any:
        option = super().get_help_option(ctx)  # type: ignore[misc]
        _as_care_option(option)
        return option


class CareCommand(_PlainHelp, typer.core.TyperCommand):
    """A ``care`` subcommand; a single-valued option given more than once is an error (the parser would keep the
    last value silently)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if args and not ctx.resilient_parsing:
            _, _, order = self.make_parser(ctx).parse_args(args=list(args))  # the options in the order given
            refuse_repeated_options(ctx, order)
        return super().parse_args(ctx, args)  # type: ignore[no-any-return]


def refuse_repeated_options(ctx: Any, order: Sequence[Any]) -> None:
    """UserError for the first single-valued option (value or switch) that ``order``, the parser's list of the
    options given, holds more than once; it says which commands take that option several times."""
    counts = Counter(p for p in order if isinstance(p, typer.core.TyperOption) and not (p.multiple or p.count or
                                                                                         p.is_eager))  # fmt: skip
    option, times = next(((p, n) for p, n in counts.items() if n > 1), (None, 0))
    if option is None:
        return
    flag = max(option.opts, key=len)
    given = f"given {'twice' if times == 2 else f'{times} times'}"
    command = f"care {ctx.info_name}"
    if option.is_flag:
        raise UserError(f"{'/'.join([flag, *option.secondary_opts])} {given} ({command} takes it once)")
    siblings = getattr(ctx.parent.command, "commands", {}) if ctx.parent is not None else {}
    several = [f"care {name}" for name, sub in siblings.items()
               if any(getattr(p, "multiple", False) and flag in p.opts for p in sub.params)]  # fmt: skip
    elsewhere = ""
    if several:
        listed = " and ".join([", ".join(several[:-1]), several[-1]]) if len(several) > 1 else several[0]
        elsewhere = f"; {listed} take{'s' if len(several) == 1 else ''} several"
    raise UserError(f"{flag} {given} ({command} takes one {opt.VALUE_NOUNS.get(flag, 'value')}{elsewhere})")


class CareGroup(_PlainHelp, typer.core.TyperGroup):
    """The ``care`` group."""


app = typer.Typer(
    name="care",
    cls=CareGroup,
    help="CaRe (Calibrate Before Reason): visual token reduction for vision-language models, measured.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.command("reduce", cls=CareCommand, no_args_is_help=True)(reduce_command.reduce)
app.command("csr", cls=CareCommand, no_args_is_help=True)(csr_command.csr)
app.command("methods", cls=CareCommand)(methods_command.methods)
app.command("flops", cls=CareCommand)(flops_command.flops)
app.command("visualize", cls=CareCommand, no_args_is_help=True)(visualize_command.visualize)
app.command("eval", cls=CareCommand, no_args_is_help=True)(eval_command.eval_command)


def _version(value: bool) -> None:
    if value:
        from importlib import metadata

        try:
            version = metadata.version("care-vtr")
        except metadata.PackageNotFoundError:
            from care_core import __version__ as version
        print(f"care {version}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", "-V", help="Print the version and exit.", callback=_version, is_eager=True,
                     metavar=""),
    ] = False,
) -> None:  # fmt: skip
    """CaRe (Calibrate Before Reason): visual token reduction for vision-language models, measured."""


def flags_of(command: Any, args: Sequence[str]) -> dict[str, str]:
    """Each parameter of the command that `args` invoke, mapped to its long flag as the command declares it:
    the one table through which library errors (which name parameters) are shown with the CLI's flags."""
    sub = getattr(command, "commands", {}).get(args[0]) if args else None
    params = getattr(sub, "params", [])
    return {p.name: max(p.opts, key=len) for p in params if p.opts and p.opts[0].startswith("-")}


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
    """Run the CLI: bad input gives `error: ...` on one line of stderr and exit code 2.

    A command called with no arguments prints its help and exits 2, like any other usage error.
    """
    command = typer.main.get_command(app)
    args = list(argv) if argv is not None else sys.argv[1:]
    bare = _help_for_no_args(command, args)
    try:
        with one_line_warnings(), scoped_environ(keep_set=True, **cache_environment()):
            result = command.main(args=args, prog_name="care", standalone_mode=False, obj={"argv": args})
    except CareError as exc:
        flags = flags_of(command, args)
        print(f"error: {one_line(exc.render(lambda name: flags.get(name, name)))}", file=sys.stderr)
        return 2
    except Interrupted as exc:
        return _interrupted(exc.message)
    except typer.Exit as exc:
        return int(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        print("aborted", file=sys.stderr)
        return 130
    except typer.TyperException as exc:  # the parser's usage errors (bad option value, unknown option, …)
        if bare is not None:  # a bare `care` / `care reduce`: the help was printed; still a usage error
            return 2
        context = getattr(exc, "ctx", None)
        hint = f" (see 'care {context.info_name} --help')" if context is not None and context.parent else ""
        print(f"error: {one_line(exc.format_message())}{hint}", file=sys.stderr)  # type: ignore[attr-defined]
        return int(getattr(exc, "exit_code", 2))
    if result == 130:  # Typer turned a KeyboardInterrupt the command did not handle into exit code 130
        return _interrupted("interrupted")
    return result if isinstance(result, int) else 0


@contextlib.contextmanager
def one_line_warnings() -> Iterator[None]:
    """While a command runs, each warning the library gives about the user's input (:class:`CareWarning`) is one
    ``warning:`` line on stderr, every time; other warnings are shown as Python shows them."""
    with warnings.catch_warnings():  # restores the filters and showwarning afterwards
        python_shows = warnings.showwarning
        warnings.simplefilter("always", CareWarning)

        def show(message: Warning | str, category: type[Warning], *args: Any, **kwargs: Any) -> None:
            if issubclass(category, CareWarning):
                render.print_warning(one_line(message))
            else:
                python_shows(message, category, *args, **kwargs)

        warnings.showwarning = show
        yield


def _interrupted(message: str | None) -> int:
    """Ctrl-C: the command's one line on stderr (what is saved, how to resume), exit code 130. None: a process
    started by another prints nothing (its launcher reports)."""
    if message:
        print(message, file=sys.stderr)
    return 130
