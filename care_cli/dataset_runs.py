"""What `care csr --data` and `care eval` share about data-set runs: the `--num-processes` option, starting the
processes (torchrun, through :func:`care_core.runs.launch`) and the one line an interrupted run prints."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import typer

from care_cli.errors import UserError

ProcessesOpt = Annotated[
    int,
    typer.Option("--num-processes", "-n", help="Processes to split the data over (one GPU each on CUDA; CPU "
                                               "processes otherwise), started through torchrun."),
]  # fmt: skip


class Interrupted(Exception):
    """Ctrl-C during a run: ``message`` is the one line to print (None: print nothing, another process reports)."""

    def __init__(self, message: str | None) -> None:
        super().__init__(message or "")
        self.message = message


def check_processes(num_processes: int) -> None:
    if num_processes < 1:
        raise UserError(f"--num-processes must be at least 1, got {num_processes}")


def strip_option(argv: Sequence[str], *names: str) -> list[str]:
    """argv without ``NAME VALUE`` / ``NAME=VALUE`` for each of ``names`` (launched copies must not launch again)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in names:
            skip = True
        elif not any(arg.startswith(name + "=") for name in names):
            out.append(arg)
    return out


def relaunch(argv: Sequence[str], num_processes: int, extra: Sequence[str] = ()) -> int:
    """``care ARGV`` (without --num-processes) in ``num_processes`` processes; their exit code."""
    from care_core.runs import launch

    return launch("care_cli", [*strip_option(argv, "--num-processes", "-n"), *extra], num_processes)


def interrupted_before_start(argv: Sequence[str], output_dir: Path) -> str:
    """The line a run interrupted before it set up its folder prints (nothing is there to resume)."""
    again = rerun_line(argv)
    return f"interrupted before the run started: nothing was saved in {output_dir}; start it again with: {again}"


def rerun_line(argv: Sequence[str], add: str | None = None) -> str:
    """The command line the user ran (plus ``add`` where it is missing), quoted for a shell."""
    args = list(argv)
    if add is not None and add not in args:
        args.append(add)
    return shlex.join(["care", *args])
