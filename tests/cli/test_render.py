"""Human output at 80 columns (a piped command, a small terminal): no line wider, nothing cut with "…", every
name and figure on one line; long paths shown whole (wrapped); help texts shown as written."""

from __future__ import annotations

import io
import json
import re
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest
from rich.cells import cell_len
from rich.console import Console

from care_cli import render, tables
from care_cli.render import Column

from .conftest import EXAMPLES

WIDTH = 80


@pytest.fixture
def narrow(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI's stdout console at 80 columns (it writes to sys.stdout as captured by the test)."""
    monkeypatch.setattr(render, "stdout", Console(width=WIDTH, soft_wrap=False))


def _on_one_line(text: str, lines: list[str]) -> bool:
    pattern = re.compile(rf"(?<![\w.]){re.escape(text)}(?![\w.])")
    return any(pattern.search(line) for line in lines)


def assert_readable(out: str, whole: Iterable[str] = ()) -> None:
    """At most 80 columns, no ellipsis, and each of `whole` (names, figures) intact on one line."""
    lines = out.splitlines()
    assert lines, "no output"
    widest = max(lines, key=cell_len)
    assert cell_len(widest) <= WIDTH, widest
    assert "…" not in out, out
    cut = [text for text in whole if not _on_one_line(text, lines)]
    assert not cut, f"not shown whole: {cut}\n{out}"


def unboxed(out: str) -> str:
    """The output with table rules and all whitespace removed: a wrapped value reads as one string again."""
    return re.sub(r"[\s│┃]", "", out)


# ------------------------------------------------------------------------------------------------- the helper
def _recorded(columns: list[Column], rows: list[list[str]], **kwargs: object) -> str:
    console = Console(width=WIDTH, record=True, file=io.StringIO())
    render.print_table("A table", columns, rows, console=console, **kwargs)  # type: ignore[arg-type]
    return console.export_text()


def test_a_wide_table_is_split_into_parts_that_repeat_its_keys() -> None:
    columns = [Column("method", "name", key=True)] + [Column(f"figure {i}") for i in range(12)]
    rows = [[name] + [f"{1000 * i + 0.125 * r:,.3f}" for i in range(12)] for r, name in enumerate(("alpha", "beta"))]
    out = _recorded(columns, rows)
    assert_readable(out, [cell for row in rows for cell in row])
    parts = out.count("(continued)") + 1
    assert parts >= 2
    assert sum(_on_one_line("alpha", [line]) for line in out.splitlines()) == parts  # the key in every part


def test_a_table_that_cannot_fit_becomes_records() -> None:
    name, figure = "a-method-with-a-very-long-name-of-forty-six-chars", "1" * 40
    out = _recorded([Column("method", "name", key=True), Column("figure")], [[name, figure]])
    assert_readable(out, [name, figure, "figure"])


def test_text_columns_wrap_whole_words_beside_whole_figures() -> None:
    text = "a description long enough that it has to wrap over several lines of the table " * 3
    out = _recorded([Column("name", "name", key=True), Column("text", "text"), Column("figure")],
                    [["prca+simple-calib", text, "12,345.678"]])  # fmt: skip
    assert_readable(out, ["prca+simple-calib", "12,345.678", "description", "several"])


def test_piped_output_is_80_columns_unless_columns_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert render._width_when_piped() == 80
    monkeypatch.setenv("COLUMNS", "120")
    assert render._width_when_piped() is None  # rich reads COLUMNS itself


# ------------------------------------------------------------------------------------------------ the commands
def test_methods_at_80_columns(care, narrow: None) -> None:
    listed = care("methods", "--json").json()["methods"]
    run = care("methods")
    assert run.code == 0, run.err
    assert_readable(run.out, [m["name"] for m in listed] + [m["category"] for m in listed])
    assert len(run.out.splitlines()) < 6 * len(listed)  # a few lines per method, not hundreds


def test_method_details_spell_hyperparameters_as_flags(care, narrow: None) -> None:
    run = care("methods", "care")
    assert run.code == 0, run.err
    assert_readable(run.out, ["--lambda", "--theta-s", "--sigma-p", "--matmul-precision", "calibration"])
    assert "lam," not in run.out and "theta_s" not in run.out
    entry = care("methods", "care", "--json").json()["methods"]
    assert [m["name"] for m in entry] == ["care"] and "--lambda" in entry[0]["hyperparameter_flags"]
    assert care("methods", "carre").code == 2


def test_method_texts_have_no_markup_and_the_care_family_names_its_kernel_option(care) -> None:
    listed = {m["name"]: m for m in care("methods", "--json").json()["methods"]}
    assert not [name for name, m in listed.items() if "``" in m["summary"]]
    assert "until K tokens" in listed["tome"]["summary"] and "exactly K tokens" in listed["pool"]["summary"]
    for name in ("care", "prca-only", "simple-calib", "confidence-calib", "prca+simple-calib"):
        assert listed[name]["runtime_option_flags"] == ["--kernel"] and "kernel" not in listed[name]["ignores"]
    assert listed["random"]["runtime_option_flags"] == [] and "kernel" in listed["random"]["ignores"]
    details = " ".join(care("methods", "care").out.replace("│", " ").split())
    assert "also reads --kernel (how it runs, not what it computes)" in details
    assert "also reads" not in care("methods", "random").out


@pytest.mark.parametrize(
    "args",
    [
        ["--paper"],
        ["--backbone", "llava-next", "--method", "all", "--keep", "160", "--lm-head", "--vision-tower", "--paper"],
        ["--backbone", "qwen2.5-vl", "--convention", "macs", "--keep", "64", "--keep", "128", "--gqa"],
    ],
)
def test_flops_at_80_columns(care, narrow: None, args: list[str]) -> None:
    report = care("flops", *args, "--json").json()
    run = care("flops", *args)
    assert run.code == 0, run.err
    total = "tmacs" if report["convention"] == "macs" else "tflops"
    whole = [f"{row[total]:,.3f}" for row in report["rows"]] + [row["method"] for row in report["rows"]]
    if report.get("paper"):
        whole += [f"{row['diff_pct']:+,.2f}%" for row in report["paper"]["table_s1_vs_ours"]]
    assert_readable(run.out, whole)


def _csr_pairs(tmp_path: Path, count: int) -> Path:
    lines = (EXAMPLES / "csr_pairs.jsonl").read_text().splitlines()[:count]
    records = [json.loads(line) for line in lines]
    for record in records:
        record["image"] = str(EXAMPLES / record["image"])
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    return data


@pytest.mark.parametrize("case", ["one pair, every method", "several budgets and methods"])
def test_csr_at_80_columns(care, narrow: None, photo: Path, tmp_path: Path, case: str) -> None:
    if case == "one pair, every method":
        args = [photo, "--question", "What is the person wearing?", "--method", "all", "--keep", "64"]
    else:
        methods = [a for m in ("care", "visionzip", "random", "divprune") for a in ("--method", m)]
        args = ["--data", _csr_pairs(tmp_path, 2), *methods, "--ratio", "0.05:0.3:0.05", "--keep", "100"]
    report = care("csr", *args, "--json").json()
    run = care("csr", *args)
    assert run.code == 0, run.err
    whole = [f"{row['mean']:.2f}" for row in report["summary"]] + report["methods"] + report["budgets"]
    assert_readable(run.out, whole)


def test_reduce_at_80_columns_shows_long_paths_whole(care, narrow: None, photo: Path, tmp_path: Path) -> None:
    folder = tmp_path / ("a-folder-with-a-long-name-" * 3) / "and-another-one-below-it"
    folder.mkdir(parents=True)
    out = folder / "reduced-tokens-of-the-astronaut.safetensors"
    args = [photo, "--keep", "16", "--question", "What is the person wearing?", "--generate", "--max-new-tokens",
            "2", "--repeats", "1", "--out", out, "--force"]  # fmt: skip
    report = care("reduce", *args, "--json").json()
    run = care("reduce", *args)
    assert run.code == 0, run.err
    assert_readable(run.out, [str(a) for a in report["anchors"]] + [f"{report['csr']:.2f}", "576 (full)",
                                                                   "16 (reduced)"])  # fmt: skip
    assert unboxed(str(out)) in unboxed(run.out)


def test_visualize_at_80_columns(care, narrow: None, photo: Path, tmp_path: Path) -> None:
    out = tmp_path / ("a-folder-with-a-long-name-" * 3) / "four-methods-on-the-astronaut.png"
    out.parent.mkdir()
    methods = [a for m in ("care", "prca+simple-calib", "confidence-calib", "divprune") for a in ("--method", m)]
    run = care("visualize", photo, *methods, "--keep", "48", "--dpi", "40", "--out", out)
    assert run.code == 0, run.err
    assert_readable(run.out, ["prca+simple-calib", "confidence-calib", "48", "calibration"])
    assert unboxed(str(out)) in unboxed(run.out)


def test_eval_table_at_80_columns(narrow: None, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{"method": method, "budget": budget, "metric": "pope_accuracy", "value": value, "retention": retention,
             "visual_tokens": tokens, "seconds_per_sample": seconds, "samples": 500}
            for method, budget, value, retention, tokens, seconds in [
                ("none", "all", 0.8625, None, 576.0, 0.412),
                ("prca+simple-calib", "ratio 0.11", 0.8125, 94.20289855, 63.0, 0.388),
                ("confidence-calib", "K=192", 0.84, 97.39130435, 192.0, 1.25)]]  # fmt: skip
    report = {"backbone": {"name": "llava-hf/llava-v1.6-mistral-7b-hf", "note": None},
              "tables": {"care_pope_examples": rows}}  # fmt: skip
    tables.print_eval(report)
    whole = ["prca+simple-calib", "confidence-calib", "ratio 0.11", "K=192", "0.8625", "0.8125", "94.2", "97.4",
             "63.0", "0.388", "1.250"]  # fmt: skip
    assert_readable(capsys.readouterr().out, whole)


def test_methods_say_on_which_families_a_method_cannot_run_and_why(care) -> None:
    entry = care("methods", "visionzip", "--json").json()["methods"][0]
    cls_less = ["qwen2.5-vl", "qwen3-vl", "qwen3.5", "internvl3", "llava-onevision", "gemma3"]  # no CLS token (records)
    assert entry["not_served"] == dict.fromkeys(cls_less, "the vision tower's CLS token")
    assert sorted(entry["backbones"] + list(entry["not_served"])) == sorted(care("methods", "--json").json()
                                                                           ["backbone_families"])  # fmt: skip
    run = care("methods", "pool")
    assert run.code == 0 and "one raster grid" in run.out and "llava-next" in run.out
