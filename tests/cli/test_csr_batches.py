"""`care csr --data --batch-size`: the results of batch size 1 at any size, out-of-memory splitting with each result
saved once, resume with another batch size, bad values refused."""

from __future__ import annotations

import contextlib
import io
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from care_core.batch_sizes import CPU_BATCH_SIZE
from care_core.pipeline import ReductionPipeline

from .conftest import EXAMPLES

PHOTOS = ["astronaut.jpg", "coffee.jpg", "chelsea.jpg"]  # 512x512, 600x400, 451x300: three sizes in a batch
QUESTIONS = ["What is in the image?", "What colour is it?", "Is there a person?", "What is on the left?",
             "How many objects are there?"]  # fmt: skip
# on the CPU whatever the machine: the records are compared with a CPU pipeline and carry no GPU-memory figure
ARGS = ["--method", "care", "--method", "random", "--keep", "16", "--ratio", "0.05", "--json", "--device", "cpu"]


def same(got: Any, want: Any) -> bool:
    """``got`` equals ``want`` field by field, floats to 1e-5 (relative or absolute): float32 products of other
    shapes (a batch's rows against one pair's) round differently on many-core CPUs (a 16-core host: CSR 6e-8 apart,
    a summary's std 1.4e-6), while counts, kept tokens and every other field stay exact."""
    if isinstance(want, float) and isinstance(got, float):
        return got == pytest.approx(want, rel=1e-5, abs=1e-5)
    if isinstance(want, dict) and isinstance(got, dict):
        return got.keys() == want.keys() and all(same(got[key], want[key]) for key in want)
    if isinstance(want, list | tuple) and isinstance(got, list | tuple):
        return len(got) == len(want) and all(same(g, w) for g, w in zip(got, want, strict=True))
    return bool(got == want)


def make_pairs(folder: Path) -> Path:
    lines = [json.dumps({"image": str(EXAMPLES / PHOTOS[i % 3]), "question": q}) for i, q in enumerate(QUESTIONS)]
    path = folder / "pairs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def shard_rows(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for shard in folder.glob("shard-*.jsonl") for line in shard.read_text().splitlines()]


def saved_keys(folder: Path) -> Counter[tuple[str, str, str]]:
    """How often each result was saved (the records of pairs recorded as bad are no results)."""
    return Counter((r["pair_id"], r["method"], r["budget"]) for r in shard_rows(folder) if "failed" not in r)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """Batch size 1: every pair alone."""
    from care_cli.app import main

    data = make_pairs(tmp_path_factory.mktemp("csr_batches"))
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert main(["csr", "--data", str(data), *ARGS, "--batch-size", "1"]) == 0
    return data, json.loads(buffer.getvalue())


def test_records_of_prefetched_images_are_those_of_the_raw_images(reference: Any) -> None:
    """The pairs' images come opened and preprocessed ahead (care_core.prefetch); run_batch on the raw images, in
    one batch, gives every record's numbers."""
    from care_core.budget import budgets_from
    from care_core.images import load_image

    _, report = reference
    pipe = ReductionPipeline.from_pretrained(None, methods=["care", "random"], device="cpu")
    budgets = budgets_from([0.05], [16])
    images = [load_image(EXAMPLES / PHOTOS[i % 3]) for i in range(len(QUESTIONS))]
    direct = {}
    for line, result in enumerate(pipe.run_batch(images, QUESTIONS, budgets, csr=True), start=1):
        for run in result.runs:
            assert run.csr is not None
            direct[(line, run.method, run.budget.label)] = (result.num_tokens, run.keep, run.result.num_tokens,
                                                            100 * run.csr)  # fmt: skip
    got = {(r["line"], r["method"], r["budget"]): (r["N"], r["K"], r["tokens_out"], r["csr"])
           for r in report["results"]}  # fmt: skip
    assert len(got) == len(QUESTIONS) * 2 * 2 and same(got, direct)


@pytest.mark.parametrize("size", ["3", "8"])
def test_any_batch_size_gives_the_results_of_batch_size_one(care, reference: Any, size: str) -> None:
    data, expected = reference
    result = care("csr", "--data", data, *ARGS, "--batch-size", size)
    assert result.code == 0, result.err
    report = result.json()
    assert same(report["results"], expected["results"]) and same(report["summary"], expected["summary"])
    assert report["batch_size"]["batch_size"] == int(size) and expected["batch_size"]["batch_size"] == 1
    assert report["compute_seconds"] > 0 and report["peak_gpu_memory_gib"] is None  # no GPU memory on the CPU


def test_out_of_memory_splits_and_saves_each_result_once(
    care, reference: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data, expected = reference
    run_batch = ReductionPipeline.run_batch
    sizes: list[int] = []

    def limited(self: Any, images: list[Any], *args: Any, **kwargs: Any) -> Any:
        sizes.append(len(images))
        if len(images) > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return run_batch(self, images, *args, **kwargs)

    monkeypatch.setattr(ReductionPipeline, "run_batch", limited)
    result = care("csr", "--data", data, *ARGS, "--batch-size", "8", "--output-dir", tmp_path / "run")
    assert result.code == 0, result.err
    assert result.err.count("splitting batches") == 1  # one notice
    report = result.json()
    assert same(report["results"], expected["results"])
    assert report["batch_size"]["final"] == 2 and max(sizes) == 5
    keys = saved_keys(tmp_path / "run")
    assert len(keys) == 5 * 2 * 2 and set(keys.values()) == {1}  # pairs x methods x budgets, each exactly once


def test_a_resumed_run_with_another_batch_size_computes_only_what_is_missing(
    care, reference: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data, expected = reference
    run_batch = ReductionPipeline.run_batch
    asked: list[str] = []
    calls = 0

    def stop_after_one_batch(self: Any, images: list[Any], questions: list[str], *args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise KeyboardInterrupt
        asked.extend(questions)
        return run_batch(self, images, questions, *args, **kwargs)

    monkeypatch.setattr(ReductionPipeline, "run_batch", stop_after_one_batch)
    folder = tmp_path / "run"
    stopped = care("csr", "--data", data, *ARGS, "--batch-size", "3", "--output-dir", folder)
    assert stopped.code == 130 and "3 of 5 pairs done" in stopped.err  # the first batch, saved
    first = list(asked)
    assert first == QUESTIONS[:3]
    asked.clear()
    calls = -100  # no more interruptions
    resumed = care("csr", "--data", data, *ARGS, "--batch-size", "2", "--output-dir", folder, "--resume")
    assert resumed.code == 0, resumed.err
    assert asked == QUESTIONS[3:]  # nothing computed twice
    assert same(resumed.json()["results"], expected["results"])  # nothing lost
    assert set(saved_keys(folder).values()) == {1}


@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_a_bad_batch_size_is_refused_in_one_line(care, reference: Any, value: str) -> None:
    data, _ = reference
    result = care("csr", "--data", data, "--keep", "8", "--batch-size", value)
    assert result.code == 2 and result.out == ""
    assert result.err == f"error: --batch-size must be a whole number >= 1, 'auto' or 'auto:N', got '{value}'\n"


def test_care_csr_parses_batch_size_once_and_reports_the_size_used(
    care, reference: Any, batch_size_parses: list[object]
) -> None:
    data, _ = reference
    result = care("csr", "--data", data, "--method", "care", "--keep", "16", "--device", "cpu", "--batch-size", "2",
                  "--json")  # fmt: skip
    assert result.code == 0, result.err
    assert batch_size_parses == ["2"]
    assert result.json()["batch_size"] == {"batch_size": 2, "requested": 2, "default": CPU_BATCH_SIZE, "final": 2}


def test_a_finished_batch_leaves_nothing_alive_for_the_next(
    care, reference: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pipeline's results carry the batch's tensors (on a GPU, its memory): once a batch's records are saved,
    none of them may outlive it (a run that kept them filled an H100 after a few hundred pairs)."""
    import gc
    import weakref

    data, expected = reference
    run_batch = ReductionPipeline.run_batch
    earlier: list[weakref.ref[Any]] = []
    alive_at_start: list[int] = []

    def watched(self: Any, images: list[Any], *args: Any, **kwargs: Any) -> Any:
        gc.collect()
        alive_at_start.append(sum(ref() is not None for ref in earlier))
        results = run_batch(self, images, *args, **kwargs)
        earlier.extend(weakref.ref(result) for result in results)
        return results

    monkeypatch.setattr(ReductionPipeline, "run_batch", watched)
    result = care("csr", "--data", data, *ARGS, "--batch-size", "2")
    assert result.code == 0, result.err
    assert same(result.json()["results"], expected["results"])
    assert len(alive_at_start) == 3 and alive_at_start == [0, 0, 0]  # batches of 2, 2, 1


def test_batches_run_untimed(care, reference: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The records hold no timings, so no stage clock synchronises CUDA for them: every result comes untimed."""
    data, expected = reference
    run_batch = ReductionPipeline.run_batch
    timings: list[dict[str, float]] = []

    def watched(self: Any, images: list[Any], *args: Any, **kwargs: Any) -> Any:
        results = run_batch(self, images, *args, **kwargs)
        timings.extend([result.timings_ms for result in results] + [r.timings_ms for x in results for r in x.runs])
        return results

    monkeypatch.setattr(ReductionPipeline, "run_batch", watched)
    result = care("csr", "--data", data, *ARGS, "--batch-size", "2")
    assert result.code == 0, result.err
    assert same(result.json()["results"], expected["results"])
    assert len(timings) == 5 * (1 + 2 * 2) and all(t == {} for t in timings)  # pairs x (image + methods x budgets)


BAD_QUESTION = "Is this the bad pair?"


def with_bad_pair(folder: Path) -> Path:
    """The reference pairs with one more at line 3, whose question makes any batch holding it fail."""
    lines = [json.dumps({"image": str(EXAMPLES / PHOTOS[i % 3]), "question": q}) for i, q in enumerate(QUESTIONS)]
    lines.insert(2, json.dumps({"image": str(EXAMPLES / PHOTOS[0]), "question": BAD_QUESTION}))
    path = folder / "pairs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def by_content(results: list[dict[str, Any]]) -> dict[tuple[str, str, str, str], float]:
    return {(r["image"], r["question"], r["method"], r["budget"]): r["csr"] for r in results}


@pytest.fixture
def failing_batches(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """run_batch raises a plain ValueError (as an image processor does) for any batch holding BAD_QUESTION; every
    call's questions are logged."""
    run_batch = ReductionPipeline.run_batch
    calls: list[list[str]] = []

    def failing(self: Any, images: list[Any], questions: list[str], *args: Any, **kwargs: Any) -> Any:
        calls.append(list(questions))
        if BAD_QUESTION in questions:
            raise ValueError("absolute aspect ratio must be smaller than 200 (simulated)")
        return run_batch(self, images, questions, *args, **kwargs)

    monkeypatch.setattr(ReductionPipeline, "run_batch", failing)
    return calls


def test_a_pair_failing_in_a_batch_is_skipped_alone_recorded_and_left_alone_on_resume(
    care, reference: Any, tmp_path: Path, failing_batches: list[list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, expected = reference
    data = with_bad_pair(tmp_path)
    folder = tmp_path / "run"
    args = ["csr", "--data", data, *ARGS, "--batch-size", "4", "--output-dir", folder]
    result = care(*args, "--skip-bad")
    assert result.code == 0, result.err
    report = result.json()
    assert same(by_content(report["results"]), by_content(expected["results"]))  # every other pair's own results
    assert report["skipped"] == [{"line": 3, "reason": "ValueError: absolute aspect ratio must be smaller than 200 "
                                                       "(simulated)"}]  # fmt: skip
    # lines 1-4 fail together -> 1, 2 -> 3, 4 -> 3 alone (fails), 4 alone; then 5, 6
    assert [len(c) for c in failing_batches] == [4, 2, 2, 1, 1, 2]
    assert report["batch_size"]["final"] == 4
    assert len(saved_keys(folder)) == 5 * 2 * 2 and set(saved_keys(folder).values()) == {1}
    assert [(r["line"], r["question"]) for r in shard_rows(folder) if "failed" in r] == [(3, BAD_QUESTION)]
    failing_batches.clear()
    resumed = care(*args, "--resume")  # without --skip-bad: the recorded pair is skipped, not retried
    assert resumed.code == 0, resumed.err
    assert failing_batches == []  # nothing computed
    assert resumed.json()["results"] == report["results"] and resumed.json()["skipped"] == report["skipped"]
    retried = care(*args, "--resume", "--retry-bad", "--skip-bad")
    assert retried.code == 0, retried.err
    assert failing_batches == [[BAD_QUESTION]]  # retried alone, once: still bad
    assert retried.json()["skipped"] == report["skipped"]
    monkeypatch.undo()  # the pair can be served now
    fixed = care(*args, "--resume", "--retry-bad")
    assert fixed.code == 0, fixed.err
    assert len(fixed.json()["results"]) == 6 * 2 * 2 and fixed.json()["skipped"] == []


def test_a_pair_failing_alone_stops_the_run_in_one_line_keeping_what_finished(
    care, tmp_path: Path, failing_batches: list[list[str]]
) -> None:
    data = with_bad_pair(tmp_path)
    folder = tmp_path / "run"
    result = care("csr", "--data", data, *ARGS, "--batch-size", "4", "--output-dir", folder)
    assert result.code == 2 and result.out == ""
    assert result.err == (f"error: line 3 ({EXAMPLES / PHOTOS[0]}): ValueError: absolute aspect ratio must be smaller "
                          "than 200 (simulated)\n")  # fmt: skip
    saved = {json.loads(line)["line"] for line in (folder / "shard-000.jsonl").read_text().splitlines()}
    assert saved == {1, 2}  # computed before the bad pair, and saved; nothing recorded as bad


def test_an_image_the_backbone_may_refuse_costs_at_most_its_own_line(
    care, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 3000x10 image among small ones on tiny-qwen2.5-vl (its image processor refuses aspect ratios of 200 and
    more, inside the image loader): either it is served, or only its line is skipped; a resumed run computes
    nothing."""
    from PIL import Image

    lines = []
    for i in range(6):
        Image.new("RGB", (112 + 28 * i, 112), (40 * i, 120, 60)).save(tmp_path / f"shape{i}.png")  # N >= 16
        lines.append(json.dumps({"image": f"shape{i}.png", "question": f"What colour is shape {i}?"}))
    Image.new("RGB", (3000, 10), (200, 20, 20)).save(tmp_path / "wide.png")
    lines.insert(2, json.dumps({"image": "wide.png", "question": "What is this?"}))
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(lines) + "\n")
    args = ["csr", "--data", data, "--model", "tiny-qwen2.5-vl", "--method", "care", "--keep", "8", "--skip-bad",
            "--batch-size", "4", "--output-dir", tmp_path / "run", "--json"]  # fmt: skip
    result = care(*args)
    assert result.code == 0, result.err
    report = result.json()
    served = [r["line"] for r in report["results"]]
    skipped = [s["line"] for s in report["skipped"]]
    assert (served, skipped) in (([1, 2, 3, 4, 5, 6, 7], []), ([1, 2, 4, 5, 6, 7], [3]))

    def computes(*_: object, **__: object) -> None:
        raise AssertionError("a resumed run computed something")

    monkeypatch.setattr(ReductionPipeline, "run_batch", computes)
    resumed = care(*args, "--resume")
    assert resumed.code == 0, resumed.err
    assert resumed.json()["results"] == report["results"] and resumed.json()["skipped"] == report["skipped"]
