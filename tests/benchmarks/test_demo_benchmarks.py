"""The demo benchmarks' bookkeeping: accuracy statistics (per-question answers in; Wilson intervals, McNemar p-values
and Spearman's rho out), the docs' markdown rendered from a results file (expected strings written by hand), and
which object each token's footprint lies on."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from PIL import Image

from benchmarks import bench_demo_accuracy as bench
from benchmarks.bench_demo_coverage import token_objects
from care_core.synthetic import Scene, SceneObject


def _row(kind: str, all_tokens: int, hits: dict[str, int], csr: dict[str, float]) -> dict[str, Any]:
    cells = {key: {"hit": hit, "csr": csr[key]} for key, hit in hits.items()}
    return {"type": kind, "all": all_tokens, "cells": cells, "seconds": {"care": 0.5, "random": 0.25}}


def test_summary_keeps_answers_in_order_and_tests_them_in_pairs() -> None:
    # Four questions; care@64 right on q1, q2; random@64 right on q2, q3, q4; all tokens right on all four.
    csr = {"care@64": 90.0, "care@128": 95.0, "random@64": 92.0, "random@128": 99.0}
    rows = [
        _row("colour", 1, {"care@64": 1, "care@128": 1, "random@64": 0, "random@128": 1}, csr),
        _row("colour", 1, {"care@64": 1, "care@128": 1, "random@64": 1, "random@128": 1}, csr),
        _row("shape", 1, {"care@64": 0, "care@128": 1, "random@64": 1, "random@128": 1}, csr),
        _row("shape", 1, {"care@64": 0, "care@128": 0, "random@64": 1, "random@128": 1}, csr),
    ]
    summary = bench.summarise(rows, ["care", "random"], [64, 128])
    assert summary["outcomes"]["care@64"] == [1, 1, 0, 0]
    assert summary["outcomes"]["all tokens"] == [1, 1, 1, 1]
    care64 = next(c for c in summary["cells"] if (c["method"], c["K"]) == ("care", 64))
    # 2 of 4, z = 1.959964, z^2/n = 0.960365: centre 0.5, half = z / 1.960365 * sqrt(0.25/4 + z^2/64)
    # = 1.959964 / 1.960365 * sqrt(0.0625 + 0.0600228) = 0.999795 * 0.350033 = 0.349961 -> [15.00, 85.00] %
    assert (care64["accuracy"], care64["accuracy_low"], care64["accuracy_high"]) == (50.0, 15.0, 85.0)
    assert care64["per_type"]["colour"] == 100.0 and care64["per_type"]["shape"] == 0.0
    # against random@64: care alone right on q1 (1), random alone on q3, q4 (2): p = 2 * (1 + 3) / 8 = 1 -> 1
    assert (care64["vs_random"]["only_this"], care64["vs_random"]["only_other"], care64["vs_random"]["p"]) == (1, 2, 1)
    # against all tokens: all tokens alone right on q3, q4: p = min(1, 2 * 1/4) = 0.5
    assert care64["vs_all_tokens"] == {"only_this": 0, "only_other": 2, "p": 0.5}
    random64 = next(c for c in summary["cells"] if (c["method"], c["K"]) == ("random", 64))
    assert random64["vs_random"] is None
    # CSR ranks (90, 95, 92, 99) -> (1, 3, 2, 4); accuracy (50, 75, 75, 100) -> (1, 2.5, 2.5, 4): means 2.5
    # dx = (-1.5, 0.5, -0.5, 1.5), dy = (-1.5, 0, 0, 1.5): sum dx*dy = 4.5, sum dx^2 = 5, sum dy^2 = 4.5
    # rho = 4.5 / sqrt(22.5) = 0.948683
    assert summary["spearman_csr_accuracy"]["rho"] == pytest.approx(0.9487, abs=1e-4)
    assert summary["spearman_csr_accuracy"]["cells"] == 4


def _payload() -> dict[str, Any]:
    def cell(method: str, k: int, acc: tuple[float, float, float], vs_random: float | None, vs_all: float,
             csr: float) -> dict[str, Any]:  # fmt: skip
        return {"method": method, "K": k, "accuracy": acc[0], "accuracy_low": acc[1], "accuracy_high": acc[2],
                "csr": csr, "vs_random": None if vs_random is None else {"only_this": 1, "only_other": 2,
                                                                          "p": vs_random},
                "vs_all_tokens": {"only_this": 0, "only_other": 9, "p": vs_all}}  # fmt: skip

    return {
        "benchmark": "bench_demo_accuracy", "model": "tiny-llava", "questions": 500, "keeps": [64, 128],
        "all_tokens": {"accuracy": 86.6, "accuracy_low": 83.34, "accuracy_high": 89.31, "per_type": {}},
        "cells": [cell("care", 64, (74.8, 70.81, 78.41), 0.7912, 0.0000031, 98.47),
                  cell("care", 128, (76.0, 72.07, 79.53), 0.0312, 0.0012, 99.2),
                  cell("random", 64, (75.4, 71.44, 78.97), None, 0.0004, 99.21)],
        "spearman_csr_accuracy": {"rho": 0.8611, "low": 0.7555, "high": 0.9225, "cells": 48, "undefined": None},
        "skipped_methods": {}, "outcomes": {},
    }  # fmt: skip


EXPECTED_MARKDOWN = """\
| method | acc. K=64 [95% CI] | acc. K=128 [95% CI] |
| --- | ---: | ---: |
| all tokens | 86.6 [83.3, 89.3] | |
| `care` | 74.8 [70.8, 78.4] | 76.0 [72.1, 79.5] |
| `random` | 75.4 [71.4, 79.0] | — |

K = 64, 500 questions:

| method | accuracy % [95% CI] | p vs `random` | p vs all tokens | CSR % |
| --- | ---: | ---: | ---: | ---: |
| all tokens | 86.6 [83.3, 89.3] | — | — | — |
| `care` | 74.8 [70.8, 78.4] | 0.791 | <0.001 | 98.5 |
| `random` | 75.4 [71.4, 79.0] | — | <0.001 | 99.2 |

K = 128, 500 questions:

| method | accuracy % [95% CI] | p vs `random` | p vs all tokens | CSR % |
| --- | ---: | ---: | ---: | ---: |
| all tokens | 86.6 [83.3, 89.3] | — | — | — |
| `care` | 76.0 [72.1, 79.5] | 0.031 | 0.001 | 99.2 |

Spearman ρ between CSR and accuracy (95% CI): 0.86 [0.76, 0.92] over 48 cells.
"""


def test_markdown_tables_from_a_results_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = tmp_path / "result.json"
    result.write_text(json.dumps(_payload()))
    bench.main(["--markdown", str(result)])
    assert capsys.readouterr().out == EXPECTED_MARKDOWN


def test_markdown_for_one_budget_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = tmp_path / "result.json"
    result.write_text(json.dumps(_payload()))
    bench.main(["--markdown", str(result), "--keep", "128"])
    out = capsys.readouterr().out
    assert out.startswith("| method | acc. K=128 [95% CI] |\n")
    assert "| `care` | 76.0 [72.1, 79.5] |\n" in out and "K = 64" not in out


def test_markdown_refuses_a_result_without_per_question_answers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = {key: value for key, value in _payload().items() if key != "outcomes"}
    result = tmp_path / "old.json"
    result.write_text(json.dumps(old))
    with pytest.raises(SystemExit) as stop:
        bench.main(["--markdown", str(result)])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "per-question outcomes" in err


def test_terminal_tables_fit_80_columns(capsys: pytest.CaptureFixture[str]) -> None:
    payload = _payload()
    payload["cells"].append({**payload["cells"][0], "method": "prca+simple-calib"})
    bench.show(payload, [64, 128])
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "74.8 [70.8, 78.4]" in out and "<0.001" in out and "0.86 [0.76, 0.92] over 48 cells" in out


def test_each_token_reads_the_object_at_its_footprint_centre() -> None:
    # A 100 x 60 image: a square centred at (20, 20) (drawn 11.5..28.5 on both axes) and a circle centred at
    # (70, 40) with radius 10. Footprint centres: (20, 20) on the square (1), (70, 40) on the circle (2),
    # (50, 10) on neither (0), and (110, 70), outside the image (padding), read at the corner (99, 59): 0.
    objects = (SceneObject("square", "red", "small", (20.0, 20.0), 20.0),
               SceneObject("circle", "blue", "small", (70.0, 40.0), 20.0))  # fmt: skip
    scene = Scene(seed=0, index=0, image=Image.new("RGB", (100, 60)), objects=objects)
    boxes = torch.tensor([[10, 10, 30, 30], [60, 30, 80, 50], [40, 0, 60, 20], [90, 50, 130, 90]])
    assert token_objects(SimpleNamespace(boxes=boxes), scene).tolist() == [1, 2, 0, 0]
