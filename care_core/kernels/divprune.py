"""DivPrune's max-min greedy for B images in one Triton launch (CUDA only).

One program per image holds its scores (the running minimum distance to the selected tokens) and its selected mask
in registers and runs its K steps itself, reading one row of its padded (N_max, N_max) cosine-distance matrix per
step. The PyTorch twin of exactly this computation is :func:`care_core.methods.divprune.divprune_select_batch`'s
loop: the same distances (computed beforehand, per image), the same argmax with the first index on ties, the same
exact running minimum and, with ``mask_selected``, the same lowest-index fallback. The loop launches about ten
kernels per step; this is one launch for all steps of all images.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from care_core.kernels.shapes import GREEDY_MAX_TOKENS

#: The largest N one program holds (registers): larger inputs use the PyTorch loop.
MAX_TOKENS = GREEDY_MAX_TOKENS


@triton.jit
def _divprune_kernel(dist_ptr, first_ptr, sizes_ptr, order_ptr, steps, stride_image, stride_row, stride_first,
                     MASK_SELECTED: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    image = tl.program_id(0)
    n = tl.load(sizes_ptr + image)
    offs = tl.arange(0, BLOCK)
    valid = offs < n
    minus_inf = float("-inf")
    matrix = dist_ptr + image.to(tl.int64) * stride_image
    out = order_ptr + image.to(tl.int64) * steps
    scores = tl.load(first_ptr + image.to(tl.int64) * stride_first + offs, mask=valid, other=minus_inf)
    selected = offs >= n  # padding counts as selected and scores -inf: never chosen
    for step in range(0, steps):
        chosen = tl.argmax(scores, axis=0, tie_break_left=True)
        if MASK_SELECTED:  # an already selected argmax: the lowest-index unselected token instead
            taken = tl.max(tl.where(offs == chosen, selected.to(tl.int32), 0), axis=0)
            lowest = tl.min(tl.where(selected, BLOCK, offs), axis=0)
            # all selected (steps past this image's n): row 0, as the loop's argmax of an all-False row; BLOCK
            # would read a row past the image's matrix (past the buffer's end for the last image)
            lowest = tl.where(lowest == BLOCK, 0, lowest)
            chosen = tl.where(taken > 0, lowest, chosen)
        tl.store(out + step, chosen.to(tl.int64))
        selected = selected | (offs == chosen)
        row = tl.load(matrix + chosen.to(tl.int64) * stride_row + offs, mask=valid, other=minus_inf)
        # step 0 replaces the first scores by the chosen row; later steps take the running minimum (exact)
        scores = tl.where(step == 0, row, tl.minimum(scores, row))


def divprune_orders(dist: torch.Tensor, first: torch.Tensor, sizes: torch.Tensor, steps: int,
                    mask_selected: bool) -> torch.Tensor:  # fmt: skip
    """(B, steps) long selection orders from the padded distances ``dist`` (B, N_max, N_max), the first step's
    scores ``first`` (B, N_max) and each image's token count ``sizes`` (B,) on the device."""
    b, n_max = first.shape
    if n_max > MAX_TOKENS:
        raise ValueError(f"the fused DivPrune greedy holds at most {MAX_TOKENS} tokens, got {n_max}")
    block = max(128, triton.next_power_of_2(n_max))
    warps = 4 if block <= 1024 else 8 if block <= 4096 else 16
    order = torch.zeros(b, steps, dtype=torch.long, device=first.device)
    if steps == 0 or b == 0:
        return order
    d, f = dist.contiguous(), first.contiguous()
    counts = sizes.to(device=first.device, dtype=torch.int32).contiguous()
    _divprune_kernel[(b,)](d, f, counts, order, steps, d.stride(0), d.stride(1), f.stride(0),
                           MASK_SELECTED=mask_selected, BLOCK=block, num_warps=warps)  # fmt: skip
    return order
