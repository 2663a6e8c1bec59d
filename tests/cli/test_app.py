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


SEVERAL_BUDGETS = "care csr, care flops and care eval take several"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["reduce", "x.jpg", "--keep", "8", "--method", "care", "--method", "random"],
         "--method given twice (care reduce takes one method; care csr, care flops, care visualize and care eval take "
         "several)"),
        (["reduce", "x.jpg", "--keep", "8", "--keep", "9"], f"--keep given twice (care reduce takes one budget; "
                                                              f"{SEVERAL_BUDGETS})"),
        (["reduce", "x.jpg", "--ratio", "0.1", "--ratio", "0.5"], f"--ratio given twice (care reduce takes one "
                                                                    f"budget; {SEVERAL_BUDGETS})"),
        (["reduce", "x.jpg", "-k", "8", "--keep", "9", "-k", "3"], f"--keep given 3 times (care reduce takes one "
                                                                     f"budget; {SEVERAL_BUDGETS})"),
        (["visualize", "x.jpg", "--ratio", "0.1", "-r", "0.2"], f"--ratio given twice (care visualize takes one "
                                                                  f"budget; {SEVERAL_BUDGETS})"),
        (["reduce", "x.jpg", "--keep", "8", "--model", "a", "--model", "b"],
         "--model given twice (care reduce takes one value)"),
        (["csr", "x.jpg", "-q", "q", "--keep", "8", "--seed", "1", "--seed", "2"],
         "--seed given twice (care csr takes one value)"),
        (["eval", "--tasks", "t", "--limit", "3", "--limit", "4"], "--limit given twice (care eval takes one value)"),
        (["reduce", "x.jpg", "--keep", "8", "--generate", "--cuda-graphs", "--no-cuda-graphs"],
         "--cuda-graphs/--no-cuda-graphs given twice (care reduce takes it once)"),
    ],
    ids=["method", "keep", "ratio", "keep-3-times", "visualize-ratio", "model", "seed", "limit", "switch"],
)  # fmt: skip
def test_a_single_valued_option_given_twice_is_an_error(care, args: list[str], message: str) -> None:
    run = care(*args)  # the parser alone would keep the last value silently
    assert run.code == 2 and run.out == ""
    assert run.err == f"error: {message}\n"


def test_repeatable_options_still_repeat(care) -> None:
    run = care("flops", "--backbone", "llava-1.5", "--keep", "64", "--keep", "32", "--method", "care", "--method",
               "random", "--json")  # fmt: skip
    assert run.code == 0, run.err
    report = run.json()
    assert report["budgets"] == [64, 32] and report["methods"] == ["care", "random"]
