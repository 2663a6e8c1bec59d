"""care_core.dataset_csr: the data-set CSR function that `care csr --data` and examples/dataset_csr.py both call
(the same run folder from either, each resuming the other's), the batch size it used in its result."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

from care_core.batch_sizes import CPU_BATCH_SIZE, BatchChoice, BatchSize
from care_core.budget import Budget
from care_core.dataset_csr import Pair, dataset_csr, read_pairs
from care_core.pipeline import ReductionPipeline
from care_core.runs import MANIFEST, DatasetRun

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
PHOTOS = ("astronaut.jpg", "coffee.jpg", "chelsea.jpg")


def write_pairs(folder: Path) -> Path:
    path = folder / "pairs.jsonl"
    path.write_text("".join(json.dumps({"image": str(EXAMPLES / name), "question": f"What is in image {i}?"}) + "\n"
                            for i, name in enumerate(PHOTOS)))  # fmt: skip
    return path


def folder_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_the_example_and_care_csr_write_the_same_run_folder_and_resume_each_other(
    care, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    data = write_pairs(tmp_path)
    example_dir, cli_dir = tmp_path / "example", tmp_path / "cli"
    argv = ["examples/dataset_csr.py", "--data", str(data), "--output-dir", str(example_dir), "--method", "care",
            "--method", "random", "--keep", "32", "--device", "cpu"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(str(EXAMPLES / "dataset_csr.py"), run_name="__main__")
    assert "rank 0: computed 3 pair(s) now" in capsys.readouterr().out
    options = ["--data", data, "--method", "care", "--method", "random", "--keep", "32", "--seed", "0", "--device",
               "cpu", "--json"]  # fmt: skip
    first = care("csr", *options, "--output-dir", cli_dir)
    assert first.code == 0, first.err
    written = folder_files(cli_dir)
    assert sorted(written) == [MANIFEST, "shard-000.jsonl"]
    assert written == folder_files(example_dir)  # the same manifest and the same result lines, byte for byte
    resumed = care("csr", *options, "--output-dir", example_dir, "--resume")  # the CLI resumes the example's run
    assert resumed.code == 0, resumed.err
    assert folder_files(example_dir) == written  # nothing computed again
    assert resumed.json()["results"] == first.json()["results"]


def test_the_result_holds_the_batch_size_used_and_what_this_process_computed(tmp_path: Path) -> None:
    pairs, skipped = read_pairs(write_pairs(tmp_path))
    assert skipped == [] and [p.line for p in pairs] == [1, 2, 3] and isinstance(pairs[0], Pair)
    budgets = [Budget.keep(16), Budget.ratio(0.05)]
    pipe = ReductionPipeline.from_pretrained("tiny-llava", methods=["care"], device="cpu")
    with DatasetRun(tmp_path / "run") as run:
        result = dataset_csr(run, pipe, pairs, budgets, batch_size=BatchSize(2))
    assert result.batch == BatchChoice(2, BatchSize(2), CPU_BATCH_SIZE) and result.final_batch_size == 2
    assert result.computed == 3 and result.pairs == 3 and result.skipped == []
    assert [(r["line"], r["budget"]) for r in result.results] == [(line, b) for line in (1, 2, 3)
                                                                   for b in ("K=16", "ratio 0.05")]  # fmt: skip
    assert [row["n"] for row in result.summary()] == [3, 3]
    with DatasetRun(tmp_path / "run", resume=True) as run:  # resumed with auto: nothing left to compute
        again = dataset_csr(run, pipe, pairs, budgets)
    assert again.computed == 0 and again.results == result.results
    assert again.batch == BatchChoice(CPU_BATCH_SIZE, BatchSize(), CPU_BATCH_SIZE)
