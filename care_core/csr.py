"""Calibrated Semantic Retention (paper Supp. A): how much question-relevant meaning survives reduction."""

from __future__ import annotations

import torch

from care_core.anchors import unit_rows
from care_core.precision import matmul_precision


def csr_score(full_projected: torch.Tensor, reduced_projected: torch.Tensor, question_embeds: torch.Tensor) -> float:
    """CSR = sum_i w_i c_i in [0, 1]; report 100 x CSR.

    All three inputs are L2-normalised rows in the language model's space: the N full visual
    tokens, the K reduced tokens (both through the same projector), the T question embeddings.
    r_i = max_l [v_i . t_l]_+ (relevance), w = r / sum r (uniform if sum r = 0),
    c_i = max_j [v_i . s_j]_+ (coverage).
    """
    with matmul_precision(allow_tf32=False):
        return _csr(full_projected, reduced_projected, question_embeds)


def _csr(full_projected: torch.Tensor, reduced_projected: torch.Tensor, question_embeds: torch.Tensor) -> float:
    dtype = torch.float64 if full_projected.dtype == torch.float64 else torch.float32
    full = unit_rows(full_projected.to(dtype), 1e-12)
    reduced = unit_rows(reduced_projected.to(dtype), 1e-12)
    question = unit_rows(question_embeds.to(dtype), 1e-12)
    relevance = (full @ question.T).clamp_min(0).amax(dim=1)
    total = relevance.sum()
    weights = relevance / total if total > 0 else torch.full_like(relevance, 1 / relevance.numel())
    coverage = (full @ reduced.T).clamp_min(0).amax(dim=1)
    return float((weights * coverage).sum().clamp(0, 1))
