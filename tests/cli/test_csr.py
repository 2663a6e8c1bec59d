"""`care csr`: one pair or a JSONL file, methods x budgets, table / JSON / CSV / plot, and bad lines."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from PIL import Image

from care_core.methods import method_names

from .conftest import EXAMPLES

QUESTION = "What is in the image?"


def test_single_pair_all_methods(care, photo: Path) -> None:
    run = care("csr", photo, "--question", QUESTION, "--method", "all", "--keep", "64", "--json")
    assert run.code == 0, run.err
    report = run.json()
    assert report["methods"] == method_names() and report["budgets"] == ["K=64"]
    assert report["backbone"]["demo"] is True and "trained on synthetic shapes" in report["backbone"]["note"]
    assert {r["method"] for r in report["summary"]} == set(method_names())
    for row in report["results"]:
        assert 0 <= row["csr"] <= 100 and row["N"] == 576 and row["K"] == 64


def test_jsonl_three_methods_two_budgets_writes_everything(care, tmp_path: Path) -> None:
    pairs = EXAMPLES / "csr_pairs.jsonl"
    n_pairs = sum(1 for line in pairs.read_text().splitlines() if line.strip())
    out_csv, out_png = tmp_path / "csr.csv", tmp_path / "csr.png"
    args = ["csr", "--data", pairs, "--method", "care", "--method", "zoo-prune", "--method", "random",
            "--ratio", "0.11", "--keep", "128"]  # fmt: skip
    run = care(*args, "--csv", out_csv, "--plot", out_png, "--json")
    assert run.code == 0, run.err
    report = run.json()
    assert report["pairs"] == n_pairs and report["skipped"] == []
    assert len(report["results"]) == n_pairs * 3 * 2
    assert [(r["method"], r["budget"], r["n"]) for r in report["summary"]] == [
        (m, b, n_pairs) for m in ("care", "zoo-prune", "random") for b in ("ratio 0.11", "K=128")
    ]
    with out_csv.open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == n_pairs * 6 and {r["method"] for r in rows} == {"care", "zoo-prune", "random"}
    with Image.open(out_png) as im:
        assert im.format == "PNG" and im.width > 300
    table = care(*args)
    assert table.code == 0 and "CSR" in table.out and "zoo-prune" in table.out
    assert "synthetic shapes" in " ".join(table.out.split())


def test_reference_is_computed_once_per_pair(care, monkeypatch: pytest.MonkeyPatch) -> None:
    import care_core.csr as csr_module

    calls = []
    original = csr_module.csr_reference
    monkeypatch.setattr(csr_module, "csr_reference", lambda *a: calls.append(1) or original(*a))
    run = care("csr", "--data", EXAMPLES / "csr_pairs.jsonl", "--method", "care", "--method", "prca-only",
               "--keep", "32", "--keep", "64", "--json")  # fmt: skip
    assert run.code == 0, run.err
    assert len(calls) == run.json()["pairs"]


def _jsonl(tmp_path: Path, lines: list[str]) -> Path:
    (tmp_path / "cat.jpg").write_bytes((EXAMPLES / "chelsea.jpg").read_bytes())
    (tmp_path / "broken.jpg").write_bytes(b"\xff\xd8 not really")
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = json.dumps({"image": "cat.jpg", "question": "What animal is this?"})


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        ("{not json", "not valid JSON"),
        (json.dumps({"image": "cat.jpg"}), "question"),
        (json.dumps({"question": "why?"}), "image"),
        (json.dumps({"image": "broken.jpg", "question": "What?"}), "broken.jpg"),
        (json.dumps({"image": "missing.jpg", "question": "What?"}), "missing.jpg"),
    ],
)
def test_bad_line_stops_with_its_number_or_is_skipped(care, tmp_path: Path, bad: str, needle: str) -> None:
    data = _jsonl(tmp_path, [GOOD, bad, GOOD])
    run = care("csr", "--data", data, "--keep", "16")
    assert run.code == 2 and "2" in run.err and needle in run.err, run.err
    assert len(run.err.strip().splitlines()) == 1 and "Traceback" not in run.err
    run = care("csr", "--data", data, "--keep", "16", "--skip-bad", "--json")
    assert run.code == 0, run.err
    report = run.json()
    assert report["pairs"] == 2 and [s["line"] for s in report["skipped"]] == [2]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--question", QUESTION, "--method", "visonzip", "--keep", "8"], "did you mean"),
        (["--question", "   ", "--keep", "8"], "question"),
        (["--keep", "8"], "question"),
        (["--question", QUESTION], "budget"),
        (["--question", QUESTION, "--ratio", "2"], "ratio"),
        (["--question", QUESTION, "--keep", "9999"], "9999"),
        (["--question", QUESTION, "--keep", "8", "--plot", "x.gif"], ".png"),
    ],
)
def test_bad_input_is_one_line_exit_2(care, photo: Path, args: list[str], needle: str) -> None:
    run = care("csr", photo, *args)
    assert run.code == 2, run.out
    assert needle in run.err and len(run.err.strip().splitlines()) == 1, run.err


def test_question_without_tokens_is_a_clear_error(care, photo: Path) -> None:
    run = care("csr", photo, "--question", "<image>", "--keep", "8")
    assert run.code == 2 and "question" in run.err.lower()


@pytest.mark.parametrize("backbone", ["tiny-llava-next", "tiny-qwen2.5-vl"])
def test_all_methods_leave_out_what_a_backbone_cannot_serve(care, photo: Path, backbone: str) -> None:
    run = care("csr", photo, "--question", QUESTION, "--method", "all", "--keep", "64", "--model", backbone, "--json")
    assert run.code == 0, run.err
    report = run.json()
    left_out = {item["method"] for item in report["methods_skipped"]}
    assert left_out.isdisjoint(report["methods"]) and set(report["methods"]) | left_out == set(method_names())
    assert "care" in report["methods"]
    if backbone == "tiny-qwen2.5-vl":
        assert {"visionzip", "prumerge+", "ficoco-v"} <= left_out
    for item in report["methods_skipped"]:
        assert item["reason"]


def test_named_method_the_backbone_cannot_serve_is_an_error(care, photo: Path) -> None:
    run = care(
        "csr", photo, "--question", QUESTION, "--method", "visionzip", "--keep", "8", "--model", "tiny-qwen2.5-vl"
    )
    assert run.code == 2 and "CLS" in run.err and len(run.err.strip().splitlines()) == 1


def test_an_image_the_qwen_processor_refuses_is_a_bad_pair_of_its_own(care, tmp_path: Path) -> None:
    Image.new("RGB", (3000, 10), (200, 30, 30)).save(tmp_path / "thin.png")  # 300:1; Qwen takes up to 200:1
    data = _jsonl(tmp_path, [GOOD, json.dumps({"image": "thin.png", "question": "What colour?"}), GOOD])
    run = care("csr", "--data", data, "--keep", "8", "--model", "tiny-qwen2.5-vl")
    assert run.code == 2 and "line 2" in run.err and "aspect ratio 300:1 exceeds Qwen2.5-VL's limit of 200:1" in run.err
    assert len(run.err.strip().splitlines()) == 1 and "Traceback" not in run.err
    run = care("csr", "--data", data, "--keep", "8", "--model", "tiny-qwen2.5-vl", "--skip-bad", "--json")
    assert run.code == 0, run.err
    report = run.json()
    assert report["pairs"] == 2 and [s["line"] for s in report["skipped"]] == [2]
    assert "aspect ratio 300:1" in report["skipped"][0]["reason"]
