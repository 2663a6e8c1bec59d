"""DivPrune: hand-checked greedy steps, the duplicate behaviour and its one deviation, golden files."""

from __future__ import annotations

import pytest
import torch

from care_core.errors import MethodError
from care_core.methods import MethodInputs, build_method
from care_core.methods.divprune import cosine_distance_matrix, divprune_select
from tests._triton_interpreter import run_interpreted

from .conftest import GOLDEN_FILES, assert_golden_passes, make_inputs


def _inputs(features: torch.Tensor) -> MethodInputs:
    return MethodInputs(features, lambda x: x, torch.zeros(features.shape[0], 2))


def test_greedy_steps_by_hand() -> None:
    # a ~ b (distance 0.006), c orthogonal to a, d opposite to a.
    x = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [-1.0, 0.0]])
    # step 0: nearest-neighbour distances a 0.006, b 0.006, c 0.89 (to b), d 1.0 (to c) -> d
    # step 1: distances to d: a 2, b 1.99, c 1 -> a; step 2: min(to d, to a): b 0.006, c 1 -> c
    assert divprune_select(x, 3).tolist() == [3, 0, 2]
    assert divprune_select(x, 3, mask_selected=True).tolist() == [3, 0, 2]


def test_distance_matrix_is_one_minus_cosine() -> None:
    x = torch.tensor([[3.0, 0.0], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0]])
    dist = cosine_distance_matrix(x)
    assert dist[0, 1].item() == pytest.approx(1 - 2**-0.5)
    assert dist[0, 0].item() == pytest.approx(0.0, abs=1e-7)
    # zero rows: 0 to zero rows (themselves included), 1 to everything else, never NaN
    assert dist[2:, 2:].tolist() == [[0.0, 0.0], [0.0, 0.0]]
    assert dist[2, :2].tolist() == [1.0, 1.0]


def test_official_rule_reselects_and_registered_rule_does_not() -> None:
    x = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    # step 0: every column's second-smallest is 0 (its twin) -> 0; step 1: -> 2; step 2: all min distances 0 -> 0
    assert divprune_select(x, 3).tolist() == [0, 2, 0]
    assert divprune_select(x, 3, mask_selected=True).tolist() == [0, 2, 1]  # lowest-index unselected instead
    result = build_method("divprune")(_inputs(x), 3)
    assert result.token_index.tolist() == [0, 1, 2]
    assert result.info["selection_order"].tolist() == [0, 2, 1]
    with pytest.raises(MethodError, match="re-selected"):
        build_method("divprune", mask_selected=False)(_inputs(x), 3)


def test_registered_equals_official_without_exhaustion() -> None:
    inputs = make_inputs(seed=4)
    result = build_method("divprune")(inputs, 30)
    with torch.no_grad():
        official = divprune_select(inputs.projector(inputs.features), 30)
    assert torch.equal(result.info["selection_order"], official)  # runs on the post-projector tokens
    assert torch.equal(result.token_index, official.sort().values)
    assert torch.equal(result.tokens, inputs.features[official.sort().values])  # pre-projector rows are returned


def test_zero_tokens_select_distinct_indices() -> None:
    x = torch.zeros(6, 3)
    x[0, 0] = 1.0
    order = divprune_select(x, 4, mask_selected=True)
    assert order.unique().numel() == 4


@pytest.mark.parametrize("name", GOLDEN_FILES["divprune"])
def test_golden(name: str) -> None:
    assert_golden_passes(name)


# The fused kernel (care_core.kernels.divprune) against the loop it replaces, through the same entry point; run by
# Triton's interpreter on the CPU (in a subprocess: TRITON_INTERPRET is read when Triton is imported). CI's CPU
# wheel of torch brings no Triton, so this runs where Triton is installed; tests/core/test_cuda_batches.py runs the
# compiled kernel on a GPU.
_INTERPRETED = """
import torch
from care_core.kernels import dispatch
from care_core.methods.divprune import divprune_select_batch
dispatch.why_not_fused = lambda device: None  # let the gate choose the kernel on the CPU (interpreted)
g = torch.Generator().manual_seed(0)
base = torch.randn(4, 8, generator=g)
cases = []
for dtype in (torch.float32, torch.float64):
    xs = [torch.randn(n, 16, generator=g, dtype=dtype) for n in (37, 64, 5, 50)]
    cases += [(xs, [20, 64, 5, 12], True), (xs, [20, 30, 5, 12], False)]
# ties and exhaustion: repeated rows (the masked rule's fallback, the official rule's duplicates) and zero rows
repeated = [base[torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 0, 0])], base[torch.tensor([1, 1, 1])], torch.zeros(6, 8)]
cases += [(repeated, [10, 3, 6], True), (repeated, [8, 3, 6], False)]
for xs, ks, mask in cases:
    loop = divprune_select_batch(xs, ks, mask, kernel="torch")
    fused = divprune_select_batch(xs, ks, mask, kernel="fused")
    assert all(torch.equal(a, b) for a, b in zip(loop, fused, strict=True)), (ks, mask, loop, fused)
print("equal", len(cases))
"""


def test_fused_kernel_selects_what_the_loop_selects_interpreted() -> None:
    assert run_interpreted(_INTERPRETED) == "equal 6"


# The kernel runs max k_i steps for every image; past an image's n (all its tokens selected) the masked rule's
# fallback must still name one of its own rows (the loop's: row 0), never a row past its matrix.
_EXHAUSTED = """
import torch
from care_core.kernels.divprune import divprune_orders
sizes = [3, 10, 1]
dist = torch.full((3, 10, 10), float("-inf"))
first = torch.full((3, 10), float("-inf"))
g = torch.Generator().manual_seed(1)
for i, n in enumerate(sizes):
    x = torch.nn.functional.normalize(torch.randn(n, 4, generator=g), dim=1)
    dist[i, :n, :n] = 1 - x @ x.T
    first[i, :n] = dist[i, :n, :n].sum(1)
order = divprune_orders(dist, first, torch.tensor(sizes), 10, True)
for i, n in enumerate(sizes):
    assert sorted(order[i, :n].tolist()) == list(range(n)), order[i]
    assert order[i, n:].tolist() == [0] * (10 - n), order[i]
print("own rows")
"""


def test_fused_kernel_past_an_images_tokens_reads_only_its_own_rows_interpreted() -> None:
    assert run_interpreted(_EXHAUSTED) == "own rows"


def test_kernel_setting_is_checked_and_fused_refuses_the_cpu() -> None:
    from care_core.errors import CareError

    with pytest.raises(CareError, match="kernel"):
        build_method("divprune", kernel="cuda")
    inputs = make_inputs(20, seed=1)
    assert torch.equal(build_method("divprune", kernel="auto")(inputs, 5).indices,
                       build_method("divprune")(inputs, 5).indices)  # fmt: skip
    with pytest.raises(CareError, match="fused"):
        build_method("divprune", kernel="fused")(inputs, 5)
