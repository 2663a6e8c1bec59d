"""``python -m benchmarks.gpu --docs``: the "Performance on a GPU" tables rendered from a result. The golden rows are
the figures that docs/performance.md carried, typed by hand from the same committed results, before the tables
were rendered."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pytest import raises

from benchmarks.common import RESULTS
from benchmarks.gpu import docs
from benchmarks.gpu.__main__ import parse

MICRO = RESULTS / "2026-11-26-gpu-h200-micro-plain-care-reduce.json"
STAGES = RESULTS / "2026-11-26-gpu-h200-triangular.json"


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def test_the_scoring_table_gives_the_figures_typed_from_the_same_result() -> None:
    table = "\n".join(docs.scoring_table(_load(MICRO)))
    assert ("| **`jvp` TF32, triangular factor, fused kernel** (a `Scorer`'s default on CUDA: what `care_reduce` runs) "
            "| 2.93 ms | 11.29 ms | 15.18 ms | 0.74 | 6.9e-05 / 7.4e-05 | 1.000 / 1.000 |") in table  # fmt: skip
    assert ("| `fd`: Eq. 1 literally, float32, TF32 off | 65.07 ms | 334.51 ms | — | — | 8.3e-03 / 1.0e-02 "
            "| 0.875 / 0.963 |") in table  # fmt: skip
    assert "anchors shared with float64's (K = 64 / 160)" in table
    assert "kernel only" not in table and "before #7" not in table  # rows the docs leave out


def test_the_care_reduce_table_pairs_each_setting_with_its_own_scorer_rows() -> None:
    table = docs.care_reduce_table(_load(MICRO))
    assert (
        "| 576 | 64 | TF32 (default) | 4.11 ms | 4.05 ms | 1.02 | 5.26 ms | 3.04 ms | **1.33** | ≤ 1.4 | yes / yes |"
        in table
    )
    assert (
        "| 2880 | 160 | TF32 (default) | 11.64 ms | 11.66 ms | 1.00 | 22.20 ms | 15.18 ms | **0.77** | ≤ 1.2 "
        "| yes / yes |" in table
    )
    assert "| 2880 | 160 | bf16 | 8.29 ms | 8.13 ms | 1.02 | 13.78 ms | 7.93 ms | 1.02 |  | yes / yes |" in table


def test_the_anchor_and_stage_tables_give_the_typed_figures() -> None:
    anchors = docs.anchors_table(_load(MICRO))
    assert "| 576 | 192 | 0.22 ms | 17.5 ms | 0 / 0 | 1.000 |" in anchors
    assert "| 2880 | 640 | 1.26 ms | 54.8 ms | 0 / 0 | 1.000 (same set, order differs) |" in anchors
    stages = docs.stages_table(_load(STAGES))
    assert "| llava-1.5-7b | 64 | PyTorch paths | 3.1 | 6.02 | 1.2 | 10.6 |" in stages
    assert "| llava-next-7b | 160 | engine `fd` | 334.0 | 0.67 | 2.1 | 337.1 |" in stages
    assert len(stages) == 2 + 8  # header, rule, four variants at each backbone's smallest K


def _result(folder: Path, name: str, **fields: Any) -> Path:
    full = {"environment": {"card": "NVIDIA H200"}, "source": {"commit": "abc1234def", "dirty": False},
            "m": 64, "scoring": [], "anchors": [], "workloads": [], "care_reduce": []}  # fmt: skip
    path = folder / name
    path.write_text(json.dumps({**full, **fields}), encoding="utf-8")
    return path


def test_the_newest_full_run_with_its_commit_is_rendered(tmp_path: Path) -> None:
    good = _result(tmp_path, "2026-12-01-101010-gpu-h200.json")
    _result(tmp_path, "2026-12-02-101010-gpu-h200.json", quick=True)
    _result(tmp_path, "2026-12-03-101010-gpu-h200.json", tiny=True)
    no_commit = _result(tmp_path, "2026-12-04-101010-gpu-h200.json")
    data = _load(no_commit)
    del data["source"]
    no_commit.write_text(json.dumps(data), encoding="utf-8")
    _result(tmp_path, "2026-12-05-101010-gpu-h200-latency-answers.json")  # another benchmark's
    partial = _load(good)
    del partial["workloads"]
    (tmp_path / "2026-12-06-101010-gpu-h200.json").write_text(json.dumps(partial), encoding="utf-8")
    assert docs.newest_result(tmp_path) == good


def test_write_docs_rewrites_only_the_blocks_a_result_holds(tmp_path: Path) -> None:
    doc = tmp_path / docs.DOC_FILE
    doc.parent.mkdir()
    doc.write_text(
        "".join(f"{begin}\nold\n{end}\n" for begin, end in (b.markers for b in docs.BLOCKS)), encoding="utf-8"
    )
    assert docs.write_docs(tmp_path, MICRO) == ["gpu-scoring", "gpu-anchors", "gpu-care-reduce"]
    text = doc.read_text(encoding="utf-8")
    assert text.count("old") == 1  # the stages block: the micro run has no workloads
    assert "Source: `benchmarks/results/2026-11-26-gpu-h200-micro-plain-care-reduce.json`" in text
    assert "commit not recorded" in text


def test_bad_docs_options_exit_2_in_one_line(tmp_path: Path) -> None:
    with raises(SystemExit) as stop:
        parse(["--result", str(MICRO)])
    assert stop.value.code == 2
    tiny = _result(tmp_path, "t.json", tiny=True)
    with raises(SystemExit) as stop:
        docs.write_docs(tmp_path, tiny)
    assert stop.value.code == 2
    with raises(SystemExit) as stop:
        docs.write_docs(tmp_path)  # no result under tmp_path/benchmarks/results
    assert stop.value.code == 2
