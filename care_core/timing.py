"""Stage timing: wall-clock milliseconds per named stage, with CUDA synchronised around each stage."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from care_core._lazy import torch


class StageClock:
    """Milliseconds per named stage (accumulated); synchronises CUDA so GPU work is counted.

    Usable wherever the core takes a ``stage_timer``: ``with clock("scoring"): ...``.
    """

    def __init__(self, device: Any = None) -> None:
        self.ms: dict[str, float] = {}
        self.device = device

    def _sync(self) -> None:
        device = self.device
        if device is not None and torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.ms[name] = self.ms.get(name, 0.0) + (time.perf_counter() - start) * 1e3

    def rounded(self) -> dict[str, float]:
        """Stages in order, rounded to microseconds, plus their ``total``."""
        out = {name: round(value, 3) for name, value in self.ms.items()}
        out["total"] = round(sum(self.ms.values()), 3)
        return out


def median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples), 3)
