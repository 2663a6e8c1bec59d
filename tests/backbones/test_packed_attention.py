"""Packed vision attention (care_core/backbones/packed_attention.py): the function against attention computed by hand
segment by segment (values and gradients, mixed lengths, grouped heads, causal, query/key lengths that differ), one
sdpa call per segment length, the tiny Qwen2.5-VL and Qwen3-VL towers equal to transformers' per-segment sdpa loop on
a batch of differently sized images, per-image features equal to batch 1, the model's settings restored, the CUDA
default of the adapters (chosen without a GPU: the decision reads only the device and the setting)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from care_core.backbones import packed_attention
from care_core.backbones.packed_attention import (
    PACKED_ATTENTION,
    packed_sdpa_attention,
    packed_vision_attention,
    tower_attention,
    use_packed_vision_attention,
)
from care_core.backbones.probes import attention_settings
from care_core.backbones.qwen2_5_vl.demo import build_tiny_qwen2_5_vl
from care_core.backbones.qwen3_vl.demo import build_tiny_qwen3_vl

from ._helpers import noise_image


class CountSdpa(TorchFunctionMode):
    """Counts ``scaled_dot_product_attention`` calls made while active."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.nn.functional.scaled_dot_product_attention:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def by_hand(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: list[int], cu_k: list[int], *,
            scale: float, causal: bool = False) -> torch.Tensor:  # fmt: skip
    """softmax(q k^T * scale) v within each segment, one segment at a time: (1, H, T, d) -> (1, T, H, d)."""
    heads = q.shape[1]
    k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    out = []
    for i in range(len(cu_q) - 1):
        qs, ks, vs = q[0, :, cu_q[i] : cu_q[i + 1]], k[0, :, cu_k[i] : cu_k[i + 1]], v[0, :, cu_k[i] : cu_k[i + 1]]
        scores = qs @ ks.transpose(-1, -2) * scale
        if causal:
            scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
        out.append((scores.softmax(-1) @ vs).transpose(0, 1))  # (len, H, d)
    return torch.cat(out)[None]


def qkv(total_q: int, total_k: int, heads: int = 2, kv_heads: int = 2, dim: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(1, heads, total_q, dim), (1, kv_heads, total_k, dim), (1, kv_heads, total_k, dim)]
    return [torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True) for s in shapes]


# Lengths 5, 3, 5, 1, 7, 3, 5: four distinct lengths, the 5s and 3s not adjacent (gathered, then put back).
MIXED = [0, 5, 8, 13, 14, 21, 24, 29]


@pytest.mark.parametrize(
    ("cu_k", "kv_heads", "causal"),
    [(MIXED, 2, False), (MIXED, 1, False), (MIXED, 2, True), ([0, 2, 4, 6, 8, 13, 15, 18], 2, False)],
    ids=["mixed", "grouped-heads", "causal", "other-key-lengths"],
)
def test_equals_attention_by_hand_segment_by_segment(cu_k: list[int], kv_heads: int, causal: bool) -> None:
    q, k, v = qkv(MIXED[-1], cu_k[-1], kv_heads=kv_heads)
    module = torch.nn.Module()
    out, weights = packed_sdpa_attention(module, q, k, v, None, scaling=0.3, is_causal=causal,
                                         cu_seq_lens_q=torch.tensor(MIXED, dtype=torch.int32),
                                         cu_seq_lens_k=torch.tensor(cu_k, dtype=torch.int32))  # fmt: skip
    expected = by_hand(q, k, v, MIXED, cu_k, scale=0.3, causal=causal)
    assert weights is None and out.shape == (1, MIXED[-1], 2, 4)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    grads = torch.autograd.grad(out.pow(2).sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.pow(2).sum(), (q, k, v))
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_one_sdpa_call_per_segment_length_and_more_only_past_the_score_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = qkv(MIXED[-1], MIXED[-1])
    cu = torch.tensor(MIXED)
    with torch.no_grad(), CountSdpa() as count:
        out, _ = packed_sdpa_attention(torch.nn.Module(), q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    assert count.calls == 4  # lengths 5, 3, 1, 7
    # a cap of 2 heads x 5 x 5 x 2 scores: the three 5s take two calls, the others one each
    monkeypatch.setattr(packed_attention, "MAX_SCORES_PER_CALL", 2 * 5 * 5 * 2)
    with torch.no_grad(), CountSdpa() as capped:
        split, _ = packed_sdpa_attention(torch.nn.Module(), q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    assert capped.calls == 5
    torch.testing.assert_close(split, out, atol=1e-12, rtol=0)


def test_refuses_calls_it_cannot_serve() -> None:
    q, k, v = qkv(6, 6)
    cu = torch.tensor([0, 3, 6])
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="packed calls only"):
        packed_sdpa_attention(module, q, k, v, None)
    with pytest.raises(ValueError, match="no attention_mask"):
        packed_sdpa_attention(module, q, k, v, torch.ones(1, 1, 6, 6), cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    with pytest.raises(ValueError, match="from 0 to the packed lengths"):
        packed_sdpa_attention(module, q, k, v, None, cu_seq_lens_q=torch.tensor([0, 3, 5]), cu_seq_lens_k=cu)
    with pytest.raises(ValueError, match="equal query and key lengths"):
        packed_sdpa_attention(module, q, k, v, None, is_causal=True, cu_seq_lens_q=cu,
                              cu_seq_lens_k=torch.tensor([0, 2, 6]))  # fmt: skip
    with pytest.raises(ValueError, match=r"Qwen2\.5-VL and Qwen3-VL towers only"):
        use_packed_vision_attention(torch.nn.Linear(2, 2))


# ------------------------------------------------------------------------------------- the tiny Qwen towers
# Processor grids (patches) of the four images: 224x336 -> 16x24, 336x336 -> 24x24 (twice), 150x420 -> 10x30.
SIZES = [(224, 336), (336, 336), (150, 420), (336, 336)]
QWEN25_GRIDS = [[1, 16, 24], [1, 24, 24], [1, 10, 30], [1, 24, 24]]
# Qwen2.5-VL windows are 4x4 merged tokens (64 patches): 2x3 full windows, 3x3 (twice), and on the 5x15 merged grid
# 3 full windows, one 4x3 (48), three 1x4 (16) and one 1x3 (12): 4 lengths in each of the 2 windowed blocks; the 2
# full-attention blocks see 384, 576, 300 and 576 patches: 3 lengths. The loop makes 6 + 9 + 8 + 9 calls per
# windowed block and 4 per full block.
QWEN25_CALLS = {"loop": 2 * 32 + 2 * 4, "packed": 2 * 4 + 2 * 3}
# Qwen3-VL (patch 16): 14x20, 20x20, 10x26 and 20x20 patches, full attention per image in all 4 blocks.
QWEN3_GRIDS = [[1, 14, 20], [1, 20, 20], [1, 10, 26], [1, 20, 20]]
QWEN3_CALLS = {"loop": 4 * 4, "packed": 4 * 3}


@pytest.fixture(scope="module", params=["tiny-qwen2.5-vl", "tiny-qwen3-vl"])
def tower_case(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    build, grids, calls = {"tiny-qwen2.5-vl": (build_tiny_qwen2_5_vl, QWEN25_GRIDS, QWEN25_CALLS),
                           "tiny-qwen3-vl": (build_tiny_qwen3_vl, QWEN3_GRIDS, QWEN3_CALLS)}[request.param]  # fmt: skip
    model, processor = build(0)
    inputs = processor.image_processor(images=[noise_image(h, w, seed=i) for i, (h, w) in enumerate(SIZES)],
                                       return_tensors="pt")  # fmt: skip
    assert inputs["image_grid_thw"].tolist() == grids
    yield {"model": model.eval(), "processor": processor, "inputs": inputs, "calls": calls}


def tower(model: Any, inputs: Any, dtype: torch.dtype) -> tuple[list[torch.Tensor], int]:
    """The tower's hidden states, merged output (and deepstack rows) for the packed images; sdpa calls made."""
    with torch.no_grad(), CountSdpa() as count:
        out = model.model.visual(inputs["pixel_values"].to(dtype), grid_thw=inputs["image_grid_thw"])
    deepstack = list(getattr(out, "deepstack_features", None) or [])
    return [out.last_hidden_state, out.pooler_output, *deepstack], count.calls


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-10), (torch.float32, 1e-6)], ids=["float64", "float32"])
def test_tower_equals_the_per_segment_sdpa_loop(tower_case: dict[str, Any], dtype: torch.dtype, tol: float) -> None:
    model = tower_case["model"].to(dtype)
    try:
        loop, loop_calls = tower(model, tower_case["inputs"], dtype)
        with packed_vision_attention(model):
            packed, packed_calls = tower(model, tower_case["inputs"], dtype)
    finally:
        model.float()
    assert {"loop": loop_calls, "packed": packed_calls} == tower_case["calls"]
    assert len(packed) == len(loop) >= 2
    for got, want in zip(packed, loop, strict=True):
        torch.testing.assert_close(got, want, atol=tol, rtol=0)


def test_tower_gradients_equal_the_loops(tower_case: dict[str, Any]) -> None:
    """Training runs the tower with gradients: every parameter's gradient is the loop's (float64)."""
    model = tower_case["model"].double()
    visual, inputs = model.model.visual, tower_case["inputs"]
    try:
        grads = []
        for packed in (False, True):
            visual.zero_grad()
            with packed_vision_attention(model) if packed else contextlib.nullcontext():
                out = visual(inputs["pixel_values"].double(), grid_thw=inputs["image_grid_thw"])
            out.pooler_output.pow(2).sum().backward()
            grads.append({name: p.grad.clone() for name, p in visual.named_parameters() if p.grad is not None})
    finally:
        visual.zero_grad(set_to_none=True)
        model.float()
    assert grads[0].keys() == grads[1].keys() and any("attn.qkv" in name for name in grads[0])
    for name, want in grads[0].items():
        torch.testing.assert_close(grads[1][name], want, atol=1e-10, rtol=1e-10, msg=name)


def test_settings_restored_after_the_block_also_on_error(tower_case: dict[str, Any]) -> None:
    model = tower_case["model"]
    before = attention_settings(model)
    text = model.config.text_config._attn_implementation
    with pytest.raises(KeyError), packed_vision_attention(model):
        assert model.config.vision_config._attn_implementation == PACKED_ATTENTION
        assert model.model.visual.config._attn_implementation == PACKED_ATTENTION
        assert model.config.text_config._attn_implementation == text  # the language model keeps its own
        raise KeyError("inside")
    assert attention_settings(model) == before
    assert model.config.vision_config._attn_implementation == "sdpa"


def test_use_returns_the_previous_setting_that_restores_it(tower_case: dict[str, Any]) -> None:
    model = tower_case["model"]
    previous = use_packed_vision_attention(model)
    try:
        assert previous == "sdpa"
        assert model.config.vision_config._attn_implementation == PACKED_ATTENTION
    finally:
        model.set_attn_implementation({"vision_config": previous})
    assert model.config.vision_config._attn_implementation == "sdpa"


# --------------------------------------------------------------------------------------- adapter default (CUDA)
def test_adapters_pack_only_on_cuda_with_sdpa(tower_case: dict[str, Any]) -> None:
    """The decision reads the device and the setting only (no tensor is moved), so it is checked without a GPU."""
    model = tower_case["model"]
    vision = model.config.vision_config
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    with tower_attention(model, cpu):
        assert vision._attn_implementation == "sdpa"
    with tower_attention(model, cuda, pack=False):
        assert vision._attn_implementation == "sdpa"
    with tower_attention(model, cuda):
        assert vision._attn_implementation == PACKED_ATTENTION
    assert vision._attn_implementation == "sdpa"
    model.set_attn_implementation({"vision_config": "eager"})
    try:
        with tower_attention(model, cuda):
            assert vision._attn_implementation == "eager"  # a setting the user chose stays
    finally:
        model.set_attn_implementation({"vision_config": "sdpa"})


@pytest.mark.parametrize("name", ["qwen_demo", "qwen3_demo"])
def test_packed_batch_gives_each_image_its_batch_one_features(name: str, request: pytest.FixtureRequest) -> None:
    adapter = request.getfixturevalue(name)
    images = [noise_image(h, w, seed=i) for i, (h, w) in enumerate(SIZES)]
    alone = [adapter.encode_images([image])[0] for image in images]  # the CPU path: transformers' loop
    with packed_vision_attention(adapter.model):
        batch = adapter.encode_images(images)
    for one, many in zip(alone, batch, strict=True):
        torch.testing.assert_close(many.features, one.features, atol=1e-5, rtol=1e-5)
        if "deepstack" in one.model_inputs:
            torch.testing.assert_close(many.model_inputs["deepstack"], one.model_inputs["deepstack"], atol=1e-5,
                                       rtol=1e-5)  # fmt: skip
