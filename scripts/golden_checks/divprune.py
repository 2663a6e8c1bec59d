"""DivPrune golden files: ``divprune_*`` (official ``LlavaMetaForCausalLM.DivPrune``, see tests/data/golden/README.md).

Per budget K: the official greedy order (``k{K}_selected_order``), its sorted form (``k{K}_kept_sorted``) and the
rows (``k{K}_out_tokens``) against :func:`care_core.methods.divprune.divprune_select` with the released rule, and
against the registered ``divprune`` method (identity projector: the stored features are post-projector already).

``divprune_dup_*`` is a behaviour record (the re-selected index rests on float rounding), so it is checked for the
behaviour, not bit for bit: the distinct prefix of the official order, that the rest re-selects already chosen
tokens (ours too), the distinct kept set, and that the registered method replaces each re-selection by the
lowest-index unselected token (its one documented deviation).
"""

from __future__ import annotations

import numpy as np
import torch

from care_core.methods import MethodInputs, build_method
from care_core.methods.divprune import divprune_select
from scripts.golden_checks import CaseResult, compare


def _budgets(data: dict[str, np.ndarray]) -> list[int]:
    return sorted(int(key[1:].split("_")[0]) for key in data if key.endswith("_selected_order"))


def _registered(features: torch.Tensor, keep: int) -> torch.Tensor:
    n = features.shape[0]
    inputs = MethodInputs(features, lambda x: x, torch.zeros(n, 2))
    return build_method("divprune")(inputs, keep).token_index


def _distinct_prefix(order: np.ndarray) -> int:
    seen: set[int] = set()
    for i, idx in enumerate(order.tolist()):
        if idx in seen:
            return i
        seen.add(idx)
    return len(order)


def check(data: dict[str, np.ndarray], filename: str) -> list[CaseResult]:
    features = torch.from_numpy(data["in_features"])
    results: list[CaseResult] = []
    behaviour = filename.startswith("divprune_dup")
    for k in _budgets(data):
        expected = data[f"k{k}_selected_order"]
        ours = divprune_select(features, k).numpy()
        if not behaviour:
            results.append(compare(f"k{k} selected_order", ours, expected))
            kept = np.sort(ours)
            results.append(compare(f"k{k} kept_sorted", kept, data[f"k{k}_kept_sorted"]))
            results.append(compare(f"k{k} out_tokens", features.numpy()[kept], data[f"k{k}_out_tokens"]))
            registered = _registered(features, k).numpy()
            results.append(compare(f"k{k} registered kept", registered, data[f"k{k}_kept_sorted"]))
            continue
        note = "behaviour record, not bit-exact"
        p = _distinct_prefix(expected)
        results.append(compare(f"k{k} distinct prefix ({p} of {k})", ours[:p], expected[:p], note=note))
        reselects = bool(np.isin(ours[p:], ours[:p]).all() and np.isin(expected[p:], expected[:p]).all())
        exact = "identical" if np.array_equal(ours, expected) else f"ours {ours[p:].tolist()}"
        results.append(
            CaseResult(
                f"k{k} tail re-selects chosen tokens",
                reselects,
                0.0 if reselects else float("nan"),
                f"{note}; official tail {expected[p:].tolist()}, {exact}",
            )
        )
        distinct = np.unique(expected)
        results.append(compare(f"k{k} distinct kept set", np.unique(ours), distinct, note=note))
        results.append(
            compare(
                f"k{k} distinct out_tokens",
                features.numpy()[distinct],
                data[f"k{k}_out_tokens"][np.unique(data[f"k{k}_kept_sorted"], return_index=True)[1]],
                note=note,
            )
        )
        registered = _registered(features, k).numpy()
        unselected = np.setdiff1d(np.arange(features.shape[0]), expected[:p])
        want = np.sort(np.concatenate([expected[:p], unselected[: k - p]]))
        results.append(
            compare(
                f"k{k} registered (re-selection -> lowest unselected)", registered, want, note="documented deviation"
            )
        )
    return results
