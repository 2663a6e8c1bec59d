"""Measured FLOPs with `torch.utils.flop_counter.FlopCounterMode`, for checking the analytic terms (tests only).

`FlopCounterMode` in torch 2.13 has no formula for the CPU flash-attention kernel that `sdpa` dispatches to on
CPU (`aten._scaled_dot_product_flash_attention_for_cpu`), so the 4W²H term silently disappears there.
`count_flops` gives that op one (full, non-causal QKᵀ + AV, like the GPU kernels' formulas) through the
counter's own `custom_mapping`: torch's global `flop_registry` is never written.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import flop_counter


def _cpu_sdpa_flop(query_shape, key_shape, value_shape, *args: Any, out_shape=None, **kwargs: Any) -> int:
    # grouped-query attention (fewer key/value heads) costs what one key/value head per query head costs; torch
    # before 2.13 refuses the grouped shapes, so they are given per query head
    heads = query_shape[1]
    return flop_counter.sdpa_flop_count(query_shape, (*key_shape[:1], heads, *key_shape[2:]),
                                        (*value_shape[:1], heads, *value_shape[2:]))  # fmt: skip


def cpu_sdpa_mapping() -> dict[Any, Callable[..., int]]:
    """The CPU flash-sdpa op's FLOP formula, for `FlopCounterMode(custom_mapping=...)`; empty when torch has one."""
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is None or op in flop_counter.flop_registry or op.default in flop_counter.flop_registry:
        return {}
    return {op: _cpu_sdpa_flop}


def count_flops(fn: Callable[[], Any]) -> tuple[int, dict[str, int]]:
    """Run `fn` under FlopCounterMode (no grad): total FLOPs and the total per module name."""
    every_depth: Any = None
    counter = flop_counter.FlopCounterMode(display=False, depth=every_depth, custom_mapping=cpu_sdpa_mapping())
    with counter, torch.no_grad():
        fn()
    per_module = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    return counter.get_total_flops(), per_module
