"""The entry point's handling of bare invocations (help printed) versus usage errors, on every supported typer."""

from __future__ import annotations

import pytest
import typer

from care_cli.app import _help_for_no_args, app


@pytest.mark.parametrize(
    ("args", "bare"),
    [
        ([], ""),
        (["reduce"], "reduce"),
        (["csr"], "csr"),
        (["methods"], None),
        (["reduce", "x.jpg"], None),
        (["reduce", "--bogus"], None),
        (["nosuch"], None),
        (["-h"], None),
    ],
)
def test_bare_invocations_are_recognised(args: list[str], bare: str | None) -> None:
    assert _help_for_no_args(typer.main.get_command(app), args) == bare


@pytest.mark.parametrize("args", [[], ["reduce"]])
def test_bare_invocation_prints_help_not_an_error(care, args: list[str]) -> None:
    run = care(*args)  # help on stdout, no error line; a usage error all the same
    assert "Usage: care" in run.out
    assert "error:" not in run.err
    assert run.code == 2


def test_usage_error_is_one_line_and_exit_2(care) -> None:
    run = care("reduce", "--bogus")
    assert run.code == 2
    assert run.err.startswith("error: ") and run.err.count("\n") == 1
