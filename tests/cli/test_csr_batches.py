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

from care_core.pipeline import ReductionPipeline

from .conftest import EXAMPLES

PHOTOS = ["astronaut.jpg", "coffee.jpg", "chelsea.jpg"]  # 512x512, 600x400, 451x300: three sizes in a batch
QUESTIONS = ["What is in the image?", "What colour is it?", "Is there a person?", "What is on the left?",
             "How many objects are there?"]  # fmt: skip
ARGS = ["--method", "care", "--method", "random", "--keep", "16", "--ratio", "0.05", "--json"]


def make_pairs(folder: Path) -> Path:
    lines = [json.dumps({"image": str(EXAMPLES / PHOTOS[i % 3]), "question": q}) for i, q in enumerate(QUESTIONS)]
    path = folder / "pairs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def saved_keys(folder: Path) -> Counter[tuple[str, str, str]]:
    rows = [json.loads(line) for shard in folder.glob("shard-*.jsonl") for line in shard.read_text().splitlines()]
    return Counter((r["pair_id"], r["method"], r["budget"]) for r in rows)


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
    assert len(got) == len(QUESTIONS) * 2 * 2 and got == direct


@pytest.mark.parametrize("size", ["3", "8"])
def test_any_batch_size_gives_the_results_of_batch_size_one(care, reference: Any, size: str) -> None:
    data, expected = reference
    result = care("csr", "--data", data, *ARGS, "--batch-size", size)
    assert result.code == 0, result.err
    report = result.json()
    assert report["results"] == expected["results"] and report["summary"] == expected["summary"]
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
    assert report["results"] == expected["results"]
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
    assert resumed.json()["results"] == expected["results"]  # nothing lost
    assert set(saved_keys(folder).values()) == {1}


@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_a_bad_batch_size_is_refused_in_one_line(care, reference: Any, value: str) -> None:
    data, _ = reference
    result = care("csr", "--data", data, "--keep", "8", "--batch-size", value)
    assert result.code == 2 and result.out == ""
    assert result.err == f"error: --batch-size must be a whole number >= 1, 'auto' or 'auto:N', got '{value}'\n"


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
    assert result.json()["results"] == expected["results"]
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
    assert result.json()["results"] == expected["results"]
    assert len(timings) == 5 * (1 + 2 * 2) and all(t == {} for t in timings)  # pairs x (image + methods x budgets)
