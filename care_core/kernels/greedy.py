"""Eq. 3's diversity greedy in one Triton launch (CUDA only).

One program holds psi_bar, the running minimum distance and the selected mask of all N tokens in
registers and runs the K sequential steps itself; each step reads one row of the cosine Gram matrix
(computed beforehand by one matmul). K steps cost K block-wide argmax reductions and K row reads of
N floats, with no kernel launch and no host synchronisation between steps.
The PyTorch twin of exactly this computation is :func:`care_core.anchors.diversity_greedy_gram`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from care_core.kernels.shapes import GREEDY_MAX_TOKENS

#: The largest N one program holds (registers): larger inputs use the PyTorch loop.
MAX_TOKENS = GREEDY_MAX_TOKENS


@triton.jit
def _greedy_kernel(w_ptr, g_ptr, order_ptr, n, k, stride_g, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    valid = offs < n
    w = tl.load(w_ptr + offs, mask=valid, other=0.0)
    minus_inf = float("-inf")
    first = tl.argmax(tl.where(valid, w, minus_inf), axis=0, tie_break_left=True)
    tl.store(order_ptr, first.to(tl.int64))
    selected = offs == first
    row = tl.load(g_ptr + first.to(tl.int64) * stride_g + offs, mask=valid, other=0.0)
    min_distance = 1 - row
    for step in range(1, k):
        score = tl.where(selected | (offs >= n), minus_inf, w * min_distance)
        chosen = tl.argmax(score, axis=0, tie_break_left=True)
        tl.store(order_ptr + step, chosen.to(tl.int64))
        selected = selected | (offs == chosen)
        row = tl.load(g_ptr + chosen.to(tl.int64) * stride_g + offs, mask=valid, other=0.0)
        min_distance = tl.minimum(min_distance, 1 - row)


def greedy_order(weights: torch.Tensor, gram: torch.Tensor, k: int) -> torch.Tensor:
    """(k,) long selection order of Eq. 3 from psi_bar ``weights`` (N,) and cosines ``gram`` (N, N)."""
    n = weights.shape[0]
    if n > MAX_TOKENS:
        raise ValueError(f"the fused greedy holds at most {MAX_TOKENS} tokens, got {n}")
    block = max(128, triton.next_power_of_2(n))
    warps = 4 if block <= 1024 else 8 if block <= 4096 else 16
    order = torch.empty(k, dtype=torch.long, device=weights.device)
    w = weights.contiguous()
    g = gram.contiguous()
    _greedy_kernel[(1,)](w, g, order, n, k, g.stride(0), BLOCK=block, num_warps=warps)
    return order
