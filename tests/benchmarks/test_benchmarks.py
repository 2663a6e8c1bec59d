"""What a user of the benchmarks sees: results in a scratch folder unless --out names a new file, tables that fit
80 columns without cutting a number, and "CUDA graphs: not on CPU" where graphs cannot run."""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import pytest

from benchmarks import bench_startup, common
from benchmarks.common import RESULTS, print_table, run_main
from benchmarks.gpu.report import print_tables

COMMITTED_GPU = RESULTS / "2026-11-26-gpu-h200-triangular.json"


def _committed() -> set[Path]:
    return set(RESULTS.iterdir())


def test_results_go_to_a_scratch_folder_not_into_the_repository(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(bench_startup, "COMMANDS", (("--version",),))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    before = _committed()
    bench_startup.main(["--quick"])
    assert _committed() == before
    (scratch,) = tmp_path.iterdir()
    (written,) = scratch.glob("*-cpu-bench_startup.json")
    assert json.loads(written.read_text())["rows"][0]["command"] == "care --version"
    assert f"wrote {written}" in capsys.readouterr().out.replace("\n", "")


def test_out_refuses_an_existing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    existing = tmp_path / "result.json"
    existing.write_text("{}\n")
    with pytest.raises(SystemExit) as stop:
        bench_startup.main(["--out", str(existing)])
    assert stop.value.code == 2
    assert existing.read_text() == "{}\n"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "exists" in err


def test_the_startup_block_gives_the_figures_typed_from_its_result(tmp_path: Path) -> None:
    name = "2026-11-26-053536-cpu-bench_startup.json"
    block = bench_startup.render_markdown(json.loads((RESULTS / name).read_text()), name)
    assert "| `care --help` | 179 | 146 | none |" in block  # the rows docs/performance.md had typed by hand
    assert "| `care flops --backbone llava-next --keep 160 --json` | 435 | 397 | none |" in block
    assert "5 fresh processes a command on a 2-core machine" in block and "commit not recorded" in block
    doc = tmp_path / bench_startup.DOC_FILE
    doc.parent.mkdir()
    doc.write_text(f"intro\n{bench_startup.BEGIN}\nold\n{bench_startup.END}\nafter\n")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    with pytest.raises(SystemExit):  # no result to render
        bench_startup.write_docs(tmp_path)
    (tmp_path / "benchmarks" / "results" / name).write_text((RESULTS / name).read_text())
    assert bench_startup.write_docs(tmp_path)
    text = doc.read_text()
    assert "old" not in text and text.startswith("intro\n") and text.endswith("after\n") and "| 179 |" in text


def test_wide_table_is_split_and_keeps_every_number(capsys: pytest.CaptureFixture[str]) -> None:
    header = ("method", *(f"column number {i}" for i in range(12)))
    row = ("a method with a rather long name", *(f"{1234567.891 * (i + 1):.3f}" for i in range(12)))
    print_table("twelve wide columns", header, [row])
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert all(cell in out for cell in row[1:])  # each number whole, on one line
    assert "(2/" in out  # split into parts


def test_committed_gpu_results_print_within_80_columns(capsys: pytest.CaptureFixture[str]) -> None:
    results = json.loads(COMMITTED_GPU.read_text())
    print_tables(results)
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    fd = next(r for r in results["scoring"] if r["engine"] == "fd" and r["N"] == 2880)
    assert re.search(rf"\b{fd['ms']:.2f}\b", out)


def test_graph_cells_on_the_cpu_say_not_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    cpu_row = {"workload": "llava-1.5-7b", "decoding": "cuda graphs (static cache)", "K": 64,
               "note": "CUDA graphs: not on CPU"}  # fmt: skip
    results = {"environment": {"card": "cpu", "torch": "-", "triton": "-", "transformers": "-", "cuda": None},
               "generate": [cpu_row]}  # fmt: skip
    print_tables(results)
    out = capsys.readouterr().out
    assert any("CUDA graphs: not on CPU" in line for line in out.splitlines())
    assert max(len(line) for line in out.splitlines()) <= 80


def test_ctrl_c_ends_a_benchmark_with_code_130_and_no_traceback() -> None:
    def interrupted() -> None:
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as stop:
        run_main(interrupted)
    assert stop.value.code == 130 and stop.value.__cause__ is None and stop.value.__suppress_context__
    ran: list[bool] = []
    run_main(lambda: ran.append(True))  # an ordinary run: main's own return, nothing raised
    assert ran == [True]


def test_a_cpu_clock_times_a_call_between_its_two_marks(monkeypatch: pytest.MonkeyPatch) -> None:
    """``once`` on the CPU: perf_counter before and after the call, in ms."""
    ticks = iter([2.0, 2.0125])
    monkeypatch.setattr(common.time, "perf_counter", lambda: next(ticks))
    calls: list[int] = []
    assert common.Clock("cpu").once(lambda: calls.append(1)) == pytest.approx(12.5)
    assert calls == [1]
