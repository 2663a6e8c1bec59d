"""CLI conventions every command shares: version, usage errors, help text, quiet --json, safe outputs,
hyperparameter ranges, labels."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest

from care_cli.app import app

from .conftest import EXAMPLES

QUESTION = "What is in the image?"


def test_version(care) -> None:
    from importlib import metadata

    run = care("--version")
    assert run.code == 0 and run.err == ""
    assert run.out.strip() == f"care {metadata.version('care-vtr')}"


@pytest.mark.parametrize("command", ["reduce", "csr", "visualize"])
def test_no_arguments_is_a_usage_error(care, command: str) -> None:
    run = care(command)
    assert run.code == 2
    assert "Usage" in run.out + run.err  # the help is shown


@pytest.mark.parametrize("command", ["reduce", "csr", "visualize", "methods", "flops"])
def test_help_shows_no_internal_type_names(care, command: str) -> None:
    run = care(command, "--help")
    assert run.code == 0
    assert "<bool>" not in run.out and "<list[" not in run.out, run.out


def test_successful_json_runs_write_nothing_on_stderr(care, photo: Path, tmp_path: Path) -> None:
    runs = [
        care("reduce", photo, "--keep", "16", "--json"),
        care("csr", photo, "--question", QUESTION, "--keep", "16", "--json"),
        care("csr", "--data", EXAMPLES / "csr_pairs.jsonl", "--keep", "16", "--json"),
        care("visualize", photo, "--keep", "16", "--out", tmp_path / "v.png", "--json"),
        care("methods", "--json"),
        care("flops", "--backbone", "llava-next", "--keep", "160", "--json"),
    ]
    for run in runs:
        assert run.code == 0, run.err
        assert run.err == ""
        json.loads(run.out)


def test_csr_refuses_two_outputs_on_one_file(care, photo: Path, tmp_path: Path) -> None:
    same = tmp_path / "a.png"
    run = care("csr", photo, "--question", QUESTION, "--keep", "8", "--csv", same, "--plot", same)
    assert run.code == 2 and run.err.count("\n") == 1 and "same file" in run.err
    assert not same.exists()


def test_force_never_replaces_a_non_regular_file(care, photo: Path, tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    run = care("reduce", photo, "--keep", "8", "--out", fifo, "--force")
    assert run.code == 2 and "not a regular file" in run.err
    assert fifo.is_fifo()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["reduce", "{photo}", "--keep", "8", "--out", "{tmp}/x.npz"], ".safetensors"),
        (["visualize", "{photo}", "--keep", "8", "--out", "{tmp}/x.jpg"], ".png, .pdf or .svg"),
        (["csr", "{photo}", "-q", QUESTION, "--keep", "8", "--csv", "{tmp}/x.txt"], ".csv"),
        (["csr", "{photo}", "-q", QUESTION, "--keep", "8", "--plot", "{tmp}/x.gif"], ".png, .pdf or .svg"),
    ],
)
def test_output_extension_must_match_its_format(care, photo: Path, tmp_path: Path, args: list[str],
                                                needle: str) -> None:  # fmt: skip
    filled = [a.format(photo=photo, tmp=tmp_path) for a in args]
    run = care(*filled)
    assert run.code == 2 and run.err.startswith("error: --") and needle in run.err, run.err
    assert list(tmp_path.iterdir()) == []


# A value outside each hyperparameter's meaningful range, and the flag the error must name (written here
# from the paper's definitions, not read from the code).
OUT_OF_RANGE = [
    ("--h", "0"), ("--m", "0"), ("--lambda", "-1"), ("--eta", "-0.1"), ("--theta-s", "3"), ("--theta-s", "-1.5"),
    ("--theta-c", "2"), ("--theta-c", "-0.1"), ("--alpha", "-0.5"), ("--sigma-p", "0"), ("--tau-g", "0"),
    ("--tau-c", "-1"), ("--tau-s", "0"), ("--eps", "0"), ("--eps", "0.5"), ("--seed", "-1"),
]  # fmt: skip


@pytest.mark.parametrize(("flag", "value"), OUT_OF_RANGE)
@pytest.mark.parametrize("command", ["reduce", "visualize"])
def test_hyperparameters_outside_their_range_are_refused(care, photo: Path, tmp_path: Path, command: str,
                                                         flag: str, value: str) -> None:  # fmt: skip
    extra = ["--out", tmp_path / "x.png"] if command == "visualize" else []
    run = care(command, photo, "--keep", "8", flag, value, *extra)
    assert run.code == 2
    assert run.err.startswith(f"error: {flag} must be") and run.err.count("\n") == 1, run.err
    assert any(c in run.err for c in "[(>")  # the range is stated


def test_csr_refuses_out_of_range_hyperparameter(care, photo: Path) -> None:
    run = care("csr", photo, "-q", QUESTION, "--keep", "8", "--theta-c", "2")
    assert run.code == 2 and run.err.startswith("error: --theta-c must be in [0, 1]")


def test_theta_s_range_follows_eta(care, photo: Path) -> None:
    # A = cos + eta * exp(...) reaches 1 + eta, so theta_s = 1.4 is meaningful when eta = 0.45 but not when eta = 0.
    assert care("reduce", photo, "--keep", "8", "--theta-s", "1.4", "--json").code == 0
    run = care("reduce", photo, "--keep", "8", "--theta-s", "1.4", "--eta", "0")
    assert run.code == 2 and "--theta-s" in run.err


def test_flops_refuses_an_incomplete_config(care, tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llava"}))
    run = care("flops", "--backbone", config)
    assert run.code == 2 and run.err.count("\n") == 1
    assert "vision_config" in run.err and "text_config" in run.err


def test_jsonl_with_a_byte_order_mark_is_read(care, tmp_path: Path) -> None:
    data = tmp_path / "bom.jsonl"
    line = json.dumps({"image": str(EXAMPLES / "astronaut.jpg"), "question": QUESTION})
    data.write_bytes(b"\xef\xbb\xbf" + line.encode() + b"\n")
    run = care("csr", "--data", data, "--keep", "8", "--json")
    assert run.code == 0, run.err
    assert run.json()["pairs"] == 1


def test_jsonl_field_of_wrong_type_says_so(care, tmp_path: Path) -> None:
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"image": 5, "question": QUESTION}) + "\n")
    run = care("csr", "--data", data, "--keep", "8")
    assert run.code == 2 and "must be a string" in run.err and ":1:" in run.err


def test_csv_names_backbone_and_demo(care, photo: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.csv"
    run = care("csr", photo, "-q", QUESTION, "--keep", "8", "--csv", out, "--json")
    assert run.code == 0, run.err
    rows = list(csv.DictReader(out.open()))
    assert rows and all(r["backbone"] == "tiny-llava" and r["demo"] == "True" for r in rows)


def test_method_all_is_the_same_list_everywhere(care, photo: Path, tmp_path: Path) -> None:
    csr = care("csr", photo, "-q", QUESTION, "--method", "all", "--keep", "8", "--json")
    vis = care("visualize", photo, "--method", "all", "--keep", "8", "--out", tmp_path / "all.png", "--json")
    assert csr.code == 0 and vis.code == 0, vis.err
    assert csr.json()["methods"] == vis.json()["methods"]


def test_every_command_is_registered() -> None:
    names = {c.name for c in app.registered_commands}
    assert names == {"reduce", "csr", "methods", "flops", "visualize", "eval"}


@pytest.mark.parametrize(
    ("args", "start"),
    [
        (["--keep", "577"], "error: --keep must be between 1 and N = 576"),
        (["--ratio", "1.5"], "error: --ratio must be in (0, 1]"),
        (["--keep", "0"], "error: --keep must be"),
        (["--keep", "8", "--max-new-tokens", "0"], "error: --max-new-tokens must be"),
        (["--keep", "8", "--question", " "], "error: --question is empty"),
    ],
)
def test_error_wording_names_the_flag(care, photo: Path, args: list[str], start: str) -> None:
    run = care("reduce", photo, *args)
    assert run.code == 2 and run.err.startswith(start) and run.err.count("\n") == 1, run.err


def test_errors_start_on_the_first_line(care, tmp_path: Path) -> None:
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"image": str(EXAMPLES / "astronaut.jpg"), "question": "x"}) + "\nnot json\n")
    run = care("csr", "--data", data, "--keep", "8")
    assert run.code == 2 and run.err.startswith("error: ") and run.err.count("\n") == 1, repr(run.err)
