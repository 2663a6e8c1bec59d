"""The LLaVA towers' encoder (care_core/backbones/vision_encoder.py, care_core/kernels/quick_gelu.py): the hidden
states the model reads against transformers' own ``hidden_states`` with the forward stopped after the deepest one
(float64, exact; gradients; the model's own forward still works after), the QuickGELU block (nothing off CUDA; every
CLIP layer's activation set and put back, also on error; SigLIP's untouched; transformers' own where the kernel cannot
be built) and, on CUDA, the kernel against transformers' ``QuickGELUActivation`` on every bfloat16 and float16 value
and 32 M float32 ones, bit for bit, and the tiny CLIP tower's bits with it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers.activations import QuickGELUActivation

from care_core.backbones import vision_encoder
from care_core.backbones.llava_next.demo import build_tiny_llava_next
from care_core.backbones.llava_onevision.demo import build_tiny_llava_onevision
from care_core.backbones.probes import clip_encoder_layers
from care_core.backbones.vision_encoder import QUICK_GELU_KERNEL, FastQuickGelu, encoder_hidden_states, fast_quick_gelus
from care_core.kernels import dispatch
from care_core.kernels.dispatch import KernelGate

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CPU = torch.device("cpu")


def clip_tower(dtype: torch.dtype = torch.float64) -> tuple[torch.nn.Module, torch.Tensor]:
    """The tiny LLaVA-NeXT's CLIP tower (3 layers) and two crops of noise."""
    model, _ = build_tiny_llava_next(0)
    tower = model.model.vision_tower.to(dtype).eval()
    side = int(tower.config.image_size)
    pixels = torch.randn(2, 3, side, side, generator=torch.Generator().manual_seed(1), dtype=dtype)
    return tower, pixels


@pytest.fixture
def fused_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The block's device check passes (as on a CUDA machine with Triton); the kernel still needs CUDA tensors."""
    monkeypatch.setattr(vision_encoder, "why_not_fused", lambda device: None)


# ---------------------------------------------------------------------------------------------- hidden states
@pytest.mark.parametrize("feature_layer", [-2, -1, 1, [-2, -1], [2, 1, 2], 0, [0, -2]])
def test_the_hidden_states_read_are_transformers_own(feature_layer: Any) -> None:
    tower, pixels = clip_tower()
    with torch.no_grad():
        want = tower(pixel_values=pixels, output_hidden_states=True).hidden_states
        got = encoder_hidden_states(tower, pixels, feature_layer)
    read = [feature_layer] if isinstance(feature_layer, int) else feature_layer
    assert len(got) == len(read)
    for state, index in zip(got, read, strict=True):
        assert torch.equal(state, want[index])


def test_the_forward_stops_after_the_deepest_layer_read_and_the_model_still_runs_whole() -> None:
    """-2 on a 3-layer encoder: the third layer never runs (its forward counted); the tower's own hidden states are
    whole after (transformers installs its output hooks on the first call that asks for them)."""
    tower, pixels = clip_tower()
    layers = clip_encoder_layers(tower)
    runs = [0] * len(layers)
    for i, layer in enumerate(layers):
        layer.register_forward_hook(lambda m, a, o, i=i: runs.__setitem__(i, runs[i] + 1))
    with torch.no_grad():
        encoder_hidden_states(tower, pixels, -2)
        assert runs == [1, 1, 0]
        states = tower(pixel_values=pixels, output_hidden_states=True).hidden_states
    assert len(states) == len(layers) + 1 and runs == [2, 2, 1]


def test_a_feature_layer_out_of_range_is_refused() -> None:
    tower, pixels = clip_tower()
    with pytest.raises(ValueError, match="out of range"):
        encoder_hidden_states(tower, pixels, 4)


def test_gradients_reach_the_layers_read_and_no_later_one() -> None:
    tower, pixels = clip_tower()
    (state,) = encoder_hidden_states(tower, pixels, -2)
    state.square().sum().backward()
    layers = clip_encoder_layers(tower)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layers[1].parameters())
    assert all(p.grad is None for p in layers[2].parameters())


# ------------------------------------------------------------------------------------------------- the block
def test_the_block_sets_nothing_off_cuda() -> None:
    tower, _ = clip_tower()
    with fast_quick_gelus(clip_encoder_layers(tower), CPU, KernelGate("auto")) as count:
        assert count == 0
        assert not any("forward" in vars(m) for m in tower.modules())


@pytest.mark.usefixtures("fused_allowed")
def test_the_block_sets_each_clip_activation_and_puts_it_back() -> None:
    tower, pixels = clip_tower()
    layers = clip_encoder_layers(tower)
    acts = [layer.mlp.activation_fn for layer in layers]
    with torch.no_grad():
        want = tower(pixel_values=pixels).last_hidden_state
        with fast_quick_gelus(layers, CPU, KernelGate("auto")) as count:
            assert count == len(layers) and all(isinstance(vars(act)["forward"], FastQuickGelu) for act in acts)
            with fast_quick_gelus(layers, CPU, KernelGate("auto")) as inner:
                assert inner == 0  # an enclosing block's setting is left to it
            got = tower(pixel_values=pixels).last_hidden_state  # CPU tensors: transformers' own activation
    assert torch.equal(got, want)
    assert not any("forward" in vars(act) for act in acts)
    with pytest.raises(RuntimeError, match="inside"), fast_quick_gelus(layers, CPU, KernelGate("auto")):
        raise RuntimeError("inside")
    assert not any("forward" in vars(act) for act in acts)


@pytest.mark.usefixtures("fused_allowed")
def test_the_block_leaves_siglip_alone() -> None:
    model, _ = build_tiny_llava_onevision(0)
    layers = clip_encoder_layers(model.model.vision_tower)
    with fast_quick_gelus(layers, CPU, KernelGate("auto")) as count:
        assert count == 0


def test_a_kernel_that_cannot_be_built_leaves_transformers_activation_with_one_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def unbuildable(x: torch.Tensor) -> torch.Tensor:
        raise ImportError("no Triton here")

    monkeypatch.setattr(vision_encoder, "quick_gelu", unbuildable)
    act, gate = QuickGELUActivation(), KernelGate("auto")
    stand_in = FastQuickGelu(act.forward, gate)
    x = torch.randn(5, 7, dtype=torch.float64)
    with pytest.warns(UserWarning, match="quick GELU kernel unavailable"):
        first = stand_in(x)
    second = FastQuickGelu(act.forward, gate)(x)  # the gate remembers: no second attempt, no second warning
    assert "no Triton here" in gate.failed[QUICK_GELU_KERNEL]
    for got in (first, second):
        assert torch.equal(got, x * torch.sigmoid(1.702 * x))


def test_the_kernel_refuses_what_it_cannot_take() -> None:
    x = torch.randn(4, 6)
    assert dispatch.quick_gelu(x) is None  # CPU
    if torch.cuda.is_available():
        cuda = torch.randn(4, 6, device="cuda")
        assert not dispatch.quick_gelu_applies(cuda.double())  # a type it does not take
        assert not dispatch.quick_gelu_applies(cuda.mT)  # not contiguous
        assert not dispatch.quick_gelu_applies(cuda.requires_grad_())  # a gradient wanted


# ------------------------------------------------------------------------------------------------ on CUDA
def every_value(dtype: torch.dtype) -> torch.Tensor:
    """Every 16-bit pattern as a ``dtype`` value (infinities and NaNs included)."""
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_kernel_gives_transformers_activation_bit_for_bit(dtype: torch.dtype) -> None:
    if not dispatch.triton_enabled(torch.device("cuda")):
        pytest.skip("Triton is not available")
    if dtype == torch.float32:
        generator = torch.Generator().manual_seed(3)
        bits = torch.randint(-(2**31), 2**31 - 1, (1 << 24,), generator=generator).to(torch.int32)
        x = torch.cat([8 * torch.randn(1 << 24, generator=generator), bits.view(torch.float32)])
    else:
        x = every_value(dtype)
    x = x.cuda().view(-1, 64)
    got, want = dispatch.quick_gelu(x), QuickGELUActivation()(x)
    assert got is not None and got.dtype == dtype and got.shape == x.shape
    same = (got == want) | (got.isnan() & want.isnan())
    assert bool(same.all()), f"{int((~same).sum())} of {x.numel()} values differ"


@cuda_only
def test_the_clip_tower_on_cuda_gives_its_own_bits_with_the_kernel() -> None:
    cuda = torch.device("cuda")
    if not dispatch.triton_enabled(cuda):
        pytest.skip("Triton is not available")
    tower, pixels = clip_tower(torch.bfloat16)
    tower, pixels = tower.to(cuda), pixels.to(cuda)
    with torch.no_grad():
        want = tower(pixel_values=pixels, output_hidden_states=True).hidden_states[-2]
        with fast_quick_gelus(clip_encoder_layers(tower), cuda, KernelGate("auto")) as count:
            (got,) = encoder_hidden_states(tower, pixels, -2)
    assert count == len(clip_encoder_layers(tower)) and torch.equal(got, want)
