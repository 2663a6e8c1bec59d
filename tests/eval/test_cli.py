"""`care eval`: the acceptance command, result files and resume, data-parallel processes, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lmms_eval")

from care_core.backbones.families import demo_backbones
from care_core.synthetic import COLOURS, MAX_OBJECTS
from care_core.synthetic import SHAPES as WORLD_SHAPES

from .conftest import POPE, ROOT, SHAPES, VQA

TRAINED_DEMOS = sorted(name for name, spec in demo_backbones().items() if spec.trained)
#: every answer the shapes world has (care_core.synthetic's questions): a trained demo answers in these words
WORLD_WORDS = {*WORLD_SHAPES, *COLOURS, "yes", "no", "left", "right", "top", "bottom",
               *(str(n) for n in range(MAX_OBJECTS + 1))}  # fmt: skip


def answers(report: dict[str, Any]) -> dict[str, dict[str, dict[str, str]]]:
    return {s["setting"]: {t: v["answers"] for t, v in s["tasks"].items()} for s in report["settings"]}


def test_acceptance_json_has_the_metric_of_every_setting(care) -> None:
    result = care("eval", "--model", "tiny-llava", "--method", "care", "--method", "random", "--keep", "64",
                  "--tasks", POPE, "--limit", "3", "--json", "--device", "cpu")  # fmt: skip
    assert result.code == 0, result.err
    assert result.err == ""  # --json: one JSON object on stdout, nothing on stderr
    report = result.json()
    assert report["command"] == "eval" and report["tasks"] == ["care_pope_examples"]
    assert [s["setting"] for s in report["settings"]] == ["none", "care K=64", "random K=64"]
    rows = report["tables"]["care_pope_examples"]
    assert [(r["method"], r["budget"], r["visual_tokens"]) for r in rows] == [
        ("none", "all", 576), ("care", "K=64", 64), ("random", "K=64", 64)]  # fmt: skip
    for row in rows:
        assert row["metric"] == "pope_accuracy" and 0.0 <= row["value"] <= 1.0
        assert row["samples"] == 3 and row["computed"] == 3 and row["seconds_per_sample"] > 0
    for setting in report["settings"]:
        assert set(setting["tasks"]["care_pope_examples"]["metrics"]) == {"pope_accuracy", "pope_f1", "pope_yes_ratio"}
    assert report["backbone"]["demo"] is True and report["output_dir"] is None


@pytest.mark.parametrize("model", TRAINED_DEMOS)
def test_every_trained_demo_answers_the_shapes_task_in_the_worlds_words(care, model: str) -> None:
    result = care("eval", "--model", model, "--method", "care", "--keep", "64", "--tasks", SHAPES, "--limit", "4",
                  "--json", "--device", "cpu")  # fmt: skip
    assert result.code == 0, result.err
    report = result.json()
    assert report["backbone"]["demo"] is True
    for setting in report["settings"]:  # all tokens and care K=64
        given = setting["tasks"]["care_shapes_examples"]["answers"]
        assert len(given) == 4
        assert {str(a).strip().lower() for a in given.values()} <= WORLD_WORDS, (model, setting["setting"], given)


def test_table_two_tasks_output_dir_and_resume(care, tmp_path: Path) -> None:
    out = tmp_path / "runs" / "next"  # missing parents are created, as mkdir -p would
    tasks = f"{POPE},{VQA / 'care_vqa_examples.yaml'}"
    args = ["eval", "--model", "tiny-llava", "--method", "random", "--keep", "32", "--tasks", tasks, "--limit", "2",
            "--output-dir", out, "--device", "cpu"]  # fmt: skip
    first = care(*args)
    assert first.code == 0, first.err
    for text in ("care_pope_examples", "care_vqa_examples", "exact_match", "retention %", "visual tokens", "s / sample",
                 "random", "K=32", "demo backbone"):  # fmt: skip
        assert text in first.out
    summary = json.loads((out / "care_eval_summary.json").read_text())
    assert [s["setting"] for s in summary["settings"]] == ["none", "random K=32"]
    for slug in ("none", "random-k32"):
        files = sorted(p.name for p in (out / "lmms_eval" / slug / "tiny-llava").iterdir())
        assert any(f.endswith("_results.json") for f in files)
        assert any(f.endswith("_samples_care_vqa_examples.jsonl") for f in files)
    assert all(t["computed"] == 2 for s in summary["settings"] for t in s["tasks"].values())
    again = care(*args[:-2], "--json", "--device", "cpu")  # same folder: every answer comes from the cache
    assert again.code == 0, again.err
    resumed = again.json()
    assert all(t["computed"] == 0 and t["samples"] == 2 for s in resumed["settings"] for t in s["tasks"].values())
    assert answers(resumed) == answers(summary)
    for task, rows in resumed["tables"].items():  # tokens and timings of cached answers: those of the first run
        assert [r["visual_tokens"] for r in rows] == [576, 32]
        assert [r["seconds_per_sample"] for r in rows] == [r["seconds_per_sample"] for r in summary["tables"][task]]
    # a killed run (of any process count) leaves only its per-rank databases, unmerged: they are still reused
    cache = out / "cache"
    for leftover in [cache / "cache.db", cache / "cache.audit.jsonl", *cache.glob("runs/*/.*ed")]:
        leftover.unlink()
    (cache / "runs" / "care-eval").rename(cache / "runs" / "killed-run")
    more = care(*args[:-6], "--limit", "3", "--output-dir", out, "--json", "--device", "cpu")
    assert more.code == 0, more.err
    assert all(t["computed"] == 1 and t["samples"] == 3 for s in more.json()["settings"] for t in s["tasks"].values())


def test_two_cpu_processes_give_the_answers_of_one(care, tmp_path: Path) -> None:
    args = ["eval", "--model", "tiny-llava", "--method", "care", "--keep", "48", "--tasks", str(POPE), "--limit", "5",
            "--device", "cpu", "--json"]  # fmt: skip
    single = care(*args)
    assert single.code == 0, single.err
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "care_cli", *args, "--num-processes", "2",
                           "--output-dir", str(tmp_path / "two")], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    double = json.loads(done.stdout)
    assert double["processes"] == 2 and single.json()["processes"] == 1
    assert answers(double) == answers(single.json())
    assert all(len(a) == 5 for s in answers(double).values() for a in s.values())
    assert (tmp_path / "two" / "care_eval_summary.json").is_file()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tasks", "examples/tasks/nope", "--keep", "8"], "--tasks examples/tasks/nope: no such task folder"),
        (["--tasks", str(POPE), "--keep", "8", "--limit", "0"], "--limit must be"),
        (["--tasks", str(POPE), "--keep", "8", "--num-processes", "0"], "--num-processes must be at least 1"),
        (["--tasks", str(POPE), "--keep", "0"], "--keep must be at least 1"),
        (["--tasks", str(POPE)], "give at least one budget"),
        (["--tasks", str(POPE), "--keep", "8", "--method", "nosuch"], "unknown method 'nosuch'"),
        (["--tasks", str(POPE), "--keep", "8", "--output-dir", str(POPE)], "overlaps the task folder"),
        (
            ["--tasks", str(POPE), "--keep", "8", "--model", "tiny-qwen2.5-vl", "--method", "visionzip"],
            "method 'visionzip' cannot run on tiny-qwen2.5-vl",
        ),
        (["--tasks", "popee", "--keep", "8"], "unknown task 'popee' (did you mean pope"),
    ],
)
def test_errors_are_one_line_exit_2(care, args: list[str], message: str) -> None:
    result = care("eval", *args)
    assert result.code == 2
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.err
    assert result.out == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_cuda_graphs_without_cuda_are_refused_before_any_answer(care) -> None:
    result = care("eval", "--tasks", str(POPE), "--keep", "8", "--cuda-graphs")
    assert result.code == 2, result.err
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and "cuda_graph=true: CUDA graphs need a CUDA device" in lines[0], result.err


def test_no_arguments_shows_help_and_help_is_plain(care) -> None:
    bare = care("eval")
    assert bare.code == 2 and "Usage" in bare.out + bare.err
    helped = care("eval", "--help")
    assert helped.code == 0 and "<bool>" not in helped.out and "<list[" not in helped.out, helped.out
    options = ("--tasks", "--method", "--keep", "--ratio", "--limit", "--output-dir", "--num-processes", "--lambda")
    assert all(option in helped.out for option in options), helped.out


def test_retention_is_the_share_of_the_unreduced_metric() -> None:
    from care_cli.commands.eval import _tables

    def setting(method: str | None, keep: int | None, value: float) -> dict[str, Any]:
        entry = {"metrics": {"acc": value, "f1": 0.5}, "metric_order": ["acc", "f1"], "visual_tokens": keep or 576,
                 "seconds_per_sample": 0.1, "samples": 4, "computed": 4}  # fmt: skip
        return {"setting": method or "none", "method": method, "keep": keep, "ratio": None, "tasks": {"t": entry}}

    rows = _tables([setting(None, None, 0.8), setting("care", 64, 0.6), setting("random", 64, 0.0)], ["t"])["t"]
    assert [(r["budget"], r["metric"], r["value"]) for r in rows] == [("all", "acc", 0.8), ("K=64", "acc", 0.6),
                                                                      ("K=64", "acc", 0.0)]  # fmt: skip
    assert [r["retention"] for r in rows] == [100.0, pytest.approx(75.0), 0.0]
    zero = _tables([setting(None, None, 0.0), setting("care", 64, 0.5)], ["t"])["t"]
    assert [r["retention"] for r in zero] == [None, None]  # no share of nothing


def test_a_failed_run_leaves_no_folder_behind(care, tmp_path: Path) -> None:
    out = tmp_path / "runs" / "next7b"
    result = care("eval", "--tasks", "pope", "--keep", "8", "--output-dir", out)
    lines = result.err.strip().splitlines()
    assert result.code == 2 and result.out == "" and len(lines) == 1 and lines[0].startswith("error: ")
    assert "needs the dataset lmms-lab-encoder/POPE from the Hugging Face hub" in lines[0], result.err
    assert list(tmp_path.iterdir()) == []  # neither runs/ nor runs/next7b/cache


def test_an_output_folder_that_cannot_be_created_is_refused(care, tmp_path: Path) -> None:
    (tmp_path / "runs").write_text("a file")
    result = care("eval", "--tasks", str(POPE), "--keep", "8", "--output-dir", tmp_path / "runs" / "next")
    assert result.code == 2 and result.err.count("\n") == 1
    assert "cannot be created" in result.err and "is a file" in result.err, result.err


@pytest.mark.parametrize(("entry", "kind"), [("cache", "a folder"), ("care_eval_summary.json", "a file")])
def test_what_a_run_writes_inside_its_output_folder_is_checked_before_loading(
    care, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, entry: str, kind: str
) -> None:
    from care_core.integrations import lmms_eval as plugin

    def no_loading(*_: object, **__: object) -> None:
        raise AssertionError("the model was loaded before the output folder was checked")

    monkeypatch.setattr(plugin, "load_adapter", no_loading)
    out = tmp_path / "run"
    out.mkdir()
    if kind == "a folder":
        (out / entry).write_text("a file where the run keeps a folder")
    else:
        (out / entry).mkdir()
    result = care("eval", "--tasks", str(POPE), "--keep", "8", "--output-dir", out)
    assert result.code == 2 and result.err.count("\n") == 1, result.err
    assert f"{out / entry} is in the way (the run writes {kind} there)" in result.err, result.err


def test_ctrl_c_before_the_run_started_says_nothing_was_saved(
    care, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from care_core.integrations import lmms_eval as plugin

    def interrupt(*_: object, **__: object) -> None:
        raise KeyboardInterrupt  # Ctrl-C while the model loads

    monkeypatch.setattr(plugin, "load_adapter", interrupt)
    out = tmp_path / "run"
    args = ["eval", "--tasks", str(POPE), "--keep", "8", "--output-dir", str(out)]
    stopped = care(*args)
    assert stopped.code == 130 and stopped.out == ""
    assert stopped.err == (f"interrupted before the run started: nothing was saved in {out}; start it again with: "
                           f"care {' '.join(args)}\n")  # fmt: skip
    assert not out.exists()


def test_the_model_is_checked_before_the_tasks(care) -> None:
    result = care("eval", "--model", "tiny-lava", "--tasks", "pope", "--keep", "8")
    assert result.code == 2 and result.err.count("\n") == 1
    assert "cannot find model 'tiny-lava'" in result.err and "POPE" not in result.err, result.err


def test_a_hub_error_behind_a_retry_says_which_dataset_and_how_to_fetch_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline without HF_HUB_OFFLINE: datasets retries and raises a RetryError around LocalTokenNotFoundError."""
    from concurrent.futures import Future

    from huggingface_hub.errors import LocalTokenNotFoundError
    from tenacity import Future as AttemptFuture
    from tenacity import RetryError

    from care_core.integrations import lmms_eval as plugin

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    attempt: Future[object] = AttemptFuture(3)
    attempt.set_exception(LocalTokenNotFoundError("Token is required"))
    selection = plugin.select_tasks(["pope"])
    error = plugin.task_error(RetryError(attempt), ["pope"], plugin.task_manager(selection))  # type: ignore[arg-type]
    message = str(error)
    assert "RetryError" not in message and "\n" not in message
    assert "task pope needs the dataset lmms-lab-encoder/POPE" in message and "not in the local cache" in message
    assert "datasets.load_dataset('lmms-lab-encoder/POPE')" in message
    # fetched into the datasets cache this run reads (the tests' own, set by eval_environment)
    assert f"HF_DATASETS_CACHE={os.environ['HF_DATASETS_CACHE']} python -c" in message


def test_ctrl_c_says_how_to_resume(care, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from care_core.integrations.lmms_eval import CareLMM

    def interrupt(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(CareLMM, "answer_batch", interrupt)
    args = ["eval", "--tasks", str(POPE), "--keep", "8", "--limit", "1", "--device", "cpu", "--output-dir",
            str(tmp_path / "run")]  # fmt: skip
    stopped = care(*args)
    assert stopped.code == 130 and stopped.out == ""
    assert stopped.err == (f"interrupted: the answers so far are saved in {tmp_path / 'run'}; resume with: care "
                           f"{' '.join(args)}\n")  # fmt: skip


def test_a_rerun_after_ctrl_c_computes_only_the_batches_not_saved(
    care, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from care_core.integrations.lmms_eval import CareLMM

    args = ["eval", "--model", "tiny-llava", "--method", "random", "--keep", "32", "--tasks", str(POPE), "--limit",
            "6", "--batch-size", "2", "--device", "cpu", "--json"]  # fmt: skip
    whole = care(*args)
    assert whole.code == 0, whole.err
    answer = CareLMM.answer_batch
    batches = []

    def third_interrupts(self: CareLMM, *rest: Any, **kwargs: Any) -> Any:
        batches.append(1)
        if len(batches) == 3:  # two batches of two documents answered and saved, then Ctrl-C
            raise KeyboardInterrupt
        return answer(self, *rest, **kwargs)

    monkeypatch.setattr(CareLMM, "answer_batch", third_interrupts)
    out = ["--output-dir", str(tmp_path / "run")]
    assert care(*args, *out).code == 130
    monkeypatch.setattr(CareLMM, "answer_batch", answer)
    rerun = care(*args, *out)
    assert rerun.code == 0, rerun.err
    first, second = rerun.json()["settings"]
    assert first["tasks"]["care_pope_examples"]["computed"] == 2  # 6 documents, 4 of them saved before the Ctrl-C
    assert second["tasks"]["care_pope_examples"]["computed"] == 6
    assert answers(rerun.json()) == answers(whole.json())


def test_a_long_notice_stays_on_one_line_at_80_columns(capsys: pytest.CaptureFixture[str]) -> None:
    from care_cli import render

    notice = ("tiny-llava: cached weights in /home/someone/.cache/care/demo/tiny-llava-v3 were corrupt (sha256 "
              "mismatch); restored from the copy shipped with care")  # fmt: skip
    assert render.stderr.width == 80  # not a terminal: rich's default width
    render.print_notices([notice])
    assert capsys.readouterr().err == f"note: {notice}\n"
