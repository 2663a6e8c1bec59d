"""Kept indices (care_core/backbones/base.py): host tensors checked whole; device tensors left on the device, their
range read after the prompt is queued (no wait for the reduction that made them), in one copy for a batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from care_core.backbones import load_backbone
from care_core.backbones.base import KeptBounds, check_kept, queue_kept_bounds

from ._helpers import noise_image

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
QUESTION = "What is in the image?"


@pytest.mark.parametrize("bad", [[0, 5], [-2, 1]])
def test_host_indices_outside_the_tokens_are_refused_at_once(bad: list[int]) -> None:
    with pytest.raises(ValueError, match=r"^kept holds indices outside -1\.\.4$"):
        check_kept(torch.tensor(bad), 2, 5)
    assert check_kept(torch.tensor([4, -1]), 2, 5).tolist() == [4, -1]  # type: ignore[union-attr]


def test_generate_refuses_indices_outside_the_tokens(demo: Any) -> None:
    tokens = demo.encode_image(noise_image(64, 64))
    rows = demo.projector(tokens.features[:3])
    n = tokens.num_tokens
    with pytest.raises(ValueError, match=f"outside -1..{n - 1}"):
        demo.generate(QUESTION, tokens, rows, max_new_tokens=2, kept=torch.tensor([0, 1, n]))


def _range_problem(kept: list[torch.Tensor | None], num_tokens: list[int]) -> str | None:
    """The queued range read at once: the first sample's problem, or None."""
    bounds = queue_kept_bounds(kept, num_tokens)
    assert bounds is not None  # every call here passes a device kept
    return bounds.problem()


@cuda_only
def test_device_ranges_are_read_in_one_copy_and_name_the_first_bad_sample() -> None:
    good, high, low = (torch.tensor(v, device="cuda") for v in ([4, -1, 0], [0, 5], [-2]))
    assert _range_problem([good, None, torch.tensor([9])], [5, 3, 2]) is None  # a host tensor: checked already
    assert _range_problem([good, high, low], [5, 5, 5]) == "kept holds indices outside -1..4"
    assert _range_problem([low], [3]) == "kept holds indices outside -1..2"
    assert check_kept(high, 2, 5) is not None  # a device tensor's range is left to its caller: no wait here


def test_copied_bounds_name_the_first_sample_out_of_range() -> None:
    assert KeptBounds(torch.tensor([[-1, 3], [0, 5]]), (4, 6)).problem() is None  # -1..N-1 is the whole range
    bounds = KeptBounds(torch.tensor([[-1, 3], [2, 6], [-2, 0]]), (4, 6, 3))
    assert bounds.problem() == "kept holds indices outside -1..5"


def test_host_kept_are_never_queued_for_a_second_read() -> None:
    assert queue_kept_bounds([torch.tensor([0, 7]), None, torch.tensor([], dtype=torch.long)], [2, 3, 4]) is None


@cuda_only
def test_device_ranges_are_queued_without_waiting_and_read_after_later_work() -> None:
    good, high = torch.tensor([3, -1, 0], device="cuda"), torch.tensor([2, 6], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any wait for the device raises from here on
    try:
        bounds = queue_kept_bounds([good, None, high], [4, 9, 6])
        later = torch.ones(4096, 4096, device="cuda") @ torch.ones(4096, 4096, device="cuda")  # queued after the copy
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert bounds is not None and float(later[0, 0]) == 4096.0
    assert bounds.host.tolist() == [[-1, 3], [2, 6]]  # (lowest, highest) per device kept, in order
    assert bounds.problem() == "kept holds indices outside -1..5"


@cuda_only
@pytest.mark.parametrize("cuda_graph", [None, False])
def test_generate_names_a_device_kept_out_of_range_after_answering(demo_home: Path, cuda_graph: bool | None) -> None:
    adapter: Any = load_backbone("tiny-llava", home=demo_home, device="cuda", dtype="float32")
    tokens = adapter.encode_image(noise_image(64, 64))
    n = tokens.num_tokens
    rows = adapter.projector(tokens.features[:3])
    with pytest.raises(ValueError, match=f"^kept holds indices outside -1..{n - 1}$"):
        adapter.generate(QUESTION, tokens, rows, max_new_tokens=2, kept=torch.tensor([0, 1, n], device="cuda"),
                         cuda_graph=cuda_graph)  # fmt: skip


def _reduced(adapter: Any, k: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
    tokens = adapter.encode_image(noise_image(96, 128, seed=3))
    kept = torch.randperm(tokens.num_tokens, generator=torch.Generator().manual_seed(1))[:k].sort().values
    return tokens, adapter.projector(tokens.features[kept.to(tokens.features.device)]), kept


@cuda_only
@pytest.mark.parametrize("name", ["tiny-llava", "tiny-llava-next", "tiny-qwen3-vl", "tiny-internvl3"])
def test_a_reduced_prompt_is_queued_without_waiting_for_the_device(demo_home: Path, name: str) -> None:
    adapter: Any = load_backbone(name, home=demo_home, device="cuda", dtype="float32")
    tokens, rows, kept = _reduced(adapter, 9)
    want = adapter.generate(QUESTION, tokens, rows, max_new_tokens=4, kept=kept)  # host kept: checked whole
    on_device = kept.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any wait for the device raises from here on
    try:
        adapter._lm_inputs(QUESTION, tokens, rows, on_device)  # the model's own inputs, for its generate
    finally:
        torch.cuda.set_sync_debug_mode(0)
    got = adapter.generate(QUESTION, tokens, rows, max_new_tokens=4, kept=on_device)
    assert got.token_ids == want.token_ids


@cuda_only
@pytest.mark.parametrize("name", ["tiny-llava", "tiny-llava-next", "tiny-qwen2.5-vl", "tiny-qwen3-vl",
                                  "tiny-internvl3"])  # fmt: skip
def test_the_static_loops_prompt_is_made_from_its_parts_without_waiting_for_the_device(
    demo_home: Path, name: str
) -> None:
    adapter: Any = load_backbone(name, home=demo_home, device="cuda", dtype="float32")
    tokens, rows, kept = _reduced(adapter, 9)
    want = adapter.generate(QUESTION, tokens, rows, max_new_tokens=4, kept=kept)  # the question's prompt ids, kept
    on_device = kept.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any wait for the device raises from here on
    try:
        with torch.no_grad():
            adapter._loop_prompt(adapter._prompt_parts(QUESTION, tokens, rows, on_device))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert adapter.generate(QUESTION, tokens, rows, max_new_tokens=4, kept=on_device).token_ids == want.token_ids


@cuda_only
@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen3-vl"])
def test_device_indices_out_of_range_fail_in_one_line_and_leave_the_device_usable(demo_home: Path, name: str) -> None:
    adapter: Any = load_backbone(name, home=demo_home, device="cuda", dtype="float32")
    tokens, rows, kept = _reduced(adapter, 5)
    want = adapter.generate(QUESTION, tokens, rows, max_new_tokens=3, kept=kept)
    for bad in (tokens.num_tokens, -2):
        wrong = kept.clone()
        wrong[2] = bad
        with pytest.raises(ValueError, match=f"^kept holds indices outside -1..{tokens.num_tokens - 1}$"):
            adapter.generate(QUESTION, tokens, rows, max_new_tokens=3, kept=wrong.cuda())
        with pytest.raises(ValueError, match="outside"):
            adapter.language_model_logits(QUESTION, tokens, rows, kept=wrong.cuda())
    again = adapter.generate(QUESTION, tokens, rows, max_new_tokens=3, kept=kept.cuda())  # no device-side error left
    assert again.token_ids == want.token_ids


def test_a_kept_check_is_queued_once_and_read_after(monkeypatch: pytest.MonkeyPatch) -> None:
    from care_core.backbones import base

    assert base.KeptRangeCheck([torch.tensor([0, 9]), None], [5, 5]).problem() is None  # host kept: checked whole
    queued: list[int] = []
    bounds = KeptBounds(torch.tensor([[0, 7]]), (5,))
    monkeypatch.setattr(base, "queue_kept_bounds", lambda kept, counts: queued.append(len(kept)) or bounds)
    check = base.KeptRangeCheck([torch.tensor([0, 7])], [5])
    check.queue()
    check.queue()
    assert check.problem() == "kept holds indices outside -1..4"
    assert queued == [1]  # queued once: later calls and the read find it queued
