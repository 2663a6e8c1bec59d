"""care_reduce_batch: per image, the Reduction care_reduce gives for that image alone (docs/design/batches.md §Batches).

The oracle is care_reduce on each image by itself; one test also checks a batch against the independent numpy
reference (tests/reference). Images of different N share one projector.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

import care_core.care_batch
from care_core import CaReConfig, care_reduce
from care_core.anchors import diversity_greedy, diversity_greedy_gram, unit_rows
from care_core.care import first_not_finite
from care_core.care_batch import batch_anchors, care_reduce_batch, padded_greedy
from care_core.errors import BudgetError, CareError
from care_core.kernels import dispatch
from care_core.kernels.dispatch import KernelGate
from care_core.kernels.shapes import GREEDY_GRAM_ALIGN, GREEDY_MAX_TOKENS, greedy_layout
from care_core.scoring import Scorer, perturbation_responses, unit_directions
from tests.core._problems import make_problem, random_directions, to_np
from tests.reference.care_reference import reference_care

D_V = 12
SIZES = {1: (36,), 3: (1, 7, 36), 8: (100, 1, 576, 7, 36, 2, 50, 13)}
# every hyperparameter away from its default (tau_g != tau_s tells the two temperatures apart)
ODD = CaReConfig(m=16, lam=0.9, eta=0.2, theta_s=0.3, theta_c=0.6, alpha=0.4, sigma_p=0.3, tau_g=0.2, tau_c=0.05,
                 tau_s=0.15, eps=1e-6, seed=7, h=1e-3)  # fmt: skip


def images(sizes, dtype=torch.float64, seed=0):
    """Clustered features and positions, one problem per image (seeded by its place and N)."""
    probs = [make_problem(seed + 31 * i + n, n, D_V, clustered=True) for i, n in enumerate(sizes)]
    return [p.features(dtype) for p in probs], [p.positions(dtype) for p in probs]


def mlp(dtype=torch.float64):
    return make_problem(999, 4, D_V, clustered=False, d_h=32, d_t=24).projector(dtype)


def linear(dtype=torch.float64):
    torch.manual_seed(5)
    return nn.Linear(D_V, 20).to(dtype).requires_grad_(False)


def assert_same(batch, single, *, exact: bool, tol: float = 1e-5):
    """Integer outputs equal; float outputs equal (exact) or within ``tol`` (float32 rounding)."""
    for name in ("indices", "anchor_order", "signals", "residuals", "signal_targets"):
        assert torch.equal(getattr(batch, name), getattr(single, name)), name
    for name in ("psi_bar", "confidence", "tokens"):
        got, want = getattr(batch, name), getattr(single, name)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        if exact:
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12, msg=name)
        else:
            torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=name)


def check_batch(features, projector, positions, budgets, *, config=ODD, exact=True, tol=1e-5, **kw):
    """Each image of the batch against care_reduce on it alone, with its own budget."""
    got = care_reduce_batch(features, projector, positions, config=config, **kw)
    assert len(got) == len(features)
    for red, v, p, budget in zip(got, features, positions, budgets, strict=True):
        single = care_reduce(v, projector, p, config=config, **budget)
        assert_same(red, single, exact=exact, tol=tol)
    return got


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("engine", ["jvp", "fd"])
def test_float64_batch_equals_each_image_alone(batch, engine):
    features, positions = images(SIZES[batch])
    cfg = dataclasses.replace(ODD, engine=engine)
    check_batch(features, mlp(), positions, [{"ratio": 0.3}] * batch, config=cfg, ratio=0.3)


class CountingScorer(Scorer):
    """A scorer that counts its response passes."""

    calls = 0

    def responses(self, *args, **kwargs):
        self.calls += 1
        return super().responses(*args, **kwargs)


@pytest.mark.parametrize("engine", ["jvp", "fd"])
def test_one_scoring_pass_gives_each_image_its_responses(engine):
    """Eq. 1 for all tokens in one engine call; each image's slice is its own responses (to rounding: a BLAS
    may round a row of a taller matrix product differently, docs/design/batches.md §Batches)."""
    features, positions = images(SIZES[8], seed=9)
    projector = mlp()
    scorer = CountingScorer(projector)
    cfg = dataclasses.replace(ODD, engine=engine)
    care_reduce_batch(features, projector, positions, keep=1, config=cfg, scorer=scorer)
    assert scorer.calls == 1
    u = unit_directions(cfg.m, D_V, cfg.seed, dtype=torch.float64)
    joint = perturbation_responses(torch.cat(features), projector, u, h=cfg.h, engine=engine)
    for part, v in zip(joint.split([v.shape[0] for v in features], dim=1), features, strict=True):
        alone = perturbation_responses(v, projector, u, h=cfg.h, engine=engine)
        # fd's difference of two nearly equal activations magnifies an ulp of W1 v + b1 by |W1 v + b1| / h
        torch.testing.assert_close(part, alone, rtol=1e-14 if engine == "jvp" else 1e-12, atol=0)


@pytest.mark.parametrize("engine", ["jvp", "fd"])
def test_float32_batch_has_the_same_anchors_and_signals(engine):
    features, positions = images(SIZES[8], torch.float32)
    cfg = dataclasses.replace(ODD, engine=engine)
    # float32 fd: the difference of two nearly equal activations magnifies an ulp of W1 v + b1 (which a joint pass
    # and one image's pass may round apart, as threaded BLAS blocks them differently) by |W1 v + b1| / h: about
    # 2e-4 of psi_bar at h = 1e-3 (1.6e-4 seen on 2 threads); anchors and signals stay equal
    tol = 1e-3 if engine == "fd" else 1e-5
    check_batch(features, mlp(torch.float32), positions, [{"ratio": 0.2}] * 8, config=cfg, ratio=0.2, exact=False,
                tol=tol)  # fmt: skip


def test_linear_projector_and_default_config():
    features, positions = images(SIZES[3], seed=3)
    check_batch(features, linear(), positions, [{"keep": 1}] * 3, config=CaReConfig(), keep=1)


@pytest.mark.parametrize("projector", [mlp, linear])
def test_per_image_keeps_from_one_to_all_tokens(projector):
    """keeps: K = N for some images (nothing calibrated), K = 1 for others, anything between."""
    sizes = SIZES[8]
    keeps = [n if i % 3 == 0 else max(1, n // (i + 1)) for i, n in enumerate(sizes)]
    assert (
        1 in keeps
        and any(k == n for k, n in zip(keeps, sizes, strict=True))
        and any(1 < k < n for k, n in zip(keeps, sizes, strict=True))
    )
    features, positions = images(sizes, seed=1)
    got = check_batch(features, projector(), positions, [{"keep": k} for k in keeps], keeps=keeps)
    assert [r.num_kept for r in got] == keeps
    assert any(r.signals.numel() > 0 for r in got), "the gate accepts some residuals somewhere"


def test_explicit_directions_are_shared():
    features, positions = images(SIZES[3], seed=2)
    u = torch.from_numpy(random_directions(4, 9, D_V))
    got = care_reduce_batch(features, mlp(), positions, ratio=0.5, config=ODD, directions=u)
    for red, v, p in zip(got, features, positions, strict=True):
        assert_same(red, care_reduce(v, mlp(), p, ratio=0.5, config=ODD, directions=u), exact=True)


def test_an_image_does_not_depend_on_its_batch_mates():
    features, positions = images(SIZES[8], seed=4)
    projector = mlp()
    got = care_reduce_batch(features, projector, positions, ratio=0.25, config=ODD)
    perm = [5, 2, 7, 0, 3, 6, 1, 4]
    permuted = care_reduce_batch([features[i] for i in perm], projector, [positions[i] for i in perm], ratio=0.25,
                                 config=ODD)  # fmt: skip
    for red, i in zip(permuted, perm, strict=True):
        assert_same(red, got[i], exact=True)
    alone = care_reduce_batch(features[2:3], projector, positions[2:3], ratio=0.25, config=ODD)[0]
    assert_same(alone, got[2], exact=True)


def test_batch_matches_the_numpy_reference():
    """Independent of care_reduce: each image against tests/reference (fd engine, explicit directions)."""
    sizes = (17, 100, 40)
    features, positions = images(sizes, seed=6)
    prob = make_problem(999, 4, D_V, clustered=False, d_h=32, d_t=24)
    u = random_directions(6, 16, D_V)
    cfg = CaReConfig(m=16, engine="fd")
    got = care_reduce_batch(features, prob.projector(), positions, keeps=[5, 11, 40], config=cfg,
                            directions=torch.from_numpy(u))  # fmt: skip
    for red, v, p, k in zip(got, features, positions, [5, 11, 40], strict=True):
        ref = reference_care(to_np(v), *prob.weights(), to_np(p), k, u, {"m": 16, "engine": "fd"})
        assert ref["margin"] > 1e-10 and ref["gate_margin"] > 1e-10
        np.testing.assert_array_equal(to_np(red.anchor_order), ref["anchor_order"])
        np.testing.assert_array_equal(to_np(red.signals), ref["signals"])
        np.testing.assert_allclose(to_np(red.tokens), ref["tokens"], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_padded_greedy_picks_what_diversity_greedy_picks_per_image(dtype):
    """Eq. 3 for the whole batch in one loop, against the single-image loop on the same weights."""
    gen = torch.Generator().manual_seed(3)
    sizes, ks = (1, 40, 7, 90), (1, 40, 3, 25)
    # weights of either sign: a padded candidate (weight 0) would beat the negative ones were it selectable
    weights = [torch.rand(n, generator=gen, dtype=dtype) - 0.5 for n in sizes]
    features = [torch.randn(n, 5, generator=gen, dtype=dtype) for n in sizes]
    features[1][4] = 0  # a zero token: cosine 0 with everything
    orders = padded_greedy(weights, features, ks, 1e-8)
    for order, w, v, k in zip(orders, weights, features, ks, strict=True):
        assert torch.equal(order, diversity_greedy(w, v, k, 1e-8, kernel="torch"))


class PretendFused(KernelGate):
    """A gate in "auto" mode that sends every image the fused kernel takes to it on any device, whose build then
    fails (as without Triton); as KernelGate does, a kernel that failed is not chosen again. Counts the attempts."""

    attempts = 0

    def choose(self, name, device, *, applies=True):
        return "fused" if applies and name not in self.failed else "torch"

    def attempt(self, name, fused):
        self.attempts += 1
        self.failed[name] = "pretended"
        return None


class EveryFused(KernelGate):
    """A gate that sends every image the fused kernel takes to it, on any device (its twin stands in for it)."""

    def choose(self, name, device, *, applies=True):
        return "fused" if applies else "torch"


def twin_kernel(launches):
    """dispatch.greedy_orders' stand-in: each image's order by the kernel's PyTorch twin, read from the packed Gram
    buffer where greedy_layout places it; records each launch's sizes."""

    def run(weights, grams, sizes, ks):
        launches.append(list(sizes))
        starts, length = greedy_layout(sizes)
        assert grams.numel() == length and weights.numel() == sum(sizes)
        return [diversity_greedy_gram(w, grams[s : s + n * n].view(n, n), k)
                for w, s, n, k in zip(weights.split(list(sizes)), starts, sizes, ks, strict=True)]  # fmt: skip

    return run


def test_fused_images_share_launches_within_the_gram_bound_and_keep_their_place(monkeypatch):
    """float32 images up to GREEDY_MAX_TOKENS go to the fused kernel together, as many per launch as
    GREEDY_GRAM_ELEMENTS holds (one too large goes alone), a larger image to the padded loop; each fused order is
    what the kernel's twin gives on that image's own Gram matrix, every order at its image's place."""
    gen = torch.Generator().manual_seed(5)
    sizes, ks = (5, 40, GREEDY_MAX_TOKENS + 1, 7, 90, 33), (3, 11, 4, 7, 30, 9)
    weights = [torch.rand(n, generator=gen) for n in sizes]
    features = [torch.randn(n, 3, generator=gen) for n in sizes]
    launches: list[list[int]] = []
    monkeypatch.setattr(dispatch, "greedy_orders", twin_kernel(launches))
    monkeypatch.setattr(care_core.care_batch, "GREEDY_GRAM_ELEMENTS", 5 * 5 + 40 * 40 + 7 * 7 + 1)
    orders = batch_anchors(weights, features, ks, 1e-8, EveryFused("auto"))
    assert launches == [[5, 40, 7], [90], [33]]
    for i, (order, w, v, k) in enumerate(zip(orders, weights, features, ks, strict=True)):
        if i == 2:
            assert torch.equal(order, diversity_greedy(w, v, k, 1e-8, kernel="torch"))
        else:
            unit = unit_rows(v, 1e-8)
            assert torch.equal(order, diversity_greedy_gram(w, unit @ unit.T, k))


def test_images_whose_fused_kernel_fails_to_build_go_to_the_padded_loop(monkeypatch):
    """The fused kernel cannot be built: one attempt for the first launch's images, none for the later launches',
    and every image gets the loop's order, at its place."""
    gen = torch.Generator().manual_seed(5)
    sizes, ks = (5, GREEDY_MAX_TOKENS + 1, 7, 6), (3, 4, 7, 2)
    weights = [torch.rand(n, generator=gen) for n in sizes]
    features = [torch.randn(n, 3, generator=gen) for n in sizes]
    gate = PretendFused("auto")
    monkeypatch.setattr(care_core.care_batch, "GREEDY_GRAM_ELEMENTS", 7 * 7)  # one image per launch
    orders = batch_anchors(weights, features, ks, 1e-8, gate)
    assert gate.failed == {"greedy": "pretended"} and gate.attempts == 1
    for order, w, v, k in zip(orders, weights, features, ks, strict=True):
        assert torch.equal(order, diversity_greedy(w, v, k, 1e-8, kernel="torch"))


def test_packed_grams_start_aligned_one_after_another():
    """greedy_layout: each (N, N) block starts at a multiple of GREEDY_GRAM_ALIGN at or after the previous block's
    end; the buffer ends where the last block does."""
    sizes = [5, 1, 64, 8, 3]
    starts, length = greedy_layout(sizes)
    assert starts == [0, 64, 128, 4224, 4288]  # 25 -> 64, 1 -> 128, 4096 ends at 4224, 64 -> 4288
    assert length == 4288 + 9
    assert all(s % GREEDY_GRAM_ALIGN == 0 for s in starts)


def test_padded_greedy_breaks_ties_to_the_lowest_index():
    """Equal weights and orthogonal tokens: every score ties, so each image picks 0, 1, 2, ... in turn."""
    eye = torch.eye(6, dtype=torch.float64)
    orders = padded_greedy([torch.ones(6, dtype=torch.float64), torch.ones(3, dtype=torch.float64)],
                           [eye, eye[:3]], [4, 3], 1e-8)  # fmt: skip
    assert orders[0].tolist() == [0, 1, 2, 3] and orders[1].tolist() == [0, 1, 2]


def test_padding_is_never_selected():
    """An image with K = N beside a larger one: its order is a permutation of its own N tokens."""
    features, positions = images((3, 50), seed=8)
    got = care_reduce_batch(features, mlp(), positions, keeps=[3, 50], config=ODD)
    assert sorted(got[0].anchor_order.tolist()) == [0, 1, 2]
    assert sorted(got[1].anchor_order.tolist()) == list(range(50))


def test_bad_batches_name_the_parameter():
    features, positions = images((5, 6))
    projector = mlp()
    with pytest.raises(BudgetError, match="exactly one"):
        care_reduce_batch(features, projector, positions, ratio=0.5, keeps=[1, 1])
    with pytest.raises(BudgetError, match="keeps"):
        care_reduce_batch(features, projector, positions, keeps=[1])
    with pytest.raises(BudgetError, match="keep"):
        care_reduce_batch(features, projector, positions, keeps=[1, 7])
    with pytest.raises(CareError, match="positions"):
        care_reduce_batch(features, projector, positions[:1], keep=1)
    with pytest.raises(CareError, match="features"):
        care_reduce_batch([], projector, [], keep=1)
    with pytest.raises(CareError, match="image 1"):
        care_reduce_batch(features, projector, [positions[0], positions[0]], keep=1)
    with pytest.raises(CareError, match="width"):
        care_reduce_batch([features[0], features[1][:, :4]], projector, positions, keep=1)
    with pytest.raises(CareError, match="float64"):
        care_reduce_batch([features[0], features[1].float()], projector, positions, keep=1)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_first_not_finite_names_the_first_image_with_nan_or_inf(device, dtype):
    rows = (5, 1, 300, 7, 2)
    for bad, value in [(None, None), (0, float("nan")), (2, float("inf")), (3, float("-inf")), (4, float("nan"))]:
        features = [torch.randn(n, D_V, dtype=dtype, generator=torch.Generator().manual_seed(n)) for n in rows]
        if bad is not None:
            features[bad][rows[bad] - 1, D_V - 1] = value  # the last value of that image: no earlier one is bad
            features[-1][0, 0] = float("inf")  # a later image is bad too: the first one is named
        assert first_not_finite([f.to(device) for f in features]) == bad


@pytest.mark.parametrize("device", DEVICES)
def test_first_not_finite_skips_empty_images_and_sees_huge_finite_values_as_finite(device):
    huge = torch.full((3, D_V), torch.finfo(torch.float32).max, device=device)  # a sum would overflow: a max does not
    empty = torch.empty(0, D_V, device=device)
    assert first_not_finite([empty, huge, empty]) is None
    assert first_not_finite([empty, huge, torch.tensor([[float("nan")]], device=device)]) == 2
    assert first_not_finite([empty]) is None
