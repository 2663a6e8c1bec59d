"""The batch part: ``care_reduce_batch`` over B images against B calls of ``care_reduce``, per image, with the floor of
the arithmetic (m·N·d_h·(d_h+1)/2 multiply-adds through W2's triangular factor at the measured tf32 rate), its stages,
and whether every image keeps the anchors and signals it gets alone."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from benchmarks.common import say
from benchmarks.gpu.context import M_DIRECTIONS
from benchmarks.gpu.scoring import Micro, floor_ms
from care_core import CaReConfig, care_reduce, care_reduce_batch
from care_core.care import calibrate_batch_with
from care_core.care_batch import batch_anchors, batch_scores
from care_core.precision import matmul_precision
from care_core.scoring import Scorer

BATCH_SIZES = (1, 4, 16)


def images_like(features: torch.Tensor, positions: torch.Tensor, count: int) -> tuple[list[Any], list[Any]]:
    """``count`` distinct images' tokens: the photo's features with seeded noise of 5% of their spread per copy
    (timings do not depend on the values; distinct images keep the anchor loops honest)."""
    spread = float(features.float().std())
    g = torch.Generator(device="cpu").manual_seed(0)
    feats = [(features.float() + 0.05 * spread * torch.randn(features.shape, generator=g).to(features.device))
             for _ in range(count)]  # fmt: skip
    return feats, [positions for _ in range(count)]


def triangular_floor_ms(n: int, d_h: int, micro: Micro) -> float:
    """Eq. 1's jvp through the triangular factor: m·N·d_h·(d_h+1)/2 multiply-adds at the tf32 rate."""
    return floor_ms(M_DIRECTIONS * n * d_h * (d_h + 1) // 2, micro.rates["tf32"])


def _stages(feats: list[Any], projector: Any, positions: list[Any], keep: int, scorer: Scorer,
            micro: Micro) -> dict[str, float]:  # fmt: skip
    """Median ms of the three stages of one batch: the joint scoring pass, Eq. 3 for all, CGTC per image."""
    cfg = CaReConfig()
    psi = batch_scores(feats, projector, None, cfg, scorer)
    gate = scorer.gate(cfg.kernel)
    keeps = [keep] * len(feats)
    with matmul_precision(allow_tf32=False), torch.no_grad():
        orders = batch_anchors(psi, feats, keeps, cfg.eps, gate)

        def calibrate() -> None:
            calibrate_batch_with(cfg, feats, positions, [o.sort().values for o in orders], psi, gated=True)

        anchors = partial(batch_anchors, psi, feats, keeps, cfg.eps, gate)
        return {"scoring_ms": micro.clock.median(partial(batch_scores, feats, projector, None, cfg, scorer),
                                                 reps=micro.reps, warmup=1),
                "anchors_ms": micro.clock.median(anchors, reps=micro.reps, warmup=1),
                "calibration_ms": micro.clock.median(calibrate, reps=micro.reps, warmup=1)}  # fmt: skip


def _separate(feats: list[Any], projector: Any, positions: list[Any], keep: int, scorer: Scorer) -> list[Any]:
    return [care_reduce(v, projector, p, keep=keep, scorer=scorer) for v, p in zip(feats, positions, strict=True)]


def bench_batch(features_by_n: dict[int, torch.Tensor], positions_by_n: dict[int, torch.Tensor], projector: Any,
                keep_by_n: dict[int, int], micro: Micro) -> list[dict[str, Any]]:  # fmt: skip
    """Per N and batch size: the batch's ms per image, B separate calls' ms per image, both against the floor."""
    rows = []
    d_h = int(projector.linear_2.weight.shape[1])
    for n, features in features_by_n.items():
        keep, floor = keep_by_n[n], triangular_floor_ms(n, d_h, micro)
        for size in BATCH_SIZES:
            feats, positions = images_like(features, positions_by_n[n], size)
            scorer = Scorer(projector)
            batched = partial(care_reduce_batch, feats, projector, positions, keep=keep, scorer=scorer)
            separate = partial(_separate, feats, projector, positions, keep, scorer)
            together, alone = batched(), separate()
            row: dict[str, Any] = {"N": n, "K": keep, "B": size, "floor_ms_per_image": floor,
                                   "same_anchors": all(torch.equal(a.indices, b.indices)
                                                       for a, b in zip(together, alone, strict=True)),
                                   "same_signals": all(torch.equal(a.signals, b.signals)
                                                       for a, b in zip(together, alone, strict=True))}  # fmt: skip
            row["batch_ms_per_image"] = micro.clock.median(batched, reps=micro.reps, warmup=1) / size
            row["separate_ms_per_image"] = micro.clock.median(separate, reps=micro.reps, warmup=1) / size
            row["x_floor_batch"] = row["batch_ms_per_image"] / floor
            row["x_floor_separate"] = row["separate_ms_per_image"] / floor
            row.update({k: v / size for k, v in _stages(feats, projector, positions, keep, scorer, micro).items()})
            rows.append(row)
            say(f"  care_reduce_batch N={n} K={keep} B={size}: {row['batch_ms_per_image']:.2f} ms/image "
                f"({row['x_floor_batch']:.2f}x floor), separate {row['separate_ms_per_image']:.2f}")  # fmt: skip
    return rows
