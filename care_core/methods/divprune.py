"""DivPrune (Alvar et al., "DivPrune: Diversity-based Visual Token Pruning for Large Multimodal Models", CVPR 2025).

Official code: vbdi/divprune @ 799e2d9, ``LLaVA/llava/model/llava_arch.py::LlavaMetaForCausalLM.DivPrune``. It runs
on the **post-projector** image embeddings (the image slice of the LLM input embeddings) and needs nothing else.

Released algorithm, reproduced by :func:`divprune_select` with ``mask_selected=False``:

* ``Dist = 1 - (x/|x|)(x/|x|)^T`` in the input precision (float32 for the golden files);
* step 0: the score of column j is its second-smallest entry (the distance to its nearest other token), take the
  argmax;
* step i > 0: the score of token j is ``min over selected s of Dist[s, j]``, take the argmax (first index on ties);
* already selected tokens are **not** masked: their score is ``Dist[j, j] ~ 0``, so once every remaining token is
  a duplicate of a selected one the code re-selects a token and returns duplicate indices (golden
  ``divprune_dup_n16_d32``: ``[0, 12, 4, 8, 0, 0]``).

The one deviation of the registered method ``divprune``: the contract needs K unique tokens, so where the official
rule would re-select an already chosen token (which happens only when every remaining distance is ~0), the
lowest-index unselected token is taken instead (``mask_selected=True``). Every other step is the official rule, so
on inputs without such exhaustion the selection is identical to the released code. Zero vectors (NaN in the
official code) are given distance 0 to every zero vector and 1 to every other token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from care_core._lazy import torch
from care_core.config import Kernel
from care_core.errors import MethodError
from care_core.methods.base import Category, Method, MethodInputs, MethodResult, memo_orders, selection_result
from care_core.methods.lazy_precision import compute_dtype, matmul_precision
from care_core.methods.registry import register

if TYPE_CHECKING:
    from care_core.kernels.dispatch import KernelGate

_TINY = 1e-30  # only guards zero rows; any non-zero norm is used exactly as the official code does
# a batch whose padded (B, max N, max N) distances would hold more entries (1 GiB in float32) goes one image at a time
JOINT_MAX_ENTRIES = 2**28


def cosine_distance_matrix(embeddings: torch.Tensor) -> torch.Tensor:
    """(N, N) ``1 - cos`` with the official float formula ``1 - (x/|x|) @ (x/|x|)^T`` (no tf32).

    Rows with zero norm (NaN in the official code) are at distance 0 from every zero row, themselves included, and
    at distance 1 from every other row.
    """
    norms = embeddings.norm(dim=1, keepdim=True)
    unit = embeddings / norms.clamp_min(_TINY)
    with matmul_precision(allow_tf32=False):
        dist = 1.0 - torch.mm(unit, unit.t())
    zero = norms[:, 0] == 0
    if bool(zero.any()):
        dist[zero[:, None] & zero[None, :]] = 0.0
    return dist


def divprune_select(embeddings: torch.Tensor, k: int, mask_selected: bool = False) -> torch.Tensor:
    """DivPrune's greedy max-min selection order (k,) on `embeddings` (N, d).

    ``mask_selected=False`` reproduces the released code exactly, duplicates included. ``mask_selected=True`` is
    the registered method's rule: identical, except that where the official argmax is an already selected token
    the lowest-index unselected token is taken instead, so the k indices are distinct (needs k <= N).
    """
    n = embeddings.shape[0]
    if k < 0 or (mask_selected and k > n):
        raise MethodError(f"divprune: cannot select {k} distinct tokens out of {n}")
    dist = cosine_distance_matrix(embeddings)
    order = torch.empty(k, dtype=torch.long, device=embeddings.device)
    if k == 0:
        return order
    selected = torch.zeros(n, dtype=torch.bool, device=embeddings.device)
    scores = _first_scores(dist)
    for step in range(k):
        chosen = int(torch.argmax(scores))
        if mask_selected and bool(selected[chosen]):
            chosen = int(torch.nonzero(~selected)[0, 0])
        order[step] = chosen
        selected[chosen] = True
        # running min over the selected rows == the official min over index_select(Dist, 0, s[:i]) (exact)
        scores = dist[chosen] if step == 0 else torch.minimum(scores, dist[chosen])
    return order


def _first_scores(dist: torch.Tensor) -> torch.Tensor:
    """Step 0's score of each token: the second-smallest entry of its column (0 for a single token)."""
    if dist.shape[0] >= 2:
        return torch.topk(dist, 2, dim=0, largest=False).values[1]
    return torch.zeros(1, dtype=dist.dtype, device=dist.device)


def divprune_select_batch(
    embeddings: Sequence[torch.Tensor],
    ks: Sequence[int],
    mask_selected: bool = False,
    *,
    kernel: Kernel | KernelGate = "torch",
) -> list[torch.Tensor]:
    """:func:`divprune_select` for B images (one device and dtype) in one loop of max k_i steps with no host sync.

    Each image's distance matrix is its own (:func:`cosine_distance_matrix`, the single-image product), padded to
    (B, max N, max N) with -inf columns; padded tokens count as selected, score -inf, and are never chosen. Every
    step takes each row's argmax (first index on ties), the running minima of all images at once, and (with
    `mask_selected`) the lowest-index unselected token where the argmax is already selected: per image the same
    numbers and steps as :func:`divprune_select`, so the same order. Image i keeps its first k_i picks.

    ``kernel`` "auto" or "fused" (CUDA, Triton, no NaN distance, N <= 16384): the steps of all images run in one
    launch (:mod:`care_core.kernels.divprune`) over the same distances, with the same rules, so the same orders.
    """
    sizes = [int(x.shape[0]) for x in embeddings]
    for n, k in zip(sizes, ks, strict=True):
        if k < 0 or (mask_selected and k > n):
            raise MethodError(f"divprune: cannot select {k} distinct tokens out of {n}")
    like = embeddings[0]
    b, n_max, steps = len(sizes), max(sizes), max(ks, default=0)
    dist = torch.full((b, n_max, n_max), float("-inf"), dtype=like.dtype, device=like.device)
    scores = torch.full((b, n_max), float("-inf"), dtype=like.dtype, device=like.device)
    selected = torch.ones(b, n_max, dtype=torch.bool, device=like.device)
    for i, (x, n) in enumerate(zip(embeddings, sizes, strict=True)):
        dist[i, :n, :n] = cosine_distance_matrix(x)
        scores[i, :n] = _first_scores(dist[i, :n, :n])
        selected[i, :n] = False
    fused = _fused_orders(dist, scores, sizes, steps, mask_selected, kernel)
    if fused is not None:
        return [fused[i, :k].clone() for i, k in enumerate(ks)]
    rows = torch.arange(b, device=like.device)
    order = torch.zeros(b, steps, dtype=torch.long, device=like.device)
    true = torch.ones((), dtype=torch.bool, device=like.device)  # a device value: `= True` would copy from the host
    for step in range(steps):
        chosen = torch.argmax(scores, dim=1)
        if mask_selected:  # argmax of a bool row: its first True, the lowest-index unselected token
            chosen = torch.where(selected[rows, chosen], torch.argmax((~selected).to(torch.uint8), dim=1), chosen)
        order[:, step] = chosen
        selected[rows, chosen] = true
        picked = dist[rows, chosen]  # (B, max N): row `chosen` of each image's matrix, -inf on padding
        scores = picked if step == 0 else torch.minimum(scores, picked)
    return [order[i, :k].clone() for i, k in enumerate(ks)]


def _fused_orders(dist: torch.Tensor, first: torch.Tensor, sizes: list[int], steps: int, mask_selected: bool,
                  kernel: Kernel | KernelGate) -> torch.Tensor | None:  # fmt: skip
    """(B, steps) orders from the fused kernel, or None where the loop runs: the "torch" setting, no CUDA or Triton,
    N above the kernel's limit, a NaN distance (the kernel's argmax and minimum do not order NaN as torch's do;
    one host read per call) or a kernel that cannot be built here ("auto")."""
    from care_core.kernels import dispatch
    from care_core.kernels.shapes import GREEDY_MAX_TOKENS

    gate = dispatch.as_gate(kernel)
    if gate.choose("divprune", dist.device) == "torch":
        return None
    applies = dist.shape[-1] <= GREEDY_MAX_TOKENS and not bool(torch.isnan(dist).any())
    if not applies:
        if gate.kernel == "fused":
            limit = GREEDY_MAX_TOKENS
            raise MethodError(f"divprune: kernel='fused' takes distances without NaN of at most {limit} tokens")
        return None
    counts = torch.tensor(sizes, dtype=torch.int32).to(dist.device, non_blocking=True)
    return gate.attempt("divprune", lambda: dispatch.divprune_orders(dist, first, counts, steps, mask_selected))


@register
@dataclass(frozen=True)
class DivPrune(Method):
    """DivPrune (Alvar et al., CVPR 2025): greedy max-min cosine diversity on the post-projector tokens.

    Keeps exactly ``keep`` tokens (the official K = round(ratio * N)), handed to the LLM in ascending index order.
    One documented deviation from the released code: an already selected token is never selected again (the
    official code can return duplicates once every remaining token duplicates a selected one); see the module
    docstring.
    """

    name: ClassVar[str] = "divprune"
    category: ClassVar[Category] = "selection"
    paper: ClassVar[str] = "Alvar et al., DivPrune: Diversity-based Visual Token Pruning for LMMs, CVPR 2025"
    rank: ClassVar[int] = 6
    cost_model: ClassVar[str | None] = "divprune"

    mask_selected: bool = True  # False = the released rule verbatim (duplicate indices possible)
    # the greedy's path on CUDA: "auto" = the fused kernel where it applies (design/batches.md §Batches), else the loop
    kernel: Kernel = "auto"

    def __post_init__(self) -> None:
        from care_core.kernels.dispatch import check_kernel

        check_kernel(self.kernel)

    def order_key(self, features: torch.Tensor) -> tuple[object, ...]:
        """Memo key of an image's selection order (:func:`~care_core.methods.base.memo_orders`): the mask rule and
        the compute dtype; the order for K is the first K of any longer one (step t reads only earlier picks)."""
        return ("divprune-order", self.mask_selected, compute_dtype(features.dtype))

    def reduce(self, inputs: MethodInputs, keep: int) -> MethodResult:
        return self.reduce_batch([inputs], [keep])[0]

    def reduce_batch(self, inputs: list[MethodInputs], keeps: list[int]) -> list[MethodResult]:
        """Each image's order from its memo where it holds one of at least K steps (no projector call, no
        distances); the others by :meth:`_orders`, at the longest budget planned for them where they keep a memo
        (:func:`~care_core.methods.base.memo_orders`)."""
        keys = [self.order_key(one.features) for one in inputs]
        orders = memo_orders(inputs, keeps, keys, lambda todo, ks: self._orders([inputs[i] for i in todo], ks))
        return [self._result(one, order, keep) for one, order, keep in zip(inputs, orders, keeps, strict=True)]

    def _orders(self, inputs: list[MethodInputs], keeps: list[int]) -> list[torch.Tensor]:
        """Selection orders of ``keeps[i]`` steps: each image's embeddings and distances alone (its own projector
        call), then one greedy loop for all (:func:`divprune_select_batch`); one image at a time where the
        embeddings differ in device or dtype or the padded distances would exceed :data:`JOINT_MAX_ENTRIES`."""
        from care_core.kernels.dispatch import choose_kernel

        with torch.no_grad():
            embeddings = [one.projector(one.features) for one in inputs]
            embeddings = [x.to(compute_dtype(x.dtype)) for x in embeddings]
            joint = len(embeddings) * max(x.shape[0] for x in embeddings) ** 2 <= JOINT_MAX_ENTRIES
            alike = len({(x.device, x.dtype) for x in embeddings}) == 1
            # one image too where the fused kernel may run (one launch); the kernels' rule decides ("fused" where it
            # cannot run is refused there)
            fused = choose_kernel(self.kernel, embeddings[0].device) == "fused"
            if (len(inputs) > 1 or fused) and joint and alike:
                return divprune_select_batch(embeddings, keeps, self.mask_selected, kernel=self.kernel)
            return [divprune_select(x, k, self.mask_selected) for x, k in zip(embeddings, keeps, strict=True)]

    def _result(self, inputs: MethodInputs, order: torch.Tensor, keep: int) -> MethodResult:
        if not self.mask_selected and order.unique().numel() < keep:
            raise MethodError("divprune(mask_selected=False) re-selected a token (official behaviour on duplicates)")
        return selection_result(inputs.features, order, None, selection_order=order, space="post-projector")
