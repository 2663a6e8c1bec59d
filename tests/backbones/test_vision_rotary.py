"""Vision rotary (care_core/kernels/vision_rotary.py, care_core/backbones/vision_rotary.py): the one-pass kernel
against transformers' ``apply_rotary_pos_emb_vision`` (Triton's interpreter on the CPU; bit for bit on CUDA), which
inputs it takes, the block that sets the stand-in (nothing off CUDA; nested blocks; restored on exit and on error;
transformers' function where the kernel cannot be built), and that each Qwen tower's attention calls the function the
block sets (the decision to set it reads only the device, so these run without a GPU)."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl
from transformers.models.qwen3_vl import modeling_qwen3_vl

from care_core.backbones import vision_rotary
from care_core.backbones.qwen2_5_vl.demo import build_tiny_qwen2_5_vl
from care_core.backbones.qwen3_5.demo import build_tiny_qwen3_5
from care_core.backbones.qwen3_vl.demo import build_tiny_qwen3_vl
from care_core.backbones.vision_rotary import ROTARY_FUNCTION, FastRotary, fast_vision_rotary, modeling_module
from care_core.kernels import dispatch
from tests._triton_interpreter import run_interpreted

from ._helpers import noise_image

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CPU = torch.device("cpu")
transformers_rotary = modeling_qwen2_5_vl.apply_rotary_pos_emb_vision


def rotary_inputs(rows: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> tuple[Any, ...]:
    """q and k as the towers make them (strided views of one qkv product) and their (rows, head_dim) cos and sin
    (float32, the two halves' angles equal, as the towers' tables are)."""
    generator = torch.Generator().manual_seed(rows + heads + head_dim)
    qkv = (4 * torch.randn(rows, 3, heads, head_dim, generator=generator)).to(dtype).to(device)
    q, k, _ = qkv.permute(1, 0, 2, 3).unbind(0)
    angles = 50 * torch.rand(rows, head_dim // 2, generator=generator)
    table = torch.cat([angles, angles], dim=-1).to(device)
    return q, k, table.cos(), table.sin()


# ------------------------------------------------------------------------------------------------ the kernel
_INTERPRETED = """
import torch
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb_vision
from care_core.kernels.vision_rotary import rotate_vision
from tests.backbones.test_vision_rotary import rotary_inputs

verdicts = []
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for heads, head_dim in ((3, 10), (2, 72)):
        q, k, cos, sin = rotary_inputs(7, heads, head_dim, dtype, torch.device("cpu"))
        got, want = rotate_vision(q, k, cos, sin), apply_rotary_pos_emb_vision(q, k, cos, sin)
        for g, w in zip(got, want):
            assert g.is_contiguous() and g.dtype == dtype and g.shape == w.shape
            if dtype == torch.bfloat16:  # the interpreter's float32 -> bfloat16 cast truncates: one ulp at most
                ulp = 2.0 ** (torch.frexp(w.float())[1].float() - 8)
                verdicts.append(bool(((g.float() - w.float()).abs() <= ulp).all()))
            else:
                verdicts.append(torch.equal(g, w))
print("equal" if all(verdicts) else verdicts)
"""


def test_the_kernel_interpreted_gives_transformers_rotary() -> None:
    """float32 and float16 bit for bit (the products and the sum rounded as transformers rounds them), bfloat16 within
    the interpreter's truncating cast; head_dim 10 and 72 (halves of 5 and 36, off the power-of-two block)."""
    assert run_interpreted(_INTERPRETED) == "equal"


def test_the_kernel_refuses_what_it_cannot_take() -> None:
    q, k, cos, sin = rotary_inputs(4, 2, 8, torch.float32, CPU)
    assert not dispatch.vision_rotary_applies(q, k, cos, sin)  # CPU tensors: transformers' own function runs
    assert dispatch.rotate_vision(q, k, cos, sin) is None


@cuda_only
def test_which_cuda_inputs_the_kernel_takes() -> None:
    cuda = torch.device("cuda")
    q, k, cos, sin = rotary_inputs(6, 2, 8, torch.bfloat16, cuda)
    assert dispatch.vision_rotary_applies(q, k, cos, sin)
    assert not dispatch.vision_rotary_applies(q.double(), k.double(), cos, sin)  # a type it does not take
    assert not dispatch.vision_rotary_applies(q, k, cos[:, :6], sin[:, :6])  # tables of another width
    assert not dispatch.vision_rotary_applies(q[..., :7], k[..., :7], cos[:, :7], sin[:, :7])  # odd head_dim
    assert not dispatch.vision_rotary_applies(q.mT.contiguous().mT, k, cos, sin)  # dims not of unit stride
    assert not dispatch.vision_rotary_applies(q.float().requires_grad_(), k.float(), cos, sin)  # a gradient wanted
    with torch.no_grad():
        assert dispatch.vision_rotary_applies(q.float().requires_grad_(), k.float(), cos, sin)


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("rows", "heads", "head_dim"), [(5000, 16, 80), (3001, 16, 72), (1, 3, 10)])
def test_the_kernel_gives_transformers_rotary_bit_for_bit(
    dtype: torch.dtype, rows: int, heads: int, head_dim: int
) -> None:
    """Qwen2.5-VL's heads (16 x 80), Qwen3-VL's (16 x 72) and a small odd one, from strided q and k."""
    if not dispatch.triton_enabled(torch.device("cuda")):
        pytest.skip("Triton is not available")
    q, k, cos, sin = rotary_inputs(rows, heads, head_dim, dtype, torch.device("cuda"))
    got, want = dispatch.rotate_vision(q, k, cos, sin), transformers_rotary(q, k, cos, sin)
    assert got is not None
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape and g.is_contiguous()
        assert torch.equal(g, w), f"{int((g != w).sum())} of {g.numel()} values differ"


# ------------------------------------------------------------------------------------------------ the block
@pytest.fixture
def fused_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The block's device check passes (as on a CUDA machine with Triton); the kernel still needs CUDA tensors."""
    monkeypatch.setattr(vision_rotary, "why_not_fused", lambda device: None)


def fake_modeling() -> types.ModuleType:
    module = types.ModuleType("fake_modeling")
    setattr(module, ROTARY_FUNCTION, transformers_rotary)
    return module


def test_the_block_sets_nothing_off_cuda_or_where_the_module_has_no_rotary() -> None:
    module = fake_modeling()
    with fast_vision_rotary(module, CPU) as set_:
        assert not set_ and getattr(module, ROTARY_FUNCTION) is transformers_rotary
    with fast_vision_rotary(None, torch.device("cuda")) as set_:
        assert not set_


@pytest.mark.usefixtures("fused_allowed")
def test_nested_blocks_share_one_stand_in_and_the_last_puts_the_function_back() -> None:
    module = fake_modeling()
    q, k, cos, sin = rotary_inputs(5, 2, 8, torch.bfloat16, CPU)
    with fast_vision_rotary(module, CPU) as outer:
        stand_in = getattr(module, ROTARY_FUNCTION)
        assert outer and isinstance(stand_in, FastRotary) and stand_in.original is transformers_rotary
        with fast_vision_rotary(module, CPU) as inner:
            assert inner and getattr(module, ROTARY_FUNCTION) is stand_in and stand_in.users == 2
        assert getattr(module, ROTARY_FUNCTION) is stand_in and stand_in.users == 1
        got = stand_in(q, k, cos, sin)  # CPU tensors: transformers' own function
        for g, w in zip(got, transformers_rotary(q, k, cos, sin), strict=True):
            assert torch.equal(g, w)
    assert getattr(module, ROTARY_FUNCTION) is transformers_rotary
    with pytest.raises(RuntimeError, match="inside"), fast_vision_rotary(module, CPU):
        raise RuntimeError("inside")
    assert getattr(module, ROTARY_FUNCTION) is transformers_rotary


@pytest.mark.usefixtures("fused_allowed")
def test_a_kernel_that_cannot_be_built_leaves_transformers_rotary_with_one_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def unbuildable(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise ImportError("no Triton here")

    monkeypatch.setattr(vision_rotary, "rotate_vision", unbuildable)
    module = fake_modeling()
    q, k, cos, sin = rotary_inputs(5, 2, 8, torch.float32, CPU)
    with fast_vision_rotary(module, CPU):
        stand_in = getattr(module, ROTARY_FUNCTION)
        with pytest.warns(UserWarning, match="vision rotary kernel unavailable"):
            first = stand_in(q, k, cos, sin)
        second = stand_in(q, k, cos, sin)  # no second attempt, no second warning (pytest fails on stray warnings)
    assert "no Triton here" in stand_in.gate.failed[vision_rotary.ROTARY_KERNEL]
    for got in (first, second):
        for g, w in zip(got, transformers_rotary(q, k, cos, sin), strict=True):
            assert torch.equal(g, w)


def _tower_and_pixels(build: Callable[..., tuple[Any, Any]]) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    model, processor = build(0)
    visual = model.model.visual.eval()
    inputs = processor.image_processor(images=[noise_image(112, 140, seed=1)], return_tensors="pt")
    return visual, inputs["pixel_values"], inputs["image_grid_thw"]


@pytest.mark.usefixtures("fused_allowed")
@pytest.mark.parametrize(
    ("build", "modeling"),
    [
        (build_tiny_qwen2_5_vl, modeling_qwen2_5_vl),
        (build_tiny_qwen3_vl, modeling_qwen3_vl),
        (build_tiny_qwen3_5, None),
    ],
    ids=["qwen2.5-vl", "qwen3-vl", "qwen3.5"],
)
def test_each_qwen_tower_rotates_through_the_function_the_block_sets(
    build: Callable[..., tuple[Any, Any]], modeling: types.ModuleType | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every vision block's attention calls its modeling module's function once per forward, so the stand-in the
    adapters set is what the tower runs (Qwen3.5: its own modeling module, whichever transformers names it). The
    stand-in's calls are counted where it asks for the kernel (which declines CPU tensors)."""
    visual, pixels, grid = _tower_and_pixels(build)
    module = modeling_module(visual)
    assert module is not None and (modeling is None or module is modeling)
    original = getattr(module, ROTARY_FUNCTION)
    calls: list[torch.Tensor] = []

    def counted(q: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        calls.append(q)
        return dispatch.rotate_vision(q, *rest)

    monkeypatch.setattr(vision_rotary, "rotate_vision", counted)
    with torch.no_grad(), fast_vision_rotary(module, CPU):
        assert isinstance(getattr(module, ROTARY_FUNCTION), FastRotary)
        visual(pixels.to(next(visual.parameters()).dtype), grid_thw=grid)
    assert len(calls) == len(visual.blocks)
    assert getattr(module, ROTARY_FUNCTION) is original


@cuda_only
def test_the_qwen2_5_vl_tower_on_cuda_gives_its_own_bits_with_the_kernel() -> None:
    """The tiny tower in bfloat16 on CUDA: the last hidden state with the kernel is the tower's own, bit for bit."""
    cuda = torch.device("cuda")
    if not dispatch.triton_enabled(cuda):
        pytest.skip("Triton is not available")
    visual, pixels, grid = _tower_and_pixels(build_tiny_qwen2_5_vl)
    visual = visual.to(cuda, torch.bfloat16)
    pixels, grid = pixels.to(cuda, torch.bfloat16), grid.to(cuda)
    with torch.no_grad():
        want = visual(pixels, grid_thw=grid).last_hidden_state
        with fast_vision_rotary(modeling_module(visual), cuda) as set_:
            got = visual(pixels, grid_thw=grid).last_hidden_state
    assert set_ and torch.equal(got, want)
