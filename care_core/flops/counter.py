"""Measured FLOPs with `torch.utils.flop_counter.FlopCounterMode`, for checking the analytic terms.

`FlopCounterMode` in torch 2.13 has no formula for the CPU flash-attention kernel that `sdpa` dispatches to on
CPU (`aten._scaled_dot_product_flash_attention_for_cpu`), so the 4W²H term silently disappears there.
`register_cpu_sdpa_formula()` adds one (full, non-causal QKᵀ + AV, like the GPU kernels' formulas).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def register_cpu_sdpa_formula() -> bool:
    """Give the CPU flash-sdpa op a FLOP formula if it has none; True when this call registered it."""
    import torch
    from torch.utils import flop_counter

    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is None or op in flop_counter.flop_registry or op.default in flop_counter.flop_registry:
        return False

    @flop_counter.register_flop_formula(op)
    def _cpu_sdpa_flop(query_shape, key_shape, value_shape, *args: Any, out_shape=None, **kwargs: Any) -> int:
        return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)

    return True


def count_flops(fn: Callable[[], Any]) -> tuple[int, dict[str, int]]:
    """Run `fn` under FlopCounterMode (no grad): total FLOPs and the total per module name."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    register_cpu_sdpa_formula()
    counter = FlopCounterMode(display=False, depth=None)  # type: ignore[arg-type]  # None: every depth
    with counter, torch.no_grad():
        fn()
    per_module = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    return counter.get_total_flops(), per_module
