"""LLaVA-PruMerge golden file: PruMerge and PruMerge+ (adaptive, the released forward) and fixed-budget PruMerge.

Every case runs :func:`prumerge_reduce` on the stored layer-23 q/k and layer -2 hidden state (CLS row dropped):
``prumerge_adaptive`` (``plus=False, adaptive=True``), ``prumergeplus_adaptive`` (``plus=True, adaptive=True``)
and ``prumerge_fixed_k{K}`` (``plus=False``, ``keep=K``: the official ``if_adaptive=False`` path with
``int(576 r_K) = K - 1``). The fixed-budget PruMerge+ rule of the registered ``prumerge+`` has no official
counterpart (the released non-adaptive PruMerge+ branch is training-only), so it has no golden case.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from care_core.methods.prumerge import prumerge_reduce
from scripts.golden_checks import CaseResult, compare

ATOL = 1e-5


def _case(name: str, out: object, data: dict[str, np.ndarray]) -> list[CaseResult]:
    note = f"outlier ratio {out.ratio:.4f}, {out.kept.numel()} kept"
    return [
        compare(f"{name} out_tokens", out.tokens.numpy(), data[f"{name}_out_tokens"], ATOL, note=note),
        compare(f"{name} kept_idx", out.kept.numpy(), data[f"{name}_kept_idx"]),
    ]


def check(data: dict[str, np.ndarray], filename: str) -> list[CaseResult]:
    q = torch.from_numpy(data["in_q_layer23"])
    k = torch.from_numpy(data["in_k_layer23"])
    patches = torch.from_numpy(data["in_hidden_layerm2"])[1:]
    results: list[CaseResult] = []
    if "prumerge_adaptive_out_tokens" in data:
        results += _case("prumerge_adaptive", prumerge_reduce(patches, q, k, plus=False, adaptive=True), data)
    if "prumergeplus_adaptive_out_tokens" in data:
        results += _case("prumergeplus_adaptive", prumerge_reduce(patches, q, k, plus=True, adaptive=True), data)
    budgets = sorted({int(m.group(1)) for key in data if (m := re.match(r"prumerge_fixed_k(\d+)_out_tokens$", key))})
    for budget in budgets:
        out = prumerge_reduce(patches, q, k, plus=False, adaptive=False, keep=budget)
        results += _case(f"prumerge_fixed_k{budget}", out, data)
    return results
