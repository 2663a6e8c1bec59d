"""scripts/train_demo.py's merge augmentation, against a hand-built case and a per-token loop."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]


def _merge() -> Any:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from train_demo import merge_into_kept
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return merge_into_kept


def test_dropped_tokens_join_their_nearest_kept_token() -> None:
    merge = _merge()
    # tokens 0 and 2 kept; 1 points like 0, 3 like 2: rows are the means of {0, 1} and {2, 3}
    hidden = torch.tensor([[[1.0, 0.0], [3.0, 0.1], [0.0, 1.0], [0.2, 5.0]]])
    rows = merge(hidden, torch.tensor([[0, 2]]))
    assert torch.allclose(rows, torch.tensor([[[2.0, 0.05], [0.1, 3.0]]]))
    # kept order is the row order (shuffled subsets stay shuffled)
    assert torch.allclose(merge(hidden, torch.tensor([[2, 0]])), rows.flip(1))


def test_matches_a_per_token_loop() -> None:
    merge = _merge()
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 40, 8, generator=g, dtype=torch.float64)
    order = torch.stack([torch.randperm(40, generator=g)[:7] for _ in range(3)])
    rows = merge(hidden, order)
    for b in range(3):
        members: list[list[int]] = [[int(i)] for i in order[b]]
        kept = torch.nn.functional.normalize(hidden[b, order[b]], dim=-1)
        for t in range(40):
            if t in order[b].tolist():
                continue
            members[int((kept @ torch.nn.functional.normalize(hidden[b, t], dim=0)).argmax())].append(t)
        for j, group in enumerate(members):
            assert torch.allclose(rows[b, j], hidden[b, group].mean(0), atol=1e-12)
    assert sum(len(m) for m in members) == 40
