"""`care csr` at data-set scale: processes (torchrun, gloo on CPU), shards, resume after SIGKILL, manifest."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import EXAMPLES

QUESTIONS = ["What is in the image?", "What colour is it?", "Where is this?", "Is there a person?",
             "What is on the left?", "How many objects are there?"]  # fmt: skip
METHODS = ["--method", "care", "--method", "random"]
BUDGETS = ["--keep", "16", "--ratio", "0.05:0.1:0.05"]


def make_pairs(folder: Path, count: int) -> Path:
    photos = ["astronaut.jpg", "coffee.jpg", "chelsea.jpg"]
    lines = [json.dumps({"image": str(EXAMPLES / photos[i % 3]), "question": QUESTIONS[i % len(QUESTIONS)]})
             for i in range(count)]  # fmt: skip
    path = folder / "pairs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def care_process(*args: object, home: Path | None = None, **kwargs: object) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if home is not None:
        env["CARE_HOME"] = str(home)
    return subprocess.Popen([sys.executable, "-m", "care_cli", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **kwargs)  # type: ignore[call-overload]  # fmt: skip


def finish(proc: subprocess.Popen[str], timeout: float = 300) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def shard_lines(folder: Path) -> list[dict[str, object]]:
    rows = []
    for shard in sorted(folder.glob("shard-*.jsonl")):
        rows += [json.loads(line) for line in shard.read_text().splitlines() if line.strip()]
    return rows


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, object]]:
    """The reference: 8 pairs, one process, no output folder."""
    folder = tmp_path_factory.mktemp("csr_single")
    data = make_pairs(folder, 8)
    code, out, err = finish(care_process("csr", "--data", data, *METHODS, *BUDGETS, "--json"))
    assert code == 0, err
    return data, json.loads(out)


def test_two_processes_give_the_same_results_as_one(single, tmp_path: Path) -> None:
    data, reference = single
    code, out, err = finish(care_process("csr", "--data", data, *METHODS, *BUDGETS, "-n", "2", "--output-dir",
                                         tmp_path / "run", "--json"))  # fmt: skip
    assert code == 0, err
    assert err == ""
    report = json.loads(out)
    assert report["processes"] == 2
    assert report["results"] == reference["results"]  # identical per-pair values, same order
    assert report["summary"] == reference["summary"]
    shards = sorted(p.name for p in (tmp_path / "run").glob("shard-*.jsonl"))
    assert shards == ["shard-000.jsonl", "shard-001.jsonl"]


def test_sigkill_then_resume_gives_the_same_report_and_computes_nothing_twice(single, tmp_path: Path) -> None:
    data, reference = single
    run = tmp_path / "run"
    # batches of one pair: a kill then lands between pairs that are each saved as they finish
    args = ["csr", "--data", data, *METHODS, *BUDGETS, "-n", "2", "--batch-size", "1", "--output-dir", run, "--json"]
    proc = care_process(*args, start_new_session=True)
    deadline = time.monotonic() + 240
    per_pair = 2 * 3  # methods x budgets
    while time.monotonic() < deadline and proc.poll() is None:
        if run.is_dir() and len(shard_lines(run)) >= 2 * per_pair:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both workers, mid-run
    proc.wait()
    before = shard_lines(run)
    assert 0 < len(before) < 8 * per_pair, f"{len(before)} of {8 * per_pair} results were saved at the kill"
    code, out, err = finish(care_process(*args, "--resume"))
    assert code == 0, err
    report = json.loads(out)
    assert report["results"] == reference["results"], f"{len(before)} results were saved at the kill"
    after = shard_lines(run)
    keys = [(r["pair_id"], r["method"], r["budget"]) for r in after]
    assert len(keys) == len(set(keys)) == 8 * per_pair  # nothing computed twice
    assert all(r in after for r in before)  # finished work was kept, not redone


def test_resume_computes_only_new_methods_and_budgets(single, tmp_path: Path) -> None:
    data, reference = single
    run = tmp_path / "run"
    first = finish(care_process("csr", "--data", data, "--method", "care", "--keep", "16", "--output-dir", run,
                                "--json"))  # fmt: skip
    assert first[0] == 0, first[2]
    assert len(shard_lines(run)) == 8
    code, out, err = finish(care_process("csr", "--data", data, *METHODS, *BUDGETS, "--output-dir", run, "--resume",
                                         "--json"))  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["results"] == reference["results"]
    assert len(shard_lines(run)) == 8 * 6  # the 8 care K=16 results were not computed again


@pytest.mark.parametrize(
    ("change", "needle"),
    [(["--alpha", "0.3"], "alpha"), (["--model", "tiny-qwen2.5-vl"], "model")],
)
def test_a_folder_of_another_setup_is_refused(care, tmp_path: Path, change: list[str], needle: str) -> None:
    data = make_pairs(tmp_path, 1)
    run = tmp_path / "run"
    assert care("csr", "--data", data, "--keep", "8", "--output-dir", run, "--json").code == 0
    again = care("csr", "--data", data, "--keep", "8", "--output-dir", run, "--json")
    assert again.code == 2 and "--resume" in again.err
    mixed = care("csr", "--data", data, "--keep", "8", "--output-dir", run, "--resume", *change)
    assert mixed.code == 2 and mixed.err.count("\n") == 1 and needle in mixed.err and "cannot be mixed" in mixed.err


def test_ratio_range_form(care, photo: Path) -> None:
    run = care("csr", photo, "-q", "What is in the image?", "--ratio", "0.05:0.2:0.05", "--json")
    assert run.code == 0, run.err
    assert run.json()["budgets"] == ["ratio 0.05", "ratio 0.1", "ratio 0.15", "ratio 0.2"]
    bad = care("csr", photo, "-q", "x", "--ratio", "0.5:0.1:0.1")
    assert bad.code == 2 and "STOP >= START" in bad.err


def test_first_use_with_two_processes_builds_the_demo_once(single, tmp_path: Path) -> None:
    """On a fresh CARE_HOME both processes want the demo: rank 0 builds it (inside a process group,
    transformers saves only on rank 0), the other waits, and the run equals the one-process run."""
    data, reference = single
    home = tmp_path / "home"
    code, out, err = finish(care_process("csr", "--data", data, *METHODS, *BUDGETS, "-n", "2", "--json", home=home))
    assert code == 0, err
    assert err == ""
    assert json.loads(out)["results"] == reference["results"]
    (folder,) = (home / "demo").iterdir()
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def test_ctrl_c_says_what_is_saved_and_how_to_resume(care, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from care_core.pipeline import ReductionPipeline

    data = make_pairs(tmp_path, 3)
    run = tmp_path / "run"
    original = ReductionPipeline.run_batch
    calls: list[int] = []

    def interrupted_on_the_second_pair(self: object, *args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ReductionPipeline, "run_batch", interrupted_on_the_second_pair)
    args = ["csr", "--data", str(data), "--method", "care", "--keep", "16", "--output-dir", str(run), "--batch-size",
            "1"]  # fmt: skip
    stopped = care(*args)
    assert stopped.code == 130 and stopped.out == ""
    expected = f"interrupted: 1 of 3 pairs done and saved in {run}; resume with: care {' '.join(args)} --resume\n"
    assert stopped.err == expected
    assert len(shard_lines(run)) == 1
    monkeypatch.setattr(ReductionPipeline, "run_batch", original)
    resumed = care(*args, "--resume", "--json")
    assert resumed.code == 0, resumed.err
    assert len(resumed.json()["results"]) == 3 and len(shard_lines(run)) == 3


def test_ctrl_c_without_an_output_folder_says_nothing_was_saved(care, photo: Path, monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:  # fmt: skip
    from care_core.pipeline import ReductionPipeline

    def interrupt(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(ReductionPipeline, "run_batch", interrupt)
    stopped = care("csr", photo, "-q", "What is in the image?", "--keep", "16")
    assert stopped.code == 130
    assert stopped.err.count("\n") == 1 and stopped.err.startswith("interrupted: nothing was saved")


def test_ctrl_c_before_the_run_started_says_nothing_was_saved(care, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from care_core.pipeline import ReductionPipeline

    def interrupt(*_: object, **__: object) -> None:
        raise KeyboardInterrupt  # Ctrl-C while the model loads

    monkeypatch.setattr(ReductionPipeline, "from_pretrained", interrupt)
    run = tmp_path / "run"
    args = ["csr", "--data", str(make_pairs(tmp_path, 3)), "--keep", "16", "--output-dir", str(run)]
    stopped = care(*args)
    assert stopped.code == 130 and stopped.out == ""
    assert stopped.err == (f"interrupted before the run started: nothing was saved in {run}; start it again with: "
                           f"care {' '.join(args)}\n")  # fmt: skip
    assert not run.exists()
