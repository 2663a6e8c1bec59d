"""PRCA anchor selection, paper Eq. 3: diversity-greedy on psi_bar and D(v_i, v_j) = 1 - cos(v_i, v_j)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from care_core.kernels import dispatch
from care_core.kernels.dispatch import Kernel, KernelGate, as_gate
from care_core.kernels.shapes import GREEDY_MAX_TOKENS, greedy_layout
from care_core.precision import matmul_precision


def unit_rows(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Rows divided by max(||row||, eps): zero rows stay zero, so their cosine with anything is 0."""
    return x / x.norm(dim=-1, keepdim=True).clamp_min(eps)


def cosine_similarity_matrix(a: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    """cos(a_i, b_j) = a_i . b_j / (max(||a_i||, eps) max(||b_j||, eps)); (len(a), len(b))."""
    return unit_rows(a, eps) @ unit_rows(b, eps).T


def fused_greedy_applies(weights: torch.Tensor, features: torch.Tensor) -> bool:
    """Whether the fused greedy kernel takes these inputs (float32, N <= GREEDY_MAX_TOKENS); the gate decides
    about the device and Triton."""
    return weights.dtype == torch.float32 and features.dtype == torch.float32 and weights.shape[0] <= GREEDY_MAX_TOKENS


def diversity_greedy(
    weights: torch.Tensor,
    features: torch.Tensor,
    k: int,
    eps: float,
    *,
    kernel: Kernel | KernelGate = "auto",
) -> torch.Tensor:
    """Selection order of k tokens by Eq. 3; returns (k,) long indices in the order chosen.

    S starts at argmax w; each step adds argmax_{i not in S} w_i min_{j in S} (1 - cos(v_i, v_j)).
    Ties go to the lowest index (torch.argmax returns the first maximum). The running minimum is
    updated with one row of cosines per step and the loop never reads a value back to the host.

    On CUDA (float32, N <= 16384, Triton present; ``kernel`` "auto" or "fused") the K steps run in one
    fused kernel over the cosine Gram matrix (:func:`fused_orders`): the same steps, one launch instead of
    ~8 per step. Its cosines come from one float32 matmul instead of one matvec per step, so they can
    differ in the last bit: the order is the same unless two candidates tie to within float32 rounding.
    A kernel that cannot be built falls back to the loop ("auto") for this call.
    """
    gate = as_gate(kernel)
    if gate.choose("greedy", weights.device, applies=fused_greedy_applies(weights, features)) == "fused":
        orders = fused_orders([weights], [features], [k], eps, gate)
        if orders is not None:
            return orders[0]
    unit = unit_rows(features, eps)
    return _greedy_order(weights, k, lambda chosen: unit @ unit.index_select(0, chosen)[0])


def fused_orders(
    weights: Sequence[torch.Tensor], features: Sequence[torch.Tensor], ks: Sequence[int], eps: float, gate: KernelGate
) -> list[torch.Tensor] | None:
    """Eq. 3's order per image from the fused kernel, all images in one launch (one program each, side by side on
    the device): each image's float32 cosine Gram matrix (one matmul per image, TF32 off) into one packed buffer,
    then :func:`~care_core.kernels.greedy.greedy_orders`. Each image's order is what it gets alone: the same matmul
    on the same rows, the same steps. None where the kernel cannot be built (``gate.attempt``)."""
    sizes = [int(v.shape[0]) for v in features]
    starts, length = greedy_layout(sizes)
    grams = features[0].new_empty(length, dtype=torch.float32)
    with matmul_precision(allow_tf32=False):
        for v, start, n in zip(features, starts, sizes, strict=True):
            unit = unit_rows(v, eps)
            torch.mm(unit, unit.T, out=grams[start : start + n * n].view(n, n))
    joined = weights[0] if len(weights) == 1 else torch.cat(list(weights))
    return gate.attempt("greedy", lambda: dispatch.greedy_orders(joined, grams, sizes, ks))


def diversity_greedy_gram(weights: torch.Tensor, gram: torch.Tensor, k: int) -> torch.Tensor:
    """Eq. 3 from a precomputed cosine matrix ``gram`` (N, N): the PyTorch twin of the fused GPU kernel.

    Same steps and tie rule as :func:`diversity_greedy`, reading row ``gram[chosen]`` instead of computing
    ``unit @ unit[chosen]``; used to check the kernel and as its reference on the CPU.
    """
    return _greedy_order(weights, k, lambda chosen: gram.index_select(0, chosen)[0])


def _greedy_order(weights: torch.Tensor, k: int, cosines: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The Eq. 3 loop; ``cosines(chosen)`` is the (N,) row cos(v_i, v_chosen) for a 1-element index tensor."""
    n = weights.shape[0]
    order = torch.empty(k, dtype=torch.long, device=weights.device)
    selected = torch.zeros(n, dtype=torch.bool, device=weights.device)
    chosen = torch.argmax(weights).view(1)  # 1-element tensors: indexing with them needs no sync
    order[0:1] = chosen
    selected.index_fill_(0, chosen, True)
    min_distance = 1 - cosines(chosen)
    minus_inf = torch.full((), float("-inf"), dtype=weights.dtype, device=weights.device)  # a fill: no host copy
    for step in range(1, k):
        score = torch.where(selected, minus_inf, weights * min_distance)
        chosen = torch.argmax(score).view(1)
        order[step : step + 1] = chosen
        selected.index_fill_(0, chosen, True)
        min_distance = torch.minimum(min_distance, 1 - cosines(chosen))
    return order
