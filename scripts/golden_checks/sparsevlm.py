"""SparseVLM golden files: ``sparsevlm_select_*`` (official ``attn_postprocess_topk`` / ``select_attn_head_by_sum``
at layer 2) and ``sparsevlm_cluster_*`` (official ``cluster_and_merge``), see tests/data/golden/README.md.

select: the attention block is written into a zero (H, 635, 635) attention as the README says, the raters are the
stored positions + 611, and for every version and budget the relevance, the heads kept (v2) and the layer-2 keep
mask of :func:`care_core.methods.sparsevlm.first_stage_mask` are compared. cluster: ``cluster_and_merge`` on the
stored tokens (density noise from ``torch.manual_seed(7003)`` as in the official run).
"""

from __future__ import annotations

import numpy as np
import torch

from care_core.methods.sparsevlm import cluster_and_merge, first_stage_mask, rater_relevance
from scripts.golden_checks import CaseResult, compare

V_START, TEXT_START = 35, 611


def _check_select(data: dict[str, np.ndarray]) -> list[CaseResult]:
    block = torch.from_numpy(data["in_attn_text_rows_visual_cols"])
    heads, text, n = block.shape
    attention = torch.zeros(heads, TEXT_START + text, TEXT_START + text)
    attention[:, TEXT_START:, V_START : V_START + n] = block
    raters = torch.from_numpy(data["in_rater_positions"]) + TEXT_START
    results: list[CaseResult] = []
    for key in sorted(k for k in data if k.endswith("_layer2_mask")):
        version, budget = key[1:4], int(key.split("_")[2][1:])
        relevance, kept_heads = rater_relevance(attention, (V_START, V_START + n), raters, version)  # type: ignore[arg-type]
        prefix = f"v{version}_k{budget}"
        results.append(compare(f"{prefix} layer2_relation", relevance.numpy(), data[f"{prefix}_layer2_relation"]))
        if kept_heads is not None:
            results.append(compare(f"{prefix} heads_kept", kept_heads.numpy(), data[f"{prefix}_heads_kept"]))
        mask = first_stage_mask(relevance, budget, version).long().numpy()  # type: ignore[arg-type]
        results.append(compare(f"{prefix} layer2_mask", mask, data[key], note=f"{int(mask.sum())} kept"))
    return results


def _check_cluster(data: dict[str, np.ndarray]) -> list[CaseResult]:
    x = torch.from_numpy(data["in_x"])
    expected = data["out_merged"]
    with torch.random.fork_rng():
        torch.manual_seed(7003)
        noise = torch.rand(x.shape[0]) * 1e-6
    merged, _, _ = cluster_and_merge(x, expected.shape[0], noise)
    return [compare(f"cluster_num={expected.shape[0]} out_merged", merged.numpy(), expected, atol=1e-6)]


def check(data: dict[str, np.ndarray], filename: str) -> list[CaseResult]:
    if "in_attn_text_rows_visual_cols" in data:
        return _check_select(data)
    if "out_merged" in data:
        return _check_cluster(data)
    return [CaseResult(filename, False, float("nan"), "unknown sparsevlm golden layout")]
