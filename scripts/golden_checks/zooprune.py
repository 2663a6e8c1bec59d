"""ZOO-Prune golden files: ``zooprune_*`` (SADS selection, transcribed official ``select_tokens_sads``).

Per budget K: ``k{K}_selected_order``, ``k{K}_kept_sorted`` and ``k{K}_out_tokens`` against
:func:`care_core.methods.zoo_prune.sads_select` on the stored features (post-projector in the official call) and raw
importance (min-max normalised inside, the ``ones`` branch for constant scores).
"""

from __future__ import annotations

import numpy as np
import torch

from care_core.methods.zoo_prune import sads_select
from scripts.golden_checks import CaseResult, compare


def check(data: dict[str, np.ndarray], filename: str) -> list[CaseResult]:
    features = torch.from_numpy(data["in_features"])
    importance = torch.from_numpy(data["in_importance"])
    budgets = sorted(int(key[1:].split("_")[0]) for key in data if key.endswith("_selected_order"))
    results: list[CaseResult] = []
    for k in budgets:
        ours = sads_select(features, importance, k).numpy()
        results.append(compare(f"k{k} selected_order", ours, data[f"k{k}_selected_order"]))
        kept = np.sort(ours)
        results.append(compare(f"k{k} kept_sorted", kept, data[f"k{k}_kept_sorted"]))
        results.append(compare(f"k{k} out_tokens", features.numpy()[kept], data[f"k{k}_out_tokens"]))
    return results
