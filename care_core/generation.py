"""What one greedy answer returns: :class:`Generation` (text, token ids, how it was decoded, what it took).

The adapters' ``generate`` returns it; callers read the decoding from the result, never from the adapter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Decoding = Literal["cuda-graph", "eager"]


@dataclass(frozen=True)
class Generation:
    """One greedy answer.

    ``token_ids``: the new tokens, the end token included where decoding stopped at one. ``decoding``:
    ``"cuda-graph"`` (replayed CUDA graphs over a static KV cache) or ``"eager"`` (no graphs: the static loop step
    by step where it would replay graphs but they were turned off, else ``model.generate``).
    ``eager_reason``: why graphs were not used (one line; None when they were). ``elapsed_ms``: wall-clock
    time of the call (the answer is on the host at its end); not part of equality, so two answers compare
    by what they say and how they were decoded.
    """

    text: str
    token_ids: tuple[int, ...]
    decoding: Decoding
    eager_reason: str | None = None
    elapsed_ms: float = field(default=0.0, compare=False)
