"""VisionZip (Yang et al., "VisionZip: Longer is Better but Not Necessary in Vision Language Models", CVPR 2025).

Official code: dvlab-research/VisionZip @ 3151f6d, ``visionzip/clip_encoder.py::CLIPVisionTower_VisionZip.forward``
with the patched CLIP attention (head-mean keys stored as ``metric``), entry point ``visionzip(model, dominant,
contextual)``. Everything it reads comes from the vision tower's penultimate layer (LLaVA's feature layer -2):
the softmax attention ``A`` (H, T, T), the hidden state ``X`` (T, d) with CLS in row 0, and the head-mean keys
``k`` (T, d_head) of that same layer. :func:`visionzip_reduce` reproduces the released forward:

1. dominant: ``s_j = sum_h A[h, 0, j]`` over patch tokens; the top ``D - 1`` by ``torch.topk`` plus CLS
   (``all_indices = [0, top tokens in descending score]``); the dominant rows are emitted in ascending token
   order, CLS first;
2. contextual: the ``R = T - D`` other tokens in token order, keys L2-normalised; targets are the R-positions
   ``0, s, 2s, ...`` (first ``C``), ``s = max(1, R // C)``; every other token goes to its most cosine-similar
   target (``argmax``, first on ties); contextual row ``c = X[target_c] + mean(X[assigned to c])`` (the mean is
   0 when nothing is assigned; the target itself has weight 1 and is not part of the mean);
3. output = ``[D dominant rows incl. CLS] ++ [C contextual rows]``, pre-projector.

Budget split (registered method, option ``dominant_fraction``): ``D = round_half_up(keep * 54 / 64)`` (clamped to
``[1, keep]``), ``C = keep - D``. The official repository only shows ``visionzip(dominant=54, contextual=10)``;
third-party ports attribute 108/20 and 162/30 to the paper for 128/192 tokens — the 54:10 ratio reproduces all
three exactly. An explicit ``dominant`` overrides the ratio (``contextual`` is then ``keep - dominant``), e.g.
``dominant=6`` reproduces the golden ``visionzip(6, 2)`` at ``keep = 8`` where the ratio rule gives 7 + 1.

The output includes the CLS row (``token_index = -1``), exactly like the official code, so ``keep`` rows are
``D`` dominant (CLS + ``D - 1`` patches) and ``C`` contextual ones. Deviation: zero key vectors (NaN in the
official normalisation) are normalised with a clamped norm, i.e. they stay zero and have cosine 0 to every target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from care_core._lazy import torch
from care_core.errors import MethodError
from care_core.methods.base import Category, Method, MethodInputs, MethodResult
from care_core.methods.lazy_precision import compute_dtype, matmul_precision
from care_core.methods.registry import register
from care_core.vocabulary import Trait

_EPS = 1e-12  # clamps zero key norms only; any non-zero norm is used as the official code does


@dataclass(frozen=True)
class VisionZipOutput:
    """Result of :func:`visionzip_reduce` (token indices count CLS as 0, patch p as p + 1)."""

    tokens: torch.Tensor  # (D + C, d): dominant rows (CLS first, ascending), then contextual rows
    all_indices: torch.Tensor  # (D,) official second return: [0, top tokens in descending score]
    dominant_sorted: torch.Tensor  # (D,) ascending token indices of the dominant rows
    targets: torch.Tensor  # (C,) token index of each contextual row's target
    assignment: torch.Tensor  # (T,) output row each token went to (-1 = none, only when C = 0)
    scores: torch.Tensor  # (T - 1,) head-summed CLS attention of each patch


def dominant_split(keep: int, fraction: float = 54 / 64) -> tuple[int, int]:
    """(D, C) with D = round_half_up(keep * fraction) clamped to [1, keep] and C = keep - D (54:10 at 64)."""
    dominant = min(max(math.floor(keep * fraction + 0.5), 1), keep)
    return dominant, keep - dominant


def visionzip_reduce(
    hidden: torch.Tensor, cls_attention: torch.Tensor, keys: torch.Tensor, dominant: int, contextual: int
) -> VisionZipOutput:
    """VisionZip on one image: `hidden` (T, d), `cls_attention` (H, T) softmax CLS rows, `keys` (T, d_head).

    ``dominant`` counts CLS (the official ``visionzip(dominant, contextual)`` arguments).
    """
    t = hidden.shape[0]
    if not 1 <= dominant <= t or contextual < 0 or dominant + contextual > t:
        raise MethodError(f"visionzip: cannot keep {dominant} dominant + {contextual} contextual of {t} tokens")
    device = hidden.device
    scores = cls_attention[:, 1:].sum(dim=0)  # (T - 1,) sum over heads of the CLS row, patches only
    top = torch.topk(scores, dominant - 1).indices + 1  # token indices, descending score
    all_indices = torch.cat([torch.zeros(1, dtype=torch.long, device=device), top])
    is_dominant = torch.zeros(t, dtype=torch.bool, device=device)
    is_dominant[all_indices] = True
    dominant_sorted = is_dominant.nonzero().flatten()
    rest = (~is_dominant).nonzero().flatten()  # remaining tokens in token order
    assignment = torch.full((t,), -1, dtype=torch.long, device=device)
    assignment[dominant_sorted] = torch.arange(dominant, device=device)
    rows = [hidden[dominant_sorted]]
    targets = torch.empty(0, dtype=torch.long, device=device)
    if contextual > 0:
        r = rest.numel()
        step = max(1, r // contextual)
        target_pos = torch.arange(0, r, step, device=device)[:contextual]
        is_target = torch.zeros(r, dtype=torch.bool, device=device)
        is_target[target_pos] = True
        other_pos = (~is_target).nonzero().flatten()
        k = keys[rest].to(compute_dtype(keys.dtype))
        k = k / k.norm(dim=-1, keepdim=True).clamp_min(_EPS)
        with matmul_precision(allow_tf32=False):
            similarity = k[other_pos] @ k[target_pos].t()  # (R - C, C) cosine
        choice = similarity.argmax(dim=1)  # first index on ties
        one_hot = torch.zeros(contextual, other_pos.numel(), dtype=hidden.dtype, device=device)
        one_hot[choice, torch.arange(other_pos.numel(), device=device)] = 1
        counts = one_hot.sum(dim=1, keepdim=True).clamp_min(1)
        x_rest = hidden[rest]
        with matmul_precision(allow_tf32=False):
            merged = (one_hot @ x_rest[other_pos]) / counts
        rows.append(x_rest[target_pos] + merged)
        targets = rest[target_pos]
        assignment[targets] = dominant + torch.arange(contextual, device=device)
        assignment[rest[other_pos]] = dominant + choice
    return VisionZipOutput(torch.cat(rows), all_indices, dominant_sorted, targets, assignment, scores)


@register
@dataclass(frozen=True)
class VisionZip(Method):
    """VisionZip (Yang et al., CVPR 2025): CLS-attention dominant tokens + key-similarity contextual merging.

    Runs on the feature layer's CLS attention, head-mean keys and hidden states (CLS included); ``keep`` rows =
    ``D`` dominant (CLS + ``D - 1`` top patches, ascending) + ``C`` contextual, with ``D = round(keep * 54/64)``
    unless ``dominant`` is given. The CLS row has ``token_index`` -1; contextual rows carry their target's patch.
    """

    name: ClassVar[str] = "visionzip"
    category: ClassVar[Category] = "merging"
    needs: ClassVar[frozenset[str]] = frozenset({"cls_attention", "keys", "hidden_with_cls"})
    paper: ClassVar[str] = "Yang et al., VisionZip: Longer is Better but Not Necessary in VLMs, CVPR 2025"
    rank: ClassVar[int] = 7
    cost_model: ClassVar[str | None] = "visionzip"
    requires: ClassVar[frozenset[Trait]] = frozenset({"cls_token"})  # reads CLS attention

    dominant_fraction: float = field(default=54 / 64)  # D = round_half_up(keep * fraction), CLS included
    dominant: int | None = None  # explicit D (CLS included); contextual = keep - dominant

    def split(self, keep: int) -> tuple[int, int]:
        """(dominant incl. CLS, contextual) for budget `keep`."""
        if self.dominant is not None:
            if not 1 <= self.dominant <= keep:
                raise MethodError(f"visionzip: dominant={self.dominant} must be between 1 and keep={keep}")
            return self.dominant, keep - self.dominant
        return dominant_split(keep, self.dominant_fraction)

    def reduce(self, inputs: MethodInputs, keep: int) -> MethodResult:
        n = inputs.num_tokens
        hidden = inputs.probe("hidden_with_cls", self.name)
        attention = inputs.probe("cls_attention", self.name)
        keys = inputs.probe("keys", self.name)
        if hidden.shape[0] != n + 1 or keys.shape[0] != n + 1 or attention.shape[-1] != n + 1:
            raise MethodError(
                f"visionzip: hidden_with_cls {tuple(hidden.shape)}, keys {tuple(keys.shape)} and cls_attention "
                f"{tuple(attention.shape)} must all cover 1 + N = {n + 1} tokens"
            )
        dominant, contextual = self.split(keep)
        with torch.no_grad():
            out = visionzip_reduce(hidden, attention.to(compute_dtype(attention.dtype)), keys, dominant, contextual)
        token_index = torch.cat([out.dominant_sorted, out.targets]) - 1  # CLS (token 0) -> -1
        return MethodResult(
            tokens=out.tokens.to(inputs.features.dtype),
            token_index=token_index,
            scores=out.scores,
            assignment=out.assignment[1:],
            info={"all_indices": out.all_indices, "dominant": dominant, "contextual": contextual},
        )
