"""The new-shapes benchmark: a tiny run on the CPU (eager only: graphs need CUDA), each request's N from the Qwen
geometry by hand, and its options' bad values refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import bench_new_shapes


def test_a_tiny_run_on_the_cpu_answers_one_request_per_side_in_order(tmp_path: Path) -> None:
    bench_new_shapes.main(["--tiny", "--device", "cpu", "--families", "qwen2.5-vl", "--sides", "56,84,56",
                           "--results-dir", str(tmp_path)])  # fmt: skip
    (path,) = tmp_path.glob("*-new-shapes.json")
    (run,) = json.loads(path.read_text(encoding="utf-8"))["runs"]  # no CUDA: the eager run alone
    assert run["family"] == "qwen2.5-vl" and run["decoding"] == "eager"
    requests = run["requests"]
    assert [r["side"] for r in requests] == [56, 84, 56]
    # Qwen2.5-VL: 14 px patches merged 2 x 2, so a square side s gives (s / 28)^2 tokens: 4, 9, 4
    assert [r["N"] for r in requests] == [4, 9, 4]
    assert [r["K"] for r in requests] == [1, 1, 1]  # floor(N / 9), at least one
    assert all(r["decoding"] == "eager" and r["wall_ms"] > 0 for r in requests)


@pytest.mark.parametrize(
    ("option", "value", "said"),
    [("--sides", "672,big", "--sides takes whole numbers"), ("--sides", "10", "at least 28 px"),
     ("--decodings", "graphs", "--decodings takes default, eager")],
)  # fmt: skip
def test_bad_options_exit_2_with_one_line(option: str, value: str, said: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as stop:
        bench_new_shapes.main(["--device", "cpu", option, value])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert said in err and "\n" not in err
