"""The family GPU benchmark's floor of ``care_reduce``: the jvp engine's multiply-adds, counted by hand."""

from __future__ import annotations

import pytest
import torch

from benchmarks.bench_families_gpu import floor_of
from benchmarks.gpu.scoring import floor_ms


def test_mlp_projector_floor_counts_the_dense_second_layer_only() -> None:
    projector = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    macs, _ = floor_of("llava-onevision", projector, 10)
    assert macs == 64 * 10 * 16 * 4  # m N d_h d_out = 40960


def test_norm_first_projector_floor_counts_both_linears() -> None:
    projector = torch.nn.Sequential(
        torch.nn.LayerNorm(8), torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)
    )
    for family in ("qwen3-vl", "internvl3"):
        macs, _ = floor_of(family, projector, 10)
        assert macs == 64 * 10 * (8 * 16 + 16 * 4)  # m N (d_in d_h + d_h d_out) = 122880


def test_floor_ms_is_two_flops_per_multiply_add_at_the_rate() -> None:
    assert floor_ms(122880 * 10**6, 400.0) == pytest.approx(0.6144)  # 2 x 1.2288e11 FLOP at 4e14 FLOP/s
