"""CGTC over a batch (Eq. 4–9, padded and masked): per image, what one image's calibration gives."""

from __future__ import annotations

import pytest
import torch

from care_core.calibration import calibrate, calibrate_batch
from care_core.config import CaReConfig

CFG = CaReConfig(theta_c=0.55, eta=0.5)  # a gate that accepts some residuals and rejects others
OPTIONS = {name: getattr(CFG, name) for name in
           ("eta", "theta_s", "theta_c", "alpha", "sigma_p", "tau_g", "tau_c", "tau_s", "eps")}  # fmt: skip


def _image(n: int, k: int, seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, 12, generator=g, dtype=dtype)
    v[3] = 0.0  # a zero row: its cosines are 0
    p = torch.rand(n, 2, generator=g, dtype=dtype)
    w = torch.rand(n, generator=g, dtype=dtype)
    anchors = torch.randperm(n, generator=g)[:k].sort().values
    return v, p, anchors, w


# (N, K) per image: different sizes, K = 1 (k_f = 1), K = 2, K = N (nothing to calibrate), a large K
SHAPES = [(40, 5), (25, 1), (60, 12), (30, 30), (50, 2), (33, 20)]


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_batch_calibrates_every_image_as_it_is_calibrated_alone(gated: bool, dtype: torch.dtype) -> None:
    images = [_image(n, k, seed, dtype) for seed, (n, k) in enumerate(SHAPES)]
    batch = calibrate_batch(*(list(column) for column in zip(*images, strict=True)), gated=gated, **OPTIONS)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    accepted_somewhere = rejected_somewhere = False
    for (v, p, a, w), got in zip(images, batch, strict=True):
        ref = calibrate(v, p, a, w, gated=gated, **OPTIONS)
        assert torch.equal(got.residuals, ref.residuals)
        assert torch.equal(got.signals, ref.signals)
        assert torch.equal(got.signal_targets, ref.signal_targets)
        torch.testing.assert_close(got.confidence, ref.confidence, rtol=tol, atol=tol)
        torch.testing.assert_close(got.tokens, ref.tokens, rtol=tol, atol=tol)
        accepted_somewhere |= got.signals.numel() > 0
        rejected_somewhere |= got.signals.numel() < got.residuals.numel()
    assert accepted_somewhere and (rejected_somewhere or not gated)  # the gate was exercised both ways


def test_residuals_are_the_tokens_that_are_not_anchors() -> None:
    v, p, _, w = _image(9, 3, 0, torch.float64)
    (one,) = calibrate_batch([v], [p], [torch.tensor([0, 4, 8])], [w], **OPTIONS)
    assert one.residuals.tolist() == [1, 2, 3, 5, 6, 7]  # by hand: 0..8 without 0, 4, 8
    assert one.tokens.shape == (3, 12)


def _host_waits(run: object) -> list[str]:
    """The synchronising CUDA calls ``run()`` makes, as the messages of torch's sync-debug warnings."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()  # type: ignore[operator]
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return [str(w.message) for w in caught if "called a synchronizing CUDA operation" in str(w.message)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_calibration_never_waits_for_the_gpu() -> None:
    # R+ stays a mask until someone lists it, so the tokens can be used (projector, prompt, prefill) while the scoring
    # still runs; marking the anchors with `mask[anchors] = True` once copied True from the host and waited
    v, p, anchors, w = (t.cuda() for t in _image(2880, 160, 7, torch.float32))
    cal = None

    def run() -> None:
        nonlocal cal
        cal = calibrate(v, p, anchors, w, gated=True, **OPTIONS)

    waits = _host_waits(run)
    assert waits == []
    assert cal is not None and torch.isin(cal.signals, cal.residuals).all()  # listed when asked, after the work


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_batched_calibration_never_waits_for_the_gpu() -> None:
    images = [tuple(t.cuda() for t in _image(n, k, seed, torch.float32)) for seed, (n, k) in enumerate(SHAPES)]
    columns = [list(column) for column in zip(*images, strict=True)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any wait for the device raises
    try:
        out = calibrate_batch(*columns, gated=True, **OPTIONS)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert [int(c.tokens.shape[0]) for c in out] == [k for _, k in SHAPES]
