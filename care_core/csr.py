"""Calibrated Semantic Retention (paper Supp. A): how much question-relevant meaning survives reduction.

The full-sequence part (unit tokens and relevance weights) depends only on the image and the
question, so it is computed once (:func:`csr_reference`) and reused for every method and budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from care_core.anchors import unit_rows
from care_core.precision import matmul_precision

_NORM_EPS = 1e-12


@dataclass(frozen=True)
class CSRReference:
    """Unit full-sequence tokens and their question-relevance weights w (Supp. A)."""

    full_unit: torch.Tensor  # (N, d_t) L2-normalised projected tokens
    weights: torch.Tensor  # (N,) w_i = r_i / sum r, or uniform 1/N when sum r = 0

    @cached_property  # a host sync: once per reference, not once per method and budget that reads it
    def uniform(self) -> bool:
        """True when no token had positive relevance and the weights fell back to 1/N."""
        return bool(torch.all(self.weights == self.weights[0]))


def _dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def csr_reference(full_projected: torch.Tensor, question_embeds: torch.Tensor) -> CSRReference:
    """r_i = max_l [v_i . t_l]_+ on unit vectors, w = r / sum r (uniform if sum r = 0)."""
    dtype = _dtype(full_projected)
    with matmul_precision(allow_tf32=False):
        full = unit_rows(full_projected.to(dtype), _NORM_EPS)
        question = unit_rows(question_embeds.to(device=full.device, dtype=dtype), _NORM_EPS)
        relevance = (full @ question.T).clamp_min(0).amax(dim=1)
    total = relevance.sum()
    weights = relevance / total if total > 0 else torch.full_like(relevance, 1 / relevance.numel())
    return CSRReference(full, weights)


def csr_tensor_from_reference(reference: CSRReference, reduced_projected: torch.Tensor) -> torch.Tensor:
    """CSR = sum_i w_i c_i with c_i = max_j [v_i . s_j]_+ over the unit reduced tokens s_j, as a 0-dim tensor on
    the reference's device and dtype: no host sync, so that a caller can read many at once (one ``.tolist()``)."""
    full = reference.full_unit
    with matmul_precision(allow_tf32=False):
        reduced = unit_rows(reduced_projected.to(device=full.device, dtype=full.dtype), _NORM_EPS)
        coverage = (full @ reduced.T).clamp_min(0).amax(dim=1)
    return (reference.weights * coverage).sum().clamp(0, 1)


def csr_from_reference(reference: CSRReference, reduced_projected: torch.Tensor) -> float:
    """:func:`csr_tensor_from_reference` as a float (one host sync)."""
    return float(csr_tensor_from_reference(reference, reduced_projected))


def csr_score(full_projected: torch.Tensor, reduced_projected: torch.Tensor, question_embeds: torch.Tensor) -> float:
    """CSR in [0, 1] (report 100 x CSR) of K reduced tokens against the N full tokens (Supp. A).

    All inputs live in the language model's space: the full tokens and the reduced tokens through
    the same projector, and the question's input embeddings. No method-specific score enters.
    """
    return csr_from_reference(csr_reference(full_projected, question_embeds), reduced_projected)
