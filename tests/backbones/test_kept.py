"""Kept indices read on the host (care_core/backbones/base.py): one copy for a batch, values unchanged."""

from __future__ import annotations

import pytest
import torch

from care_core.backbones.base import check_kept, kept_on_host


def test_host_tensors_and_none_pass_through_untouched() -> None:
    a, b = torch.tensor([3, 0, -1]), torch.tensor([[1, 2]])  # b: 2-D, for check_kept to refuse
    out = kept_on_host([a, None, b])
    assert out[0] is a and out[1] is None and out[2] is b
    with pytest.raises(ValueError, match="kept must be"):
        check_kept(out[2], 2, 5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_indices_come_back_with_their_values_and_dtypes() -> None:
    kept = [torch.tensor([4, 1, -1], device="cuda"), None, torch.tensor([], dtype=torch.long, device="cuda"),
            torch.tensor([2, 0], device="cuda")]  # fmt: skip
    out = kept_on_host(kept)
    assert out[1] is None
    moved = [o for o in out if o is not None]
    assert [o.tolist() for o in moved] == [[4, 1, -1], [], [2, 0]]
    assert all(o.device.type == "cpu" and o.dtype == torch.long for o in moved)
    mixed = kept_on_host([torch.tensor([1], device="cuda"), torch.tensor([2], dtype=torch.int32, device="cuda")])
    assert [(o.tolist(), o.dtype, o.device.type) for o in mixed if o is not None] == [
        ([1], torch.long, "cpu"),
        ([2], torch.int32, "cpu"),
    ]
