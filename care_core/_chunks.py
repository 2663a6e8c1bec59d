"""How the scoring engines split the m directions into chunks (torch-free: ``care flops`` counts with it too)."""

from __future__ import annotations

# Elements of the largest intermediate per chunk (~256 MB in float32).
CHUNK_ELEMENTS = 1 << 26


def chunk_size(m: int, per_direction: int) -> int:
    """Directions per chunk, where one direction's largest intermediate has ``per_direction`` elements."""
    return max(1, min(m, CHUNK_ELEMENTS // max(1, per_direction)))


def two_pass_chunk(m: int, n: int, dim: int, out_dim: int) -> int:
    """Directions per chunk where each direction holds two (N, max(dim, out_dim)) intermediates: the fd engine's
    +h / -h points, the generic jvp path's primal and tangent (any projector that is not Linear-act-Linear)."""
    return chunk_size(m, n * max(dim, out_dim) * 2)
