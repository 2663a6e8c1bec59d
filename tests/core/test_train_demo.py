"""scripts/train_demo.py: its merge augmentation (against a hand-built case and a per-token loop) and its stop on
Ctrl-C (one line, exit code 130, no traceback)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from scripts import train_demo


def _merge() -> Any:
    return train_demo.merge_into_kept


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


def test_ctrl_c_in_training_stops_with_one_line_and_130(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def prepare(args: Any, run: Any) -> tuple[Any, Any]:
        run.log("pool: 8 scenes")  # set-up done, log written
        return None, None

    def fit(args: Any, run: Any, parts: Any, data: Any) -> float:
        raise KeyboardInterrupt  # Ctrl-C during the steps

    monkeypatch.setattr(train_demo, "prepare", prepare)
    monkeypatch.setattr(train_demo, "fit", fit)
    code = train_demo.main(["--out", str(tmp_path), "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 130
    assert err.splitlines() == [f"interrupted; saved so far: {tmp_path / 'log.txt'}"]
    assert "pool: 8 scenes" in (tmp_path / "log.txt").read_text()
    assert not (tmp_path / "model").exists()
