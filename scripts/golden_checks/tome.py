"""ToMe golden files: one official call (``tome_single_*``) and the harness chain (``tome_chain_*``).

Single: :func:`bipartite_soft_matching` with ``class_token=True`` for every stored ``r``, then ``merge_wavg``
(tokens, sizes), the source map (output row of each input), ``merge(mode="mean")`` and, where stored, ``unmerge``.
Chain: :func:`tome_chain` for every stored budget ``K``.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from care_core.methods.tome import bipartite_soft_matching, merge_wavg, tome_chain
from scripts.golden_checks import CaseResult, compare

ATOL = 1e-5


def _keys(data: dict[str, np.ndarray], pattern: str) -> list[int]:
    return sorted({int(m.group(1)) for k in data if (m := re.match(pattern, k))})


def _check_single(data: dict[str, np.ndarray]) -> list[CaseResult]:
    x = torch.from_numpy(data["in_x"])
    metric = torch.from_numpy(data["in_metric"])
    results = []
    for r in _keys(data, r"r(\d+)_out_x_wavg$"):
        match = bipartite_soft_matching(metric, r, class_token=True)
        merged, size = merge_wavg(match, x)
        results.append(compare(f"r{r} out_x_wavg", merged.numpy(), data[f"r{r}_out_x_wavg"], ATOL))
        results.append(compare(f"r{r} out_size", size[:, 0].numpy(), data[f"r{r}_out_size"], ATOL))
        results.append(
            compare(f"r{r} out_group_of_input", match.row_of_input().numpy(), data[f"r{r}_out_group_of_input"])
        )
        mean = match.merge(x, mode="mean")
        results.append(compare(f"r{r} out_x_mergemean", mean.numpy(), data[f"r{r}_out_x_mergemean"], ATOL))
        if f"r{r}_unmerge_of_out" in data:
            back = match.unmerge(torch.from_numpy(data[f"r{r}_out_x_wavg"]))
            results.append(compare(f"r{r} unmerge_of_out", back.numpy(), data[f"r{r}_unmerge_of_out"], ATOL))
    return results


def _check_chain(data: dict[str, np.ndarray]) -> list[CaseResult]:
    x = torch.from_numpy(data["in_x"])
    results = []
    for k in _keys(data, r"k(\d+)_out_x$"):
        chain = tome_chain(x, k)
        steps = "->".join(map(str, chain.steps))
        results.append(compare(f"k{k} out_x", chain.tokens.numpy(), data[f"k{k}_out_x"], ATOL, note=steps))
        results.append(compare(f"k{k} out_size", chain.size.numpy(), data[f"k{k}_out_size"], ATOL))
        results.append(compare(f"k{k} out_group_of_input", chain.group.numpy(), data[f"k{k}_out_group_of_input"]))
    return results


def check(data: dict[str, np.ndarray], filename: str) -> list[CaseResult]:
    return _check_single(data) if "in_metric" in data else _check_chain(data)
