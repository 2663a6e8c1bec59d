"""Batch sizes: parsing, the device's default (the memory formula by hand), out-of-memory splitting."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from care_core.batch_sizes import (
    CPU_BATCH_SIZE,
    MAX_BATCH_SIZE,
    Batches,
    BatchSize,
    batch_size_for,
    choose_batch_size,
    default_batch_size,
    is_out_of_memory,
    parse_batch_size,
    sample_bytes,
)
from care_core.errors import CareError


@pytest.mark.parametrize(
    ("given", "expected"),
    [(1, BatchSize(1)), ("4", BatchSize(4)), (" 8 ", BatchSize(8)), ("auto", BatchSize()), ("AUTO:4", BatchSize())],
)
def test_batch_size_values_lmms_eval_and_the_cli_pass_are_read(given: object, expected: BatchSize) -> None:
    assert parse_batch_size(given) == expected


def test_auto_reads_its_cap_and_a_bad_cap_is_a_one_line_error_naming_max_batch_size() -> None:
    assert parse_batch_size("auto", cap="3") == BatchSize(None, 3)
    for bad in (0, "auto", "x", True):
        with pytest.raises(CareError) as caught:
            parse_batch_size("auto", cap=bad)
        assert caught.value.parameter == "max_batch_size" and "\n" not in str(caught.value)


def test_a_batch_size_resolves_to_its_number_or_the_device_rule_up_to_the_cap() -> None:
    assert BatchSize(6).resolve(default=32) == 6  # a number is used as it is, whatever the device picks
    assert BatchSize().resolve(default=32) == 32
    assert BatchSize(None, 8).resolve(default=32) == 8 and BatchSize(None, 8).resolve(default=2) == 2
    assert BatchSize(6).to_json() == 6 and BatchSize().to_json() == "auto"


def test_a_split_number_is_handed_on_and_auto_is_picked_again() -> None:
    assert BatchSize(8).at_most(3) == BatchSize(3) and BatchSize(2).at_most(3) == BatchSize(2)
    assert BatchSize(None, 5).at_most(1) == BatchSize(None, 5)


def test_choose_batch_size_reports_the_size_used_what_was_asked_and_the_device_rule() -> None:
    adapter = SimpleNamespace(device=torch.device("cpu"))
    fixed = choose_batch_size(BatchSize(3), adapter, max_new_tokens=8)  # type: ignore[arg-type]
    assert fixed.to_dict() == {"batch_size": 3, "requested": 3, "default": CPU_BATCH_SIZE}
    capped = choose_batch_size(BatchSize(None, 2), adapter, max_new_tokens=8)  # type: ignore[arg-type]
    assert capped.to_dict() == {"batch_size": 2, "requested": "auto", "default": CPU_BATCH_SIZE}


@pytest.mark.parametrize("given", [0, -1, "0", "x", "auto:0", "auto:x", "1.5", True, None, 2.0])
def test_bad_batch_sizes_are_one_line_errors_naming_the_parameter(given: object) -> None:
    with pytest.raises(CareError) as caught:
        parse_batch_size(given)
    assert caught.value.parameter == "batch_size" and "\n" not in str(caught.value)
    assert str(caught.value).startswith("batch_size must be a whole number >= 1, 'auto' or 'auto:N'")


def test_the_memory_estimate_per_sample_is_the_documented_formula() -> None:
    text = SimpleNamespace(num_attention_heads=8, num_key_value_heads=2, hidden_size=64, intermediate_size=96,
                           num_hidden_layers=3)  # fmt: skip
    vision = SimpleNamespace(hidden_size=32, intermediate_size=48, num_hidden_layers=5, spatial_merge_size=2)
    config = SimpleNamespace(text_config=text, vision_config=vision)
    # KV: 2 * 3 layers * 2 heads * 8 (head dim 64/8) * (10 + 20 + 5) = 3360; prefill: 30 * (4*64 + 2*96) = 13440;
    # tower: 20 * 2^2 * (6 * 32 + 2 * 48) = 23040; in bfloat16 (2 bytes)
    assert sample_bytes(config, visual_tokens=20, prompt_tokens=10, max_new_tokens=5, dtype_bytes=2) == 2 * (
        3360 + 13440 + 23040
    )
    # no answers (CSR): the tower only
    assert sample_bytes(config, visual_tokens=20, prompt_tokens=10, max_new_tokens=None, dtype_bytes=2) == 2 * 23040
    # CSR with FastV at K = 2 (layers 0 and 1): also the probe's prefill and float32 attention maps, the two kept
    # and the one being computed: 3 layers * 8 heads * 30^2 * 4 = 86400
    assert sample_bytes(config, visual_tokens=20, prompt_tokens=10, max_new_tokens=None, dtype_bytes=2,
                        attention_layers=2) == 2 * (13440 + 23040) + 86400  # fmt: skip
    # a method asking for more layers than the model has holds all 3 of them: 4 * 8 * 900 * 4
    assert sample_bytes(config, visual_tokens=20, prompt_tokens=10, max_new_tokens=None, dtype_bytes=2,
                        attention_layers=9) == 2 * (13440 + 23040) + 115200  # fmt: skip
    flat = SimpleNamespace(**vars(text), head_dim=4)  # no vision config, an explicit head dim
    assert sample_bytes(flat, visual_tokens=20, prompt_tokens=10, max_new_tokens=5, dtype_bytes=4) == 4 * (
        2 * 3 * 2 * 4 * 35 + 13440
    )


def test_answers_from_kept_tokens_count_their_rows_and_the_reduction_working_set() -> None:
    text = SimpleNamespace(num_attention_heads=8, num_key_value_heads=2, hidden_size=64, intermediate_size=96,
                           num_hidden_layers=3)  # fmt: skip
    vision = SimpleNamespace(hidden_size=32, intermediate_size=48, num_hidden_layers=5, spatial_merge_size=2)
    config = SimpleNamespace(text_config=text, vision_config=vision)
    # K = 4 of N = 20: KV 2 * 3 * 2 * 8 * (10 + 4 + 5) = 1824; prefill 14 * (4*64 + 2*96) = 6272; tower (all N
    # tokens) 23040; in bfloat16; plus the float32 working set 20 * (20 + 4 * 64) * 4 = 22080 bytes
    assert sample_bytes(config, visual_tokens=20, prompt_tokens=10, max_new_tokens=5, dtype_bytes=2,
                        fed_tokens=4) == 2 * (1824 + 6272 + 23040) + 22080  # fmt: skip
    # K >= N: nothing is reduced, the all-tokens estimate (3360 + 13440 + 23040, as above)
    assert sample_bytes(config, visual_tokens=20, prompt_tokens=10, max_new_tokens=5, dtype_bytes=2,
                        fed_tokens=20) == 2 * (3360 + 13440 + 23040)  # fmt: skip
    # a method reading attention maps (a = 2) probes all N tokens: the probe's prefill over 30 rows (13440) and
    # maps 3 * 8 * 30^2 * 4 = 86400, beside the answer's KV over the kept rows (1824)
    assert sample_bytes(config, visual_tokens=20, prompt_tokens=10, max_new_tokens=5, dtype_bytes=2,
                        fed_tokens=4, attention_layers=2) == 2 * (1824 + 13440 + 23040) + 86400 + 22080  # fmt: skip


def test_the_cuda_rule_fills_the_free_memory_between_1_and_64_in_decoder_buckets() -> None:
    gib = 1 << 30
    assert batch_size_for(10 * gib, gib // 2) == 8  # floor((0.8 * 10 GiB - 0.5 GiB) / 0.5 GiB) = 15 -> bucket 8
    assert batch_size_for(20 * gib, gib // 2) == 16  # floor(15.5 / 0.5) = 31 -> bucket 16
    assert batch_size_for(gib // 2, gib) == 1
    assert batch_size_for(80 * gib, 1 << 20) == MAX_BATCH_SIZE


def test_on_a_cpu_the_default_is_the_fixed_small_size() -> None:
    adapter = SimpleNamespace(device=torch.device("cpu"))
    assert default_batch_size(adapter, max_new_tokens=8) == CPU_BATCH_SIZE  # type: ignore[arg-type]


def test_out_of_memory_errors_are_recognised() -> None:
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("out of range"))


class OutOfMemoryAbove:
    """``work`` that runs out of memory for more than ``limit`` items, else squares them; logs every call."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.calls: list[list[int]] = []

    def __call__(self, chunk: list[int]) -> list[int]:
        self.calls.append(list(chunk))
        if len(chunk) > self.limit:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return [x * x for x in chunk]


def test_a_batch_out_of_memory_is_split_in_halves_and_every_item_answered_once_in_order() -> None:
    notices: list[str] = []
    saved: list[tuple[list[int], list[int]]] = []
    work = OutOfMemoryAbove(2)
    batches = Batches(8, device="cuda:0", on_notice=notices.append)
    items = list(range(11))
    out = batches.run(items, work, lambda chunk, results: saved.append((chunk, results)))
    assert out == [x * x for x in items]
    finished = [x for chunk, _ in saved for x in chunk]
    assert finished == items  # each item handed back exactly once, in order
    assert all(len(chunk) <= 2 for chunk, _ in saved)
    assert len(notices) == 1 and "out of memory on cuda:0 with a batch of 8" in notices[0]
    # 8 failed -> 4 failed -> 2, 2; then 4 failed -> 2, 2; size kept at 2 for the rest: 2, 1
    assert [len(c) for c in work.calls] == [8, 4, 2, 2, 4, 2, 2, 2, 1]
    assert batches.size == 2 and batches.requested == 8


def test_one_sample_out_of_memory_is_a_one_line_error_naming_batch_size_and_device() -> None:
    batches = Batches(4, device="cuda:1")
    with pytest.raises(CareError) as caught:
        batches.run([1, 2, 3], OutOfMemoryAbove(0))
    text = str(caught.value)
    assert "\n" not in text and "cuda:1" in text and "batch_size 4 split down to 1" in text


def test_other_errors_are_not_retried() -> None:
    calls: list[int] = []

    def work(chunk: list[int]) -> list[int]:
        calls.append(len(chunk))
        raise ValueError("a bad sample")

    with pytest.raises(ValueError, match="a bad sample"):
        Batches(4, device="cpu").run([1, 2, 3], work)
    assert calls == [3]


class FailsOn:
    """``work`` that raises ValueError for any chunk holding ``bad``, else squares the items; logs every call."""

    def __init__(self, bad: int, error: BaseException | None = None) -> None:
        self.bad = bad
        self.error = error or ValueError(f"item {bad} is bad")
        self.calls: list[list[int]] = []

    def __call__(self, chunk: list[int]) -> list[int]:
        self.calls.append(list(chunk))
        if self.bad in chunk:
            raise self.error
        return [x * x for x in chunk]


def test_an_item_failing_inside_a_batch_is_retried_alone_and_every_other_item_keeps_its_result() -> None:
    saved: list[tuple[list[int], list[object]]] = []
    failed: list[tuple[int, str]] = []
    work = FailsOn(5)
    batches = Batches(4, device="cpu")

    def stand_in(item: int, exc: Exception) -> object:
        failed.append((item, str(exc)))
        return "failed"

    out = batches.run(list(range(11)), work, lambda chunk, results: saved.append((chunk, results)), stand_in)
    assert out == [0, 1, 4, 9, 16, "failed", 36, 49, 64, 81, 100]
    assert failed == [(5, "item 5 is bad")]
    assert [x for chunk, _ in saved for x in chunk] == list(range(11))  # each item handed back once, in order
    assert ([5], ["failed"]) in saved  # the failed item comes back alone
    # [0..3]; [4..7] fails -> [4, 5] fails -> [4], [5] (fails alone) -> [6, 7]; then [8..10]
    assert [len(c) for c in work.calls] == [4, 4, 2, 1, 1, 2, 3]
    assert batches.size == 4 and batches.splits == 0  # a bad item says nothing about memory: the size stays


def test_a_failure_handler_that_raises_stops_the_run_after_saving_what_finished() -> None:
    saved: list[int] = []

    def stop(item: int, exc: Exception) -> int:
        raise RuntimeError(f"stop at {item}") from exc

    with pytest.raises(RuntimeError, match="stop at 2"):
        Batches(4, device="cpu").run([0, 1, 2, 3, 4], FailsOn(2), lambda chunk, _: saved.extend(chunk), stop)
    assert saved == [0, 1]  # the half before the bad item was saved; nothing after it ran


def test_an_interrupt_inside_a_batch_is_never_retried() -> None:
    work = FailsOn(1, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        Batches(4, device="cpu").run([0, 1, 2], work, on_failure=lambda item, exc: -1)
    assert work.calls == [[0, 1, 2]]


def test_one_sample_out_of_memory_stays_an_error_with_a_failure_handler() -> None:
    with pytest.raises(CareError, match="even for one sample at a time"):
        Batches(2, device="cuda:0").run([1, 2], OutOfMemoryAbove(0), on_failure=lambda item, exc: -1)
