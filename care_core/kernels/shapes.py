"""The shapes and sizes the fused kernels take (torch- and Triton-free): what their callers check before choosing
the fused path, and what the kernel modules tile by."""

from __future__ import annotations

from collections.abc import Sequence

#: Shapes the fused jvp kernel tiles without masks (LLaVA: 4096 -> 4096).
JVP_K_MULTIPLE = 64
JVP_OUT_MULTIPLE = 256
#: The largest N one program of the fused greedy holds in registers; larger inputs use the PyTorch loop.
GREEDY_MAX_TOKENS = 16384
#: elements: each image's Gram matrix in the fused greedy's packed buffer starts at a multiple of this (256 bytes in
#: float32, where a fresh allocation starts), so its matmul sees the alignment a single image's Gram has
GREEDY_GRAM_ALIGN = 64
#: elements: the most the Gram matrices of one fused greedy launch hold together (1 GiB in float32); more images go
#: in further launches
GREEDY_GRAM_ELEMENTS = 1 << 28


def greedy_layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Where each image's (N_i, N_i) Gram matrix starts in the fused greedy's packed buffer, and the buffer's length
    (elements): one after another, each start a multiple of :data:`GREEDY_GRAM_ALIGN`."""
    starts, end = [], 0
    for n in sizes:
        start = -(-end // GREEDY_GRAM_ALIGN) * GREEDY_GRAM_ALIGN
        starts.append(start)
        end = start + n * n
    return starts, end


def jvp_shape_supported(hidden: int, out_dim: int) -> bool:
    """Shapes the fused jvp kernel takes without masks."""
    return hidden % JVP_K_MULTIPLE == 0 and out_dim % JVP_OUT_MULTIPLE == 0


#: what the fused norm-first jvp kernel tiles without masks: blocks per token row (InternVL3: 1; the Qwen mergers'
#: 2 x 2 patches: 4), d_h a multiple of its K tile, d_out of its output tile
NORM_FIRST_BLOCKS = (1, 4)
NORM_FIRST_OUT_MULTIPLE = 128


def norm_first_shape_supported(blocks: int, hidden: int, out_dim: int) -> bool:
    """Shapes the fused norm-first jvp kernel takes without masks."""
    return blocks in NORM_FIRST_BLOCKS and hidden % JVP_K_MULTIPLE == 0 and out_dim % NORM_FIRST_OUT_MULTIPLE == 0


#: the most blocks per token row the norm-first operand kernel unrolls (the Qwen mergers: 4)
NORM_FIRST_OPERAND_MAX_BLOCKS = 4


def norm_first_operand_supported(blocks: int) -> bool:
    """Blocks per row the norm-first operand kernel takes (any widths: it masks its edges)."""
    return 1 <= blocks <= NORM_FIRST_OPERAND_MAX_BLOCKS


#: what the gemm-norm kernel (rows through the second layer's factor, then their norms) tiles without masks: d_h a
#: multiple of its K tile, d_out of its narrowest output tile (whose first column starts an upper factor's K loop)
GEMM_NORM_K_MULTIPLE = JVP_K_MULTIPLE
GEMM_NORM_OUT_MULTIPLE = 128


def gemm_norm_shape_supported(hidden: int, out_dim: int, *, upper: bool) -> bool:
    """Shapes the gemm-norm kernel takes without masks: R (out_dim, hidden), no taller than wide where ``upper``
    (an upper triangle or trapezoid: each output block's K loop starts at its first column, inside R)."""
    fits = hidden % GEMM_NORM_K_MULTIPLE == 0 and out_dim % GEMM_NORM_OUT_MULTIPLE == 0
    return fits and (out_dim <= hidden or not upper)


#: token rows from which the fused jvp kernel is tuned as for a batch of images (see :func:`size_class`)
BATCH_ROWS = 4096


def size_class(rows: int) -> int:
    """The autotuner's key for ``rows`` token rows: 0 for one image's rows, 1 from :data:`BATCH_ROWS` on (a batch).
    Tuning benchmarks every candidate tile for seconds, and data-set runs meet a new N at almost every call (image
    sizes vary, and a batch's N is the sum of its images'): keyed on N itself, a run on a GPU re-tuned at almost
    every batch. Two classes tune at most twice per process; within a class the tile that wins is the same or
    close."""
    return int(rows >= BATCH_ROWS)
