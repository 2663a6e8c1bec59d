"""LLaVA-PruMerge (Shang et al., "LLaVA-PruMerge: Adaptive Token Reduction for Efficient LMMs", ICCV 2025).

Official code: 42Shawn/LLaVA-PruMerge @ 097c041, ``llava/model/multimodal_encoder/clip_encoder.py``:
``CLIPVisionTower.token_prune_merge_advanced`` (PruMerge) and ``token_prune_merge_advanced_plus`` (PruMerge+, what
the repository's ``forward`` calls). Inputs: the hooked ``q_proj`` / ``k_proj`` outputs of the vision tower's last
layer (full width, heads not split, bias included) and the feature-layer patches ``X`` (``hidden_states[-2]``,
CLS dropped). :func:`prumerge_reduce` reproduces both:

1. ``a = softmax(q k^T / sqrt(C))[CLS, patches]`` (single head, C = feature width, softmax over CLS + patches);
2. adaptive ratio ``rho`` = fraction of ``a`` above ``Q3 + 1.5 IQR`` (numpy percentiles, paper Sec. 3.2, IQR
   outlier detection); the kept tokens are the top ``int(N * rho)`` by ``a``, in descending order;
3. PruMerge+ (adaptive) appends the grid patches ``0, t, 2t, ... < 575`` with ``t = int(int(1 / rho) / 3)`` that
   are not kept yet (``575`` is hard-coded in the official code; here ``N - 1``, the same for N = 576);
4. merging (paper Sec. 3.3): for each kept token i, the cosine similarity of its last-layer key with the keys of all
   other patches (kept and pruned) picks its 32 nearest; ``x_i <- x_i + sum_j a_j x_j`` over them (raw attention
   weights, not normalised);
5. one extra row ``sum_{pruned j} a_j x_j`` is appended: output = kept + 1 rows, pre-projector.

Budgets. The official count is adaptive (data-dependent). The registered methods use a fixed-budget mode that
returns exactly ``keep`` rows: ``keep - 1`` kept patches + the summary row, like the official ``if_adaptive=False``
path of PruMerge (which keeps ``int(N * reduction_ratio)``):

* ``prumerge`` (``plus=False``): the top ``keep - 1`` patches by ``a`` — identical to the official
  ``token_prune_merge_advanced(if_adaptive=False, reduction_ratio=r)`` with ``int(N r) = keep - 1``;
* ``prumerge+`` (``plus=True``, default): the official non-adaptive PruMerge+ branch is training-only (it appends
  an unfiltered grid, duplicates possible), so the fixed budget is our rule: the top ``min(int(N * rho), keep - 1)``
  patches by ``a`` (the adaptive outlier set, as in the released forward), then the remaining slots are filled with
  patches spread evenly in raster order over the patches not yet kept (``comp[floor(i * |comp| / g)]``,
  ``i < g``), which plays the role of the official spatial grid.

``adaptive=True`` reproduces the released adaptive paths exactly (output count = kept + 1, ``keep`` ignored;
``output_count`` then raises because the count is only known after the call).

Row order is the official one (top patches in descending attention, then grid patches ascending, then the summary
row, ``token_index`` -1). ``assignment`` sends each kept patch to its row and each pruned patch to the summary
row (which is the only row every pruned token reaches). Deviations: zero key vectors use a clamped norm (already
so in the official ``F.normalize``); ties between equal cosine similarities or attentions are broken by
``torch.topk`` on our candidate order (kept in order, then pruned ascending — the official order too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from care_core._lazy import torch
from care_core.errors import MethodError
from care_core.methods.base import Category, Method, MethodInputs, MethodResult
from care_core.methods.lazy_precision import compute_dtype, matmul_precision
from care_core.methods.registry import register
from care_core.vocabulary import Trait

_EPS = 1e-12  # F.normalize's clamp


def cls_attention_from_qk(q: torch.Tensor, k: torch.Tensor, width: int) -> torch.Tensor:
    """(N,) ``softmax(q_cls k^T * width**-0.5)`` restricted to the patch columns (q, k: (1+N, C))."""
    logits = (q[:1] @ k.t()) * width**-0.5
    return torch.softmax(logits, dim=-1)[0, 1:]


def outlier_ratio(attention: torch.Tensor) -> float:
    """Fraction of entries above ``Q3 + 1.5 IQR`` (numpy percentiles on float32, as the official code)."""
    values = attention.detach().to(dtype=torch.float32).cpu().numpy().flatten()
    q1 = np.percentile(values, 25)
    q3 = np.percentile(values, 75)
    upper = q3 + 1.5 * (q3 - q1)
    return int(np.count_nonzero(values > upper)) / len(values)


def spread_fill(exclude: torch.Tensor, n: int, count: int) -> torch.Tensor:
    """`count` patches spread evenly in raster order over 0..n-1 minus `exclude` (ascending)."""
    free = torch.ones(n, dtype=torch.bool, device=exclude.device)
    free[exclude] = False
    comp = free.nonzero().flatten()
    if count <= 0:
        return comp[:0]
    pick = (torch.arange(count, device=exclude.device) * comp.numel()) // count
    return comp[pick]


def official_grid(kept: torch.Tensor, ratio: float, n: int) -> torch.Tensor:
    """Released PruMerge+ grid: ``0, t, 2t, ... < n - 1`` with ``t = int(int(1 / ratio) / 3)``, minus `kept`."""
    if ratio <= 0:
        raise MethodError("prumerge+: the adaptive ratio is 0 (no outliers); the official grid step is undefined")
    step = int(int(1 / ratio) / 3)
    if step <= 0:
        raise MethodError(f"prumerge+: adaptive ratio {ratio:.3f} gives grid step 0 (official code fails too)")
    grid = torch.arange(0, n - 1, step, device=kept.device)
    return grid[~torch.isin(grid, kept)]


@dataclass(frozen=True)
class PruMergeOutput:
    """Result of :func:`prumerge_reduce` (patch indices 0..N-1)."""

    tokens: torch.Tensor  # (m + 1, d): merged kept rows in `kept` order, then the summary row
    kept: torch.Tensor  # (m,) kept patch indices in output order
    attention: torch.Tensor  # (N,) CLS attention a
    ratio: float  # the IQR outlier ratio rho


def prumerge_reduce(
    patches: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    plus: bool = True,
    adaptive: bool = False,
    keep: int | None = None,
    neighbours: int = 32,
) -> PruMergeOutput:
    """PruMerge / PruMerge+ on one image: `patches` (N, d) feature-layer patches, `q`, `k` (1+N, C) last-layer
    q_proj / k_proj outputs. ``adaptive=True``: the released adaptive count; else ``keep - 1`` kept patches."""
    n, width = patches.shape
    a = cls_attention_from_qk(q, k, width)
    ratio = outlier_ratio(a)
    if adaptive:
        top = torch.topk(a, int(n * ratio)).indices
        kept = torch.cat([top, official_grid(top, ratio, n)]) if plus else top
    else:
        if keep is None or not 1 <= keep <= n + 1:
            raise MethodError(f"prumerge: keep must be between 1 and N + 1 = {n + 1}, got {keep}")
        m = keep - 1
        top = torch.topk(a, min(int(n * ratio), m) if plus else m).indices
        kept = torch.cat([top, spread_fill(top, n, m - top.numel())]) if plus else top
    pruned_mask = torch.ones(n, dtype=torch.bool, device=patches.device)
    pruned_mask[kept] = False
    pruned = pruned_mask.nonzero().flatten()
    # candidates of kept token i: the other kept tokens (in kept order), then the pruned ones (ascending)
    candidates = torch.cat([kept, pruned])
    keys = k[1:].to(compute_dtype(k.dtype))
    keys = keys / keys.norm(dim=-1, keepdim=True).clamp_min(_EPS)
    m = kept.numel()
    rows = [patches[kept]]
    if m > 0:
        with matmul_precision(allow_tf32=False):
            similarity = keys[kept] @ keys[candidates].t()  # (m, m + |pruned|)
        similarity[torch.arange(m), torch.arange(m)] = -torch.inf  # exclude itself
        count = min(neighbours, n - 1)
        nearest = candidates[torch.topk(similarity, count, dim=1).indices]  # (m, count) patch indices
        weighted = (patches[nearest] * a[nearest].unsqueeze(-1).to(patches.dtype)).sum(dim=1)
        rows = [patches[kept] + weighted]
    summary = (patches[pruned] * a[pruned].unsqueeze(-1).to(patches.dtype)).sum(dim=0, keepdim=True)
    return PruMergeOutput(torch.cat([*rows, summary]), kept, a, ratio)


@register
@dataclass(frozen=True)
class PruMergePlus(Method):
    """LLaVA-PruMerge+ (Shang et al., ICCV 2025): CLS-attention outliers + spatial fill, key-similarity merging.

    Fixed budget: ``keep - 1`` kept patches (IQR-outlier top patches, the rest spread evenly over the image) each
    merged with its 32 key-nearest patches weighted by CLS attention, plus one summary row of all pruned patches.
    ``plus=False`` is plain PruMerge (top ``keep - 1`` by attention); ``adaptive=True`` the released adaptive count.
    """

    name: ClassVar[str] = "prumerge+"
    category: ClassVar[Category] = "merging"
    needs: ClassVar[frozenset[str]] = frozenset({"last_layer_qk"})
    paper: ClassVar[str] = "Shang et al., LLaVA-PruMerge: Adaptive Token Reduction for Efficient LMMs, ICCV 2025"
    rank: ClassVar[int] = 8
    cost_model: ClassVar[str | None] = "prumerge+"
    requires: ClassVar[frozenset[Trait]] = frozenset({"cls_token"})  # reads the CLS row of the last layer

    plus: bool = True  # PruMerge+ (spatial fill); False = PruMerge
    adaptive: bool = False  # True = the released adaptive token count (keep ignored)
    neighbours: int = 32  # nearest keys merged into every kept token (official 32)

    def output_count(self, num_tokens: int, keep: int) -> int:
        if self.adaptive:
            raise MethodError(f"{self.name}(adaptive=True): the output count is data-dependent (kept + 1)")
        return keep

    def reduce(self, inputs: MethodInputs, keep: int) -> MethodResult:
        n = inputs.num_tokens
        qk = inputs.probe("last_layer_qk", self.name)
        if qk.shape[0] != 2 or qk.shape[1] != n + 1:
            raise MethodError(f"{self.name}: last_layer_qk must be (2, 1 + N = {n + 1}, C), got {tuple(qk.shape)}")
        x = inputs.features
        with torch.no_grad():
            out = prumerge_reduce(
                x.to(compute_dtype(x.dtype)),
                qk[0].to(compute_dtype(qk.dtype)),
                qk[1].to(compute_dtype(qk.dtype)),
                plus=self.plus,
                adaptive=self.adaptive,
                keep=keep,
                neighbours=self.neighbours,
            )
        m = out.kept.numel()
        assignment = torch.full((n,), m, dtype=torch.long, device=x.device)  # pruned -> summary row
        assignment[out.kept] = torch.arange(m, device=x.device)
        token_index = torch.cat([out.kept, torch.full((1,), -1, dtype=torch.long, device=x.device)])
        return MethodResult(
            tokens=out.tokens.to(x.dtype),
            token_index=token_index,
            scores=out.attention,
            assignment=assignment,
            info={"outlier_ratio": out.ratio, "kept_order": out.kept},
        )


@register
@dataclass(frozen=True)
class PruMerge(PruMergePlus):
    """LLaVA-PruMerge (Shang et al., ICCV 2025): top CLS-attention patches merged with their key-nearest patches.

    Fixed budget: the top ``keep - 1`` patches by last-layer CLS attention + one summary row of the pruned ones
    (the official ``if_adaptive=False`` path). Same as ``prumerge+`` with ``plus=False``.
    """

    name: ClassVar[str] = "prumerge"
    rank: ClassVar[int] = 9
    cost_model: ClassVar[str | None] = "prumerge"
    plus: bool = False
