"""Aligned vision MLP (care_core/backbones/aligned_mlp.py): the padding each width needs, the padded MLP against the
MLP computed by hand (values and gradients, float64), which modules the block sets and that it sets nothing off CUDA,
the modules restored also on error, and the tiny Qwen2.5-VL tower with a misaligned MLP width equal to its own
forward (the decision reads only the device argument, so these run without a GPU)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from care_core.backbones import aligned_mlp
from care_core.backbones.aligned_mlp import MisalignedMlps, aligned_gated_mlps, alignment_padding, padded_gated_mlp
from care_core.backbones.qwen2_5_vl.demo import build_tiny_qwen2_5_vl
from care_core.backbones.tiny_parts import TinySizes

from ._helpers import noise_image

CUDA = torch.device("cuda")


class GatedMLP(nn.Module):
    """The shape of Qwen2.5-VL's vision MLP: ``down(act(gate(x)) * up(x))``, with biases."""

    def __init__(self, width: int, hidden: int, dtype: torch.dtype, act: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.gate_proj, self.up_proj = (nn.Linear(width, hidden, dtype=dtype) for _ in range(2))
        self.down_proj = nn.Linear(hidden, width, dtype=dtype)
        self.act_fn = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def by_hand(mlp: GatedMLP, x: torch.Tensor) -> torch.Tensor:
    """The gated MLP written out with matrix products."""
    gate = x @ mlp.gate_proj.weight.T + mlp.gate_proj.bias
    up = x @ mlp.up_proj.weight.T + mlp.up_proj.bias
    return (mlp.act_fn(gate) * up) @ mlp.down_proj.weight.T + mlp.down_proj.bias


WIDTHS = [(3420, torch.bfloat16, 4), (3424, torch.bfloat16, 0), (3421, torch.float32, 3), (21, torch.float64, 1),
          (4304, torch.bfloat16, 0)]  # fmt: skip


@pytest.mark.parametrize(("hidden", "dtype", "padding"), WIDTHS)
def test_padding_reaches_the_next_multiple_of_16_bytes(hidden: int, dtype: torch.dtype, padding: int) -> None:
    mlp = GatedMLP(8, hidden, dtype, nn.functional.silu)
    assert alignment_padding(mlp) == padding


@pytest.mark.parametrize("act", [nn.functional.silu, nn.functional.gelu, torch.sigmoid], ids=["silu", "gelu", "sig"])
def test_the_padded_mlp_equals_the_mlp_by_hand_with_its_gradients(act: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """sigmoid(0) = 1/2: the padded units' gate is not zero after it, their product still is."""
    torch.manual_seed(0)
    mlp = GatedMLP(6, 21, torch.float64, act)
    x = torch.randn(5, 6, dtype=torch.float64)
    want = by_hand(mlp, x)
    want.square().sum().backward()
    want_grads = [p.grad.clone() for p in mlp.parameters()]  # type: ignore[union-attr]
    mlp.zero_grad()
    got = padded_gated_mlp(mlp, x, padding=3)
    got.square().sum().backward()
    torch.testing.assert_close(got, want, atol=1e-13, rtol=0)
    for grad, want_grad in zip([p.grad for p in mlp.parameters()], want_grads, strict=True):
        torch.testing.assert_close(grad, want_grad, atol=1e-12, rtol=0)


def test_the_block_sets_only_misaligned_gated_mlps_on_cuda_and_restores_them() -> None:
    misaligned = GatedMLP(4, 21, torch.float64, nn.functional.silu)
    aligned = GatedMLP(4, 22, torch.float64, nn.functional.silu)
    plain = nn.Sequential(nn.Linear(4, 21, dtype=torch.float64), nn.Linear(21, 4, dtype=torch.float64))
    model = nn.ModuleList([misaligned, aligned, plain])
    with aligned_gated_mlps(model, torch.device("cpu")) as count:
        assert count == 0 and not any("forward" in vars(m) for m in model.modules())
    with aligned_gated_mlps(model, CUDA) as count:
        assert count == 1 and "forward" in vars(misaligned)
        assert not any("forward" in vars(m) for m in (aligned, plain, *plain))
        x = torch.randn(3, 4, dtype=torch.float64)
        torch.testing.assert_close(misaligned(x), by_hand(misaligned, x), atol=1e-13, rtol=0)
    assert "forward" not in vars(misaligned)
    with pytest.raises(RuntimeError, match="inside"), aligned_gated_mlps(model, CUDA):
        raise RuntimeError("inside")
    assert "forward" not in vars(misaligned)


def test_the_owners_record_is_searched_once_per_weight_type(monkeypatch: pytest.MonkeyPatch) -> None:
    misaligned = GatedMLP(4, 21, torch.float64, nn.functional.silu)
    model = nn.ModuleList([misaligned, GatedMLP(4, 22, torch.float64, nn.functional.silu)])
    found: MisalignedMlps = {}
    with aligned_gated_mlps(model, CUDA, found) as count:
        assert count == 1
    assert found == {torch.float64: ((misaligned, 1),)}  # 21 -> 22 units: a row a whole number of 16 bytes

    def searched_again(module: nn.Module) -> None:
        raise AssertionError("the module was searched again")

    monkeypatch.setattr(aligned_mlp, "misaligned_gated_mlps", searched_again)
    with aligned_gated_mlps(model, CUDA, found) as outer, aligned_gated_mlps(model, CUDA, found) as inner:
        assert (outer, inner) == (1, 0)  # the enclosing block's setting is left to it
        x = torch.randn(3, 4, dtype=torch.float64)
        torch.testing.assert_close(misaligned(x), by_hand(misaligned, x), atol=1e-13, rtol=0)
    assert "forward" not in vars(misaligned)


def test_the_qwen2_5_vl_tower_with_a_misaligned_mlp_width_gives_its_own_output() -> None:
    """The tiny tower with a 3-block, 65-wide MLP (float64: 2 values a 16-byte row, one unit of padding): every block's
    MLP is matched (transformers' Qwen2_5_VLMLP), and the hidden states and merged output are the tower's own."""
    sizes = TinySizes(vision_intermediate=65, vision_layers=3)
    model, processor = build_tiny_qwen2_5_vl(0, sizes)
    visual = model.model.visual.to(torch.float64).eval()
    inputs = processor.image_processor(images=[noise_image(112, 140, seed=1)], return_tensors="pt")
    pixels, grid = inputs["pixel_values"].to(torch.float64), inputs["image_grid_thw"]
    with torch.no_grad():
        want = visual(pixels, grid_thw=grid)
        with aligned_gated_mlps(visual, CUDA) as count:
            got = visual(pixels, grid_thw=grid)
    assert count == 3
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, atol=1e-12, rtol=0)
    torch.testing.assert_close(got.pooler_output, want.pooler_output, atol=1e-12, rtol=0)
