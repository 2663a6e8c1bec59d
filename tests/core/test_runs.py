"""care_core.runs: sharding, append and resume (a torn last line), the manifest check, statistics, and the
library-only example run with two processes (torchrun, gloo on the CPU) and resumed."""

from __future__ import annotations

import json
import os
import re
import runpy
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from care_core.runs import FAILED, MANIFEST, DatasetRun, RunFolderError, World, csr_summary, scoped_environ

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
# one row of the example's table
TABLE_ROW = r"[\w+-]+ +(?:K=\d+|ratio [\d.]+): CSR x100 = [-\d.]+ ± [\d.]+ \(95% CI, n = \d+\)"


def record(pid: str, method: str = "care", budget: str = "K=8", csr: float = 50.0) -> dict[str, object]:
    return {"pair_id": pid, "method": method, "budget": budget, "csr": csr, "N": 576, "K": 8}


def test_each_process_takes_every_pth_item_from_its_rank() -> None:
    items = list(range(7))
    shares = [World(rank=r, size=3).take(items) for r in range(3)]
    assert shares == [[0, 3, 6], [1, 4], [2, 5]]
    assert sorted(x for share in shares for x in share) == items
    assert World().take(items) == items


def test_a_resumed_run_cuts_a_torn_last_line_and_keeps_every_whole_one(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    with DatasetRun(folder, manifest={"model": "m"}) as run:
        run.start()
        run.append([record("1-a"), record("1-a", budget="K=16")])
        run.append([record("2-b")])
    shard = folder / "shard-000.jsonl"
    with shard.open("ab") as handle:
        handle.write(b'{"pair_id": "3-c", "method": "ca')  # a process killed mid-write
    with DatasetRun(folder, manifest={"model": "m"}, resume=True) as run:
        run.start()
        assert run.done_keys() == {("1-a", "care", "K=8"), ("1-a", "care", "K=16"), ("2-b", "care", "K=8")}
        run.append([record("3-c")])
        merged = run.merge()
    lines = shard.read_text().splitlines()
    assert len(lines) == 4 and all(json.loads(line) for line in lines)  # the torn line is gone, the new one whole
    assert set(merged) == {("1-a", "care", "K=8"), ("1-a", "care", "K=16"), ("2-b", "care", "K=8"),
                           ("3-c", "care", "K=8")}  # fmt: skip
    assert json.loads((folder / MANIFEST).read_text()) == {"format": "care.csr-run/1", "model": "m"}


def test_a_folder_with_a_run_needs_resume_and_the_same_setup(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    with DatasetRun(folder, manifest={"model": "m", "config": {"alpha": 0.5}}) as run:
        run.start(backbone={"name": "b"})  # recorded, not compared
    with pytest.raises(RunFolderError, match=r"holds a run already; pass resume") as again:
        DatasetRun(folder, manifest={"model": "m", "config": {"alpha": 0.5}})
    assert again.value.parameters == ["output_dir", "resume"]
    with pytest.raises(RunFolderError, match=r"alpha=0.5 \(now 0.3\); they cannot be mixed"):
        DatasetRun(folder, manifest={"model": "m", "config": {"alpha": 0.3}}, resume=True)
    with pytest.raises(RunFolderError, match=r"model 'm' \(now 'n'\)"):
        DatasetRun(folder, manifest={"model": "n", "config": {"alpha": 0.5}}, resume=True)
    DatasetRun(folder, manifest={"model": "m", "config": {"alpha": 0.5}}, resume=True)  # the same setup: accepted
    (tmp_path / "file").write_text("x")
    with pytest.raises(RunFolderError, match="is a file"):
        DatasetRun(tmp_path / "file")


def test_without_a_folder_results_stay_in_memory(tmp_path: Path) -> None:
    with DatasetRun(None) as run:
        run.start()
        run.append([record("1-a", csr=10.0)])
        assert run.merge() == {("1-a", "care", "K=8"): record("1-a", csr=10.0)}
    assert list(tmp_path.iterdir()) == []


def test_csr_summary_against_hand_computed_statistics() -> None:
    rows = [
        {"method": "care", "budget": "K=8", "csr": 80.0, "K": 8, "N": 16},
        {"method": "care", "budget": "K=8", "csr": 90.0, "K": 8, "N": 32},
        {"method": "care", "budget": "K=4", "csr": 70.0, "K": 4, "N": 16},
    ]
    summary = csr_summary(rows, ["care"], ["K=4", "K=8"])
    assert [(r["budget"], r["n"], r["mean"]) for r in summary] == [("K=4", 1, 70.0), ("K=8", 2, 85.0)]
    assert summary[0]["std"] == 0.0 and summary[0]["ci95"] == 0.0 and summary[0]["kept_pct"] == 25.0
    assert summary[1]["std"] == pytest.approx(5.0)  # population std of 80, 90
    assert summary[1]["ci95"] == pytest.approx(1.96 * statistics.stdev([80, 90]) / 2**0.5)  # 1.96 * 7.071 / 1.414
    assert summary[1]["kept_pct"] == pytest.approx(37.5)  # mean of 50 % and 25 %


def test_scoped_environ_restores_every_variable() -> None:
    os.environ.pop("CARE_TEST_UNSET", None)
    with scoped_environ(CARE_TEST_UNSET="1", HOME="/elsewhere"):
        assert os.environ["CARE_TEST_UNSET"] == "1" and os.environ["HOME"] == "/elsewhere"
    assert "CARE_TEST_UNSET" not in os.environ and os.environ["HOME"] != "/elsewhere"


def test_library_example_runs_on_two_processes_and_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    source = (EXAMPLES / "dataset_csr.py").read_text()
    assert "import care_cli" not in source and "from care_cli" not in source  # the library alone
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"image": str(EXAMPLES / name), "question": "What is in the image?"}) + "\n"
                             for name in ("astronaut.jpg", "coffee.jpg")))  # fmt: skip
    args = ["examples/dataset_csr.py", "--data", str(pairs), "--output-dir", str(tmp_path / "run"), "--method",
            "care", "--keep", "32"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "LOGLEVEL": "ERROR"}
    first = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    assert "rank 0: computed 1 pair(s) now" in first.stdout and "rank 1: computed 1 pair(s) now" in first.stdout
    assert "2 results in" in first.stdout
    assert sorted(p.name for p in (tmp_path / "run").glob("shard-*.jsonl")) == ["shard-000.jsonl", "shard-001.jsonl"]
    monkeypatch.chdir(ROOT)  # the resumed run in this process, alone (no torchrun): it computes nothing
    monkeypatch.setattr(sys, "argv", args)
    runpy.run_path(args[0], run_name="__main__")
    again = capsys.readouterr().out
    assert "rank 0: computed 0 pair(s) now" in again and "2 results in" in again
    # both ranks print to one pipe: rank 1's line may land inside rank 0's table line, so read the rows themselves
    table = re.findall(TABLE_ROW, first.stdout)
    assert table and table == re.findall(TABLE_ROW, again)


def test_failure_records_are_kept_apart_from_results_and_read_back_on_resume(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    bad = {"pair_id": "2-b", "line": 2, FAILED: "ValueError: absolute aspect ratio"}
    with DatasetRun(folder, manifest={"model": "m"}) as run:
        run.start()
        run.append([record("1-a")])
        run.append_failures([bad])
        assert run.failures() == {"2-b": bad}
        with pytest.raises(ValueError, match="failed"):
            run.append_failures([{"pair_id": "3-c"}])  # no error: not a failure record
    with DatasetRun(folder, manifest={"model": "m"}, resume=True) as run:
        run.start()
        assert run.done_keys() == {("1-a", "care", "K=8")}  # a failure is no result
        assert run.failures() == {"2-b": bad}
    in_memory = DatasetRun(None)
    in_memory.append_failures([bad])
    assert in_memory.failures() == {"2-b": bad} and in_memory.done_keys() == set()


def test_the_manifest_gets_the_permissions_of_the_shards(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        with DatasetRun(tmp_path / "run", manifest={"model": "m"}) as run:
            run.start()
    finally:
        os.umask(old)
    modes = {path.name: path.stat().st_mode & 0o777 for path in (tmp_path / "run").iterdir()}
    assert modes == {MANIFEST: 0o644, "shard-000.jsonl": 0o644}  # readable by others, as any file under umask 022
