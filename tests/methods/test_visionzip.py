"""VisionZip: budget split, a hand-checkable 5-token case, the registered method, and the golden files."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from care_core.errors import MethodError
from care_core.methods import create_method
from care_core.methods.visionzip import VisionZip, dominant_split, visionzip_reduce

from .conftest import make_inputs

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parents[3] / "shared" / "golden"


def _hand_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CLS + 4 patches; patch 0 (token 1) has the highest CLS attention; token 4's key is token 3's."""
    hidden = torch.tensor([[100.0, 0], [1, 0], [2, 0], [3, 0], [5, 0]])
    attention = torch.tensor([[0.1, 0.4, 0.1, 0.3, 0.1]])
    keys = torch.tensor([[1.0, 0], [1, 0], [1, 0], [0, 1], [0, 2]])
    return hidden, attention, keys


def test_split_reproduces_54_10() -> None:
    assert dominant_split(64) == (54, 10)
    assert dominant_split(128) == (108, 20)
    assert dominant_split(192) == (162, 30)
    assert dominant_split(8) == (7, 1)
    assert dominant_split(1) == (1, 0)


def test_hand_case_one_contextual_token() -> None:
    hidden, attention, keys = _hand_case()
    out = visionzip_reduce(hidden, attention, keys, dominant=2, contextual=1)
    # dominant: CLS + token 1; rest = tokens 2, 3, 4 (R = 3), step 3 -> target token 2, tokens 3 and 4 merge into it
    assert out.all_indices.tolist() == [0, 1]
    assert out.dominant_sorted.tolist() == [0, 1]
    assert out.targets.tolist() == [2]
    assert torch.allclose(out.tokens, torch.tensor([[100.0, 0], [1, 0], [2 + (3 + 5) / 2, 0]]))
    assert out.assignment.tolist() == [0, 1, 2, 2, 2]


def test_hand_case_two_contextual_tokens() -> None:
    hidden, attention, keys = _hand_case()
    out = visionzip_reduce(hidden, attention, keys, dominant=2, contextual=2)
    # step max(1, 3 // 2) = 1 -> targets tokens 2, 3; token 4's key is parallel to token 3's
    assert out.targets.tolist() == [2, 3]
    assert torch.allclose(out.tokens[2:], torch.tensor([[2.0, 0], [3 + 5, 0]]))
    assert out.assignment.tolist() == [0, 1, 2, 3, 3]


def test_method_rows_and_indices() -> None:
    inputs = make_inputs(seed=1)
    result = create_method("visionzip")(inputs, 16)
    assert result.num_tokens == 16
    assert result.token_index[0] == -1  # the CLS row comes first
    assert torch.equal(result.tokens[0], inputs.probes["hidden_with_cls"][0])
    dominant = result.info["dominant"]
    assert dominant == 14 and result.info["contextual"] == 2
    assert torch.equal(result.token_index[1:dominant], result.token_index[1:dominant].sort().values)
    assert (result.assignment >= 1).all()  # every patch lands in a patch or contextual row
    top = inputs.probes["cls_attention"][:, 1:].sum(0).topk(dominant - 1).indices
    assert set(result.token_index[1:dominant].tolist()) == set(top.tolist())


def test_explicit_dominant_and_errors() -> None:
    inputs = make_inputs(seed=2)
    assert VisionZip(dominant=6)(inputs, 8).info["contextual"] == 2
    with pytest.raises(MethodError):
        VisionZip(dominant=9)(inputs, 8)
    with pytest.raises(MethodError):
        VisionZip()(inputs, 0)


def test_zero_keys_give_no_nan() -> None:
    inputs = make_inputs(seed=4)
    inputs.probes["keys"] = torch.zeros_like(inputs.probes["keys"])
    result = VisionZip()(inputs, 24)
    assert torch.isfinite(result.tokens).all()


def _check_file():
    spec = importlib.util.spec_from_file_location("check_golden", ROOT / "scripts" / "check_golden.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.check_file


@pytest.mark.parametrize("path", sorted(GOLDEN.glob("visionzip_*.npz")), ids=lambda p: p.name)
def test_golden(path: Path) -> None:
    if "e2e" in path.name:
        pytest.importorskip("transformers")
    results = _check_file()(path)
    assert results and all(r.passed for r in results), [r for r in results if not r.passed]
