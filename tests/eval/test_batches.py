"""Batches in the lmms-eval plugin and `care eval`: the answers of batch size 1 at any size, per request its own
document, lmms-eval's batch_size values, out-of-memory splitting."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("lmms_eval")

from care_core.backbones import load_backbone
from care_core.batch_sizes import CPU_BATCH_SIZE, BatchChoice, BatchSize, parse_batch_size
from care_core.integrations import lmms_eval as plugin
from care_core.integrations.settings import EvalSpec, ModelArgsError

from .conftest import POPE, ROOT


@pytest.fixture(scope="module")
def llava() -> Any:
    return load_backbone("tiny-llava", device="cpu")


def documents() -> list[dict[str, Any]]:
    """The POPE examples: three photos of three sizes (512x512, 600x400, 451x300)."""
    rows = [json.loads(line) for line in (POPE / "data.jsonl").read_text().splitlines() if line.strip()]
    return [{**row, "path": str(ROOT / "examples" / Path(row["image"]).name)} for row in rows]


def requests(count: int) -> list[Any]:
    """``count`` requests of two tasks and two generation settings, interleaved: neighbours differ in task, image
    size and settings (what upstream wrappers get wrong when they take a chunk's first task)."""
    from PIL import Image

    def visual(doc: dict[str, Any]) -> list[Any]:
        return [Image.open(doc["path"]).convert("RGB")]

    docs = documents()
    out = []
    for i in range(count):
        doc_id = (i * 5) % 12  # 0, 5, 10, 3, 8, 1, ...: the three photos mixed
        task = ("pope_a", "pope_b")[i % 2]
        gen = {"max_new_tokens": 3, "until": ["\n"]} if i % 3 else {"max_new_tokens": 2}
        out.append(SimpleNamespace(args=(f"Q{i}: {docs[doc_id]['question']}", gen, visual, doc_id, task, "test")))
    return out


def answered(llava: Any, batch_size: int | str, count: int = 7, **kwargs: Any) -> Any:
    lm = plugin.CareLMM.from_spec(EvalSpec(pretrained="tiny-llava", method="care", keep=24), llava,
                                  batch_size=parse_batch_size(batch_size), **kwargs)  # fmt: skip
    docs = documents()
    lm.task_dict = {"pope_a": {"test": docs}, "pope_b": {"test": docs}}
    return lm, lm.generate_until(requests(count))


@pytest.fixture(scope="module")
def one_at_a_time(llava: Any) -> tuple[list[str], list[Any]]:
    """The reference: every request alone (batch size 1)."""
    lm, answers = answered(llava, 1)
    return answers, lm.records


@pytest.mark.parametrize("batch_size", [3, 8])
def test_any_batch_size_gives_the_answers_of_batch_size_one(llava: Any, one_at_a_time: Any, batch_size: int) -> None:
    reference, records = one_at_a_time
    lm, answers = answered(llava, batch_size)
    assert answers == reference
    by_request = sorted(lm.records, key=lambda r: (r.task, r.doc_id))
    alone = sorted(records, key=lambda r: (r.task, r.doc_id))
    assert [(r.task, r.doc_id, r.answer, r.visual_tokens, r.num_tokens) for r in by_request] == [
        (r.task, r.doc_id, r.answer, r.visual_tokens, r.num_tokens) for r in alone
    ]
    assert {r.batch_size for r in records} == {1} and max(r.batch_size for r in lm.records) > 1


def test_each_request_keeps_its_own_task_document_and_stop_strings(llava: Any, one_at_a_time: Any) -> None:
    _, records = one_at_a_time
    assert sorted((r.task, r.doc_id) for r in records) == sorted(
        (("pope_a", "pope_b")[i % 2], (i * 5) % 12) for i in range(7)
    )
    assert all("\n" not in r.answer for r in records)


def faulty_plugin(
    llava: Any, monkeypatch: pytest.MonkeyPatch, fault: Callable[[list[Any], list[str]], Exception | None]
) -> tuple[Any, list[int], list[str]]:
    """The plugin at batch size 8 on both tasks' documents, its pipeline's ``run_batch`` raising what ``fault`` gives
    for a batch (else running it); with the sizes of every call and the notices it gave."""
    notices: list[str] = []
    lm = plugin.CareLMM.from_spec(EvalSpec(pretrained="tiny-llava", method="care", keep=24), llava,
                                  batch_size=BatchSize(8), on_notice=notices.append)  # fmt: skip
    run_batch = lm.pipeline.run_batch
    sizes: list[int] = []

    def faulty(images: list[Any], questions: list[str], *args: Any, **kwargs: Any) -> Any:
        sizes.append(len(images))
        error = fault(images, questions)
        if error is not None:
            raise error
        return run_batch(images, questions, *args, **kwargs)

    monkeypatch.setattr(lm.pipeline, "run_batch", faulty)
    docs = documents()
    lm.task_dict = {"pope_a": {"test": docs}, "pope_b": {"test": docs}}
    return lm, sizes, notices


def test_a_batch_out_of_memory_is_split_and_every_request_answered_once(
    llava: Any, one_at_a_time: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference, _ = one_at_a_time

    def out_of_memory(images: list[Any], questions: list[str]) -> Exception | None:
        return torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)") if len(images) > 2 else None

    lm, sizes, notices = faulty_plugin(llava, monkeypatch, out_of_memory)
    assert lm.generate_until(requests(7)) == reference
    assert sorted((r.task, r.doc_id) for r in lm.records) == sorted(
        (("pope_a", "pope_b")[i % 2], (i * 5) % 12) for i in range(7)
    )  # each request recorded exactly once
    assert len(notices) == 1 and "splitting batches" in notices[0]
    assert lm.batch_size == 2 and max(sizes) > 2


def test_a_request_failing_in_a_batch_is_answered_empty_and_the_others_keep_their_answers(
    llava: Any, one_at_a_time: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference, _ = one_at_a_time

    def bad_request(images: list[Any], questions: list[str]) -> Exception | None:
        if any(q.startswith("Q3: ") for q in questions):  # request 3: task pope_b, document 3
            return ValueError("absolute aspect ratio must be smaller than 200 (simulated)")
        return None

    lm, sizes, notices = faulty_plugin(llava, monkeypatch, bad_request)
    answers = lm.generate_until(requests(7))
    assert answers == [*reference[:3], "", *reference[4:]]  # only its own answer is lost
    reason = "ValueError: absolute aspect ratio must be smaller than 200 (simulated)"
    assert lm.failures == [plugin.SampleFailure("pope_b", 3, reason)]
    assert notices == [f"task pope_b, document 3: answered with an empty string, the sample failed: {reason}"]
    assert sorted((r.task, r.doc_id) for r in lm.records) == sorted(
        (("pope_a", "pope_b")[i % 2], (i * 5) % 12) for i in range(7) if i != 3
    )
    # requests 0, 3, 6 (2 new tokens, the first group) fail together -> 0, 3 -> 0 alone, 3 alone (fails) -> 6; then
    # 1, 2, 4, 5 (3 new tokens) in one batch
    assert sizes == [3, 2, 1, 1, 1, 4] and lm.batch_size == 8


def test_care_eval_counts_failed_samples_and_names_them(care, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from care_core.pipeline import ReductionPipeline

    run_batch = ReductionPipeline.run_batch

    def failing(self: Any, images: list[Any], questions: list[str], *args: Any, **kwargs: Any) -> Any:
        if any("Is there a flag in the image?" in q for q in questions):  # document 1 of the POPE examples
            raise ValueError("the image cannot be served (simulated)")
        return run_batch(self, images, questions, *args, **kwargs)

    monkeypatch.setattr(ReductionPipeline, "run_batch", failing)
    result = care("eval", "--model", "tiny-llava", "--method", "care", "--keep", "16", "--tasks", POPE, "--limit", "2",
                  "--device", "cpu", "--batch-size", "4", "--json")  # fmt: skip
    assert result.code == 0, result.err
    named = "task care_pope_examples, document 1: answered with an empty string, the sample failed: ValueError: the "
    assert result.err.count(named) == 2  # once per setting (all tokens, care K=16)
    for setting in result.json()["settings"]:
        task = setting["tasks"]["care_pope_examples"]
        assert task["failed_samples"] == 1 and task["computed"] == task["samples"] == 2
        assert task["answers"]["1"] == "" and task["answers"]["0"] != ""


@pytest.mark.parametrize(("given", "expected"), [(1, 1), ("4", 4), ("auto", CPU_BATCH_SIZE), ("auto:4", 2)])
def test_batch_size_from_lmms_eval_cli_is_accepted(given: object, expected: int) -> None:
    lm = plugin.CareLMM(pretrained="tiny-llava", method="none", device="cpu", batch_size=given,
                        max_batch_size=2 if given == "auto:4" else None)  # fmt: skip
    assert lm.batch_size == expected and lm.batch_sizes == {"batch_size": expected}


@pytest.mark.parametrize("given", ["0", "x", -1])
def test_a_bad_batch_size_is_refused_in_one_line_before_loading(given: object) -> None:
    with pytest.raises(ModelArgsError, match=r"^batch_size must be a whole number >= 1, 'auto' or 'auto:N', got"):
        plugin.CareLMM(pretrained="no-such-model", method="none", batch_size=given)


def test_warm_up_runs_the_batch_size_used_then_one_image_and_records_nothing(llava: Any) -> None:
    lm = plugin.CareLMM.from_spec(EvalSpec(pretrained="tiny-llava", method=None), llava, batch_size=BatchSize(3))
    sizes: list[int] = []
    run_batch = lm.pipeline.run_batch

    def spy(images: list[Any], *args: Any, **kwargs: Any) -> Any:
        sizes.append(len(images))
        return run_batch(images, *args, **kwargs)

    lm.pipeline.run_batch = spy  # type: ignore[method-assign]
    lm.warm_up()
    assert sizes == [3, 1] and lm.records == []  # one image: the kernels' other size class (a last, small batch)


def test_auto_is_picked_per_setting_for_the_tokens_its_answers_read(llava: Any, monkeypatch: Any) -> None:
    from care_core import batch_sizes
    from care_core.budget import Budget

    asked: list[Any] = []

    def rule(adapter: Any, *, budget: Any = None, **kwargs: Any) -> int:
        asked.append(budget)
        return 2 if budget is None else 5

    monkeypatch.setattr(batch_sizes, "default_batch_size", rule)
    unreduced = plugin.CareLMM.from_spec(EvalSpec(pretrained="tiny-llava", method=None), llava, batch_size=BatchSize())
    reduced = plugin.CareLMM.from_spec(EvalSpec(pretrained="tiny-llava", method="care", keep=24), llava,
                                       batch_size=BatchSize())  # fmt: skip
    assert (unreduced.batch_size, reduced.batch_size) == (2, 5)
    assert asked == [None, Budget.keep(24)]


def test_care_eval_batch_sizes_give_the_same_answers(care, tmp_path: Path) -> None:
    args = ["eval", "--model", "tiny-llava", "--method", "care", "--keep", "16", "--tasks", POPE, "--limit", "6",
            "--device", "cpu", "--json"]  # fmt: skip
    reports = {}
    for size in ("1", "4"):
        result = care(*args, "--batch-size", size)
        assert result.code == 0, result.err
        reports[size] = result.json()
    one, four = reports["1"], reports["4"]
    assert one["batch_size"] == {"batch_size": 1, "requested": 1, "default": CPU_BATCH_SIZE}
    assert four["batch_size"]["batch_size"] == 4 and [s["batch_size"] for s in four["settings"]] == [4, 4]
    assert [s["batch_size_start"] for s in four["settings"]] == [4, 4]
    assert [s["peak_gpu_memory_gib"] for s in four["settings"]] == [None, None]  # no GPU memory on the CPU
    for a, b in zip(one["settings"], four["settings"], strict=True):
        assert a["tasks"]["care_pope_examples"]["answers"] == b["tasks"]["care_pope_examples"]["answers"]
        assert a["tasks"]["care_pope_examples"]["metrics"] == b["tasks"]["care_pope_examples"]["metrics"]


def test_care_eval_reports_each_settings_wait_for_inputs_inside_its_pass(care, monkeypatch: Any) -> None:
    from care_core.prefetch import Prefetcher

    prepared = Prefetcher.inputs
    delay_s = 0.2

    def slow(self: Any, chunk: Any, ahead: int) -> Any:
        time.sleep(delay_s)  # the inputs arrive late: generate_until waits at least this long per batch
        return prepared(self, chunk, ahead)

    monkeypatch.setattr(Prefetcher, "inputs", slow)
    result = care("eval", "--model", "tiny-llava", "--method", "care", "--keep", "16", "--tasks", POPE, "--limit",
                  "6", "--device", "cpu", "--batch-size", "4", "--json")  # fmt: skip
    assert result.code == 0, result.err
    for setting in result.json()["settings"]:  # 6 documents in batches of 4: two waits each
        assert 2 * delay_s <= setting["input_wait_seconds"] <= setting["wall_seconds"]


def test_care_eval_releases_the_decoding_cache_before_each_setting(care, monkeypatch: Any) -> None:
    from care_core.backbones.chat_adapter import ChatAdapter

    released: list[bool] = []
    release = ChatAdapter.release_decoding_cache

    def spy(self: Any) -> None:
        self._greedy_graphs = object()  # as if the previous setting had left a static cache
        release(self)
        released.append(self._greedy_graphs is None)

    monkeypatch.setattr(ChatAdapter, "release_decoding_cache", spy)
    result = care("eval", "--model", "tiny-llava", "--method", "care", "--keep", "16", "--tasks", POPE, "--limit", "2",
                  "--device", "cpu", "--json")  # fmt: skip
    assert result.code == 0, result.err
    assert released == [True, True]  # all tokens, then care K=16: each starts without the other's cache


@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_care_eval_refuses_a_bad_batch_size(care, value: str) -> None:
    result = care("eval", "--tasks", POPE, "--device", "cpu", "--batch-size", value)
    assert result.code == 2 and result.out == ""
    assert result.err == f"error: --batch-size must be a whole number >= 1, 'auto' or 'auto:N', got '{value}'\n"


def test_the_plugin_takes_the_parsed_batch_size_and_reads_no_text(llava: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from care_core import batch_sizes
    from care_core.integrations import settings

    def parsed_again(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("batch_size parsed again")

    monkeypatch.setattr(batch_sizes, "parse_batch_size", parsed_again)
    monkeypatch.setattr(settings, "parse_batch_size", parsed_again)
    lm = plugin.CareLMM.from_spec(EvalSpec(pretrained="tiny-llava", method=None), llava, batch_size=BatchSize(3))
    assert lm.batch_choice == BatchChoice(3, BatchSize(3), CPU_BATCH_SIZE) and lm.batches.size == 3


def test_care_eval_parses_batch_size_once_and_reports_the_size_each_setting_used(
    care, monkeypatch: pytest.MonkeyPatch, batch_size_parses: list[object]
) -> None:
    from care_core.pipeline import ReductionPipeline

    run_batch = ReductionPipeline.run_batch

    def out_of_memory_above_two(self: Any, images: list[Any], *args: Any, **kwargs: Any) -> Any:
        if len(images) > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return run_batch(self, images, *args, **kwargs)

    monkeypatch.setattr(ReductionPipeline, "run_batch", out_of_memory_above_two)
    result = care("eval", "--model", "tiny-llava", "--method", "care", "--keep", "16", "--tasks", POPE, "--limit", "4",
                  "--device", "cpu", "--batch-size", "4", "--json")  # fmt: skip
    assert result.code == 0, result.err
    assert batch_size_parses == ["4"]  # where the run is set up, once
    report = result.json()
    assert report["batch_size"] == {"batch_size": 4, "requested": 4, "default": CPU_BATCH_SIZE}
    # all tokens starts at 4, is split down to 2 for memory and hands 2 on to care K=16
    assert [(s["batch_size_start"], s["batch_size"]) for s in report["settings"]] == [(4, 2), (2, 2)]
