"""On a CUDA device: the batched paths that CUDA changes give per image what batch 1 gives there.

The Qwen towers pack their attention on CUDA only (docs/design/backbones.md §Packed vision attention), and the merge
methods' batched loops run other kernel shapes than one image's; the CPU tests cannot see either.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from care_core import CaReConfig
from care_core.backbones import load_backbone
from care_core.methods import build_method
from tests.backbones._helpers import noise_image
from tests.methods.conftest import make_inputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SIZES = [(300, 420), (500, 260), (336, 336), (224, 448)]
METHODS = ("tome", "ficoco-v", "zoo-prune", "simple-calib", "confidence-calib", "care")


@pytest.mark.parametrize("name", ["tiny-qwen2.5-vl-random", "tiny-qwen3-vl-random"])
def test_packed_tower_on_cuda_gives_each_image_its_unpacked_features(name: str, tmp_path: Path) -> None:
    adapter: Any = load_backbone(name, device="cuda", dtype=torch.float32, home=tmp_path)
    images = [noise_image(h, w, seed=i) for i, (h, w) in enumerate(SIZES)]
    batch = adapter.encode_images(images)  # packed: CUDA and sdpa
    adapter.pack_vision_attention = False  # transformers' own per-segment loop
    alone = [adapter.encode_images([image])[0] for image in images]
    assert adapter.model.config.vision_config._attn_implementation == "sdpa"  # restored after every call
    for many, one in zip(batch, alone, strict=True):
        torch.testing.assert_close(many.features, one.features, atol=1e-4, rtol=1e-4)


def _on_cuda(probes: dict[str, Any]) -> dict[str, Any]:
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in probes.items()}


@pytest.mark.parametrize("name", METHODS)
def test_batched_methods_on_cuda_keep_what_each_image_keeps_alone(name: str) -> None:
    made = [make_inputs(n, d_v=64, seed=7 * i + n) for i, n in enumerate((576, 400, 576, 324))]
    projector = made[0].projector.cuda()
    inputs = [dataclasses.replace(one, features=one.features.cuda(), positions=one.positions.cuda(),
                                  projector=projector, probes=_on_cuda(one.probes)) for one in made]  # fmt: skip
    keeps = [64, 40, 144, 64]
    method = build_method(name, CaReConfig(m=16, seed=3))
    for one, got, keep in zip(inputs, method.batch(inputs, keeps), keeps, strict=True):
        want = method(one, keep)
        assert torch.equal(got.indices.cpu(), want.indices.cpu()), name
        # a joint pass's products run other CUDA kernels than one image's; the scores' TF32 products (jvp, and
        # the fd engine's second layer) then differ in their last bits, and calibration weights carry that into
        # the tokens (1.5e-4 seen on an H200 for confidence-calib): equal indices, tokens to TF32 rounding
        torch.testing.assert_close(got.tokens, want.tokens, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("kernel", ["fused", "torch"])
def test_greedy_order_on_cuda_is_a_prefix_of_any_longer_one(kernel: str) -> None:
    """The memo's premise on the device (docs/design/batches.md §Batches): K only bounds the greedy's loop, so the
    order for K is the first K of the order for any larger K, with the fused kernel as with the loop."""
    from care_core.anchors import diversity_greedy

    g = torch.Generator().manual_seed(11)
    features = torch.randn(2880, 64, generator=g).cuda()
    weights = torch.rand(2880, generator=g).cuda()
    longest = diversity_greedy(weights, features, 640, 1e-8, kernel=kernel)  # type: ignore[arg-type]
    for k in (160, 320):
        assert torch.equal(diversity_greedy(weights, features, k, 1e-8, kernel=kernel), longest[:k])  # type: ignore[arg-type]


def test_fused_greedy_orders_a_batch_in_one_launch_as_each_image_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eq. 3 for images of different N and K in one launch of the fused kernel: each image's order bit for bit
    what the kernel gives it alone (K = N included)."""
    from care_core.anchors import diversity_greedy
    from care_core.care_batch import batch_anchors
    from care_core.kernels import dispatch
    from care_core.kernels.dispatch import KernelGate, triton_enabled

    if not triton_enabled(torch.device("cuda")):
        pytest.skip("Triton is not available")
    g = torch.Generator().manual_seed(17)
    sizes, ks = (2880, 577, 1152, 40, 2001), (160, 64, 1152, 40, 300)
    features = [torch.randn(n, 64, generator=g).cuda() for n in sizes]
    weights = [torch.rand(n, generator=g).cuda() for n in sizes]
    launches: list[list[int]] = []
    real = dispatch.greedy_orders

    def counted(w: torch.Tensor, grams: torch.Tensor, n: list[int], k: list[int]) -> list[torch.Tensor]:
        launches.append(list(n))
        return real(w, grams, n, k)

    monkeypatch.setattr(dispatch, "greedy_orders", counted)
    together = batch_anchors(weights, features, ks, 1e-8, KernelGate("fused"))
    assert launches == [list(sizes)]
    for order, w, v, k in zip(together, weights, features, ks, strict=True):
        assert torch.equal(order.cpu(), diversity_greedy(w, v, k, 1e-8, kernel="fused").cpu())
    assert len(launches) == 1 + len(sizes)


@pytest.mark.parametrize("mask_selected", [True, False])
def test_fused_divprune_on_cuda_selects_what_the_loop_selects(mask_selected: bool) -> None:
    """The compiled kernel (care_core.kernels.divprune) against the loop on the same distances; repeated rows make
    ties and, past four picks, exhaustion (the masked rule's fallback, the official rule's duplicates)."""
    from care_core.methods.divprune import divprune_select_batch

    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(n, 64, generator=g) for n in (2880, 577, 1152, 40)]
    xs.append(torch.randn(4, 64, generator=g)[torch.arange(30) % 4])
    xs = [x.cuda() for x in xs]
    ks = [640, 577 if mask_selected else 600, 160, 40, 12]
    loop = divprune_select_batch(xs, ks, mask_selected, kernel="torch")
    fused = divprune_select_batch(xs, ks, mask_selected, kernel="fused")
    for a, b in zip(loop, fused, strict=True):
        assert torch.equal(a.cpu(), b.cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_ficoco_row_quantile_on_cuda_is_torch_quantile(dtype: torch.dtype) -> None:
    """FiCoCo-V's threshold from a small top-k equals torch.quantile's sort on the device too, ties included."""
    from care_core.methods.ficoco import QUANTILE, row_quantile

    g = torch.Generator().manual_seed(2)
    for t in (2, 77, 577, 2881):
        rows = torch.randn(3, 42, t, generator=g, dtype=dtype).cuda()
        rows[1] = rows[1].round()
        for q in (QUANTILE, 0.5, 0.0, 1.0):
            assert torch.equal(row_quantile(rows, q), torch.quantile(rows, q, dim=-1, keepdim=True)), (t, q)


@pytest.mark.parametrize("name", ["tome", "ficoco-v"])
def test_planned_budgets_on_cuda_give_each_budget_what_it_gets_alone(name: str) -> None:
    """Images with memos and planned budgets (ToMe's one loop over them, FiCoCo-V's shared steps), each budget
    asked in turn for the batch: per image and budget, what the budget gets alone without memo."""
    made = [make_inputs(n, d_v=64, seed=5 * i + n) for i, n in enumerate((576, 400, 576))]
    alone = [_cuda_inputs(one) for one in made]
    planned = (160, 64, 16)
    shared = [dataclasses.replace(one, memo={}, planned_keeps=planned) for one in alone]
    method = build_method(name)
    for keep in planned:
        for one, got in zip(alone, method.batch(shared, [keep] * 3), strict=True):
            want = method(one, keep)
            assert torch.equal(got.token_index.cpu(), want.token_index.cpu()), (name, keep)
            # the merges' scatter-adds run in atomics on CUDA: the same sums in any order, to float32 rounding
            torch.testing.assert_close(got.tokens, want.tokens, atol=1e-5, rtol=1e-5)


def _cuda_inputs(one: Any) -> Any:
    return dataclasses.replace(one, features=one.features.cuda(), positions=one.positions.cuda(),
                               projector=one.projector.cuda(), probes=_on_cuda(one.probes))  # fmt: skip
