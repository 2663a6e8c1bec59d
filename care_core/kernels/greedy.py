"""Eq. 3's diversity greedy for B images in one Triton launch (CUDA only).

One program per image holds that image's psi_bar, running minimum distance and selected mask in registers and runs
its K_i sequential steps itself; each step reads one row of the image's cosine Gram matrix (computed beforehand by
one matmul per image). K steps cost K block-wide argmax reductions and K row reads of N floats, with no kernel
launch and no host synchronisation between steps, and the B images run side by side on the device's SMs.
The PyTorch twin of exactly one program's computation is :func:`care_core.anchors.diversity_greedy_gram`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from care_core.kernels.shapes import GREEDY_MAX_TOKENS, greedy_layout

#: The largest N one program holds (registers): larger inputs use the PyTorch loop.
MAX_TOKENS = GREEDY_MAX_TOKENS
#: the columns of the per-image table the kernel reads: N_i, K_i and where image i's weights, Gram and order start
TABLE_COLUMNS = 5


@triton.jit
def _greedy_kernel(w_ptr, g_ptr, order_ptr, table_ptr, COLUMNS: tl.constexpr, BLOCK: tl.constexpr):
    row = table_ptr + tl.program_id(0).to(tl.int64) * COLUMNS
    n = tl.load(row).to(tl.int32)
    k = tl.load(row + 1).to(tl.int32)
    weights = w_ptr + tl.load(row + 2)
    gram = g_ptr + tl.load(row + 3)
    order = order_ptr + tl.load(row + 4)
    offs = tl.arange(0, BLOCK)
    valid = offs < n
    w = tl.load(weights + offs, mask=valid, other=0.0)
    minus_inf = float("-inf")
    first = tl.argmax(tl.where(valid, w, minus_inf), axis=0, tie_break_left=True)
    tl.store(order, first.to(tl.int64))
    selected = offs == first
    cosines = tl.load(gram + first.to(tl.int64) * n + offs, mask=valid, other=0.0)
    min_distance = 1 - cosines
    for step in range(1, k):
        score = tl.where(selected | (offs >= n), minus_inf, w * min_distance)
        chosen = tl.argmax(score, axis=0, tie_break_left=True)
        tl.store(order + step, chosen.to(tl.int64))
        selected = selected | (offs == chosen)
        cosines = tl.load(gram + chosen.to(tl.int64) * n + offs, mask=valid, other=0.0)
        min_distance = tl.minimum(min_distance, 1 - cosines)


def greedy_orders(
    weights: torch.Tensor, grams: torch.Tensor, sizes: Sequence[int], ks: Sequence[int]
) -> list[torch.Tensor]:
    """Eq. 3's selection order of ``ks[i]`` steps for each of B images, in one launch: ``weights`` (sum N_i,) each
    image's psi_bar one after another; ``grams`` the images' (N_i, N_i) cosine matrices, row-major, each starting
    where :func:`~care_core.kernels.shapes.greedy_layout` places it."""
    if max(sizes) > MAX_TOKENS:
        raise ValueError(f"the fused greedy holds at most {MAX_TOKENS} tokens, got {max(sizes)}")
    table = _table(sizes, ks, weights.device)
    order = torch.empty(sum(ks), dtype=torch.long, device=weights.device)
    block = max(128, triton.next_power_of_2(max(sizes)))
    warps = 4 if block <= 1024 else 8 if block <= 4096 else 16
    _greedy_kernel[(len(sizes),)](
        weights.contiguous(), grams, order, table, COLUMNS=TABLE_COLUMNS, BLOCK=block, num_warps=warps
    )
    return list(order.split(list(ks)))


def _table(sizes: Sequence[int], ks: Sequence[int], device: torch.device) -> torch.Tensor:
    """The kernel's (B, TABLE_COLUMNS) int64 table on ``device``. One image's is made by fills, with no copy from the
    host, so that a CUDA graph may capture a single image's greedy (care_core.care's reduction graphs)."""
    if len(sizes) == 1:
        table = torch.zeros(TABLE_COLUMNS, dtype=torch.int64, device=device)  # every offset 0
        table[0].fill_(sizes[0])
        table[1].fill_(ks[0])
        return table
    gram_starts, _ = greedy_layout(sizes)
    weight_starts = list(itertools.accumulate(sizes, initial=0))[:-1]
    order_starts = list(itertools.accumulate(ks, initial=0))[:-1]
    rows = list(zip(sizes, ks, weight_starts, gram_starts, order_starts, strict=True))
    return torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
