"""Stage timing: wall-clock milliseconds per named stage, with CUDA synchronised around each stage; and the one
protocol for comparing timings fairly (:func:`alternating_medians`: warm-ups, alternating order, medians), which
``care reduce --generate`` (through :meth:`~care_core.pipeline.ReductionPipeline.time_answers`) and the
benchmarks call. Nothing in the library's answer path times itself.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from care_core._lazy import torch
from care_core.errors import CareError

T = TypeVar("T")


class StageClock:
    """Milliseconds per named stage (accumulated); synchronises CUDA so GPU work is counted.

    Usable wherever the core takes a ``stage_timer``: ``with clock("scoring"): ...``. Built with ``timed=False``
    it is the same interface doing nothing: no synchronisation and :attr:`ms` stays empty -- for callers that
    want no timings, since every synchronisation drains the GPU's queue and leaves it idle until the host catches up.
    """

    def __init__(self, device: Any = None, *, timed: bool = True) -> None:
        self.ms: dict[str, float] = {}
        self.device = device
        self.timed = timed

    def _sync(self) -> None:
        device = self.device
        if device is not None and torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if not self.timed:
            yield
            return
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


@dataclass(frozen=True)
class Timed(Generic[T]):
    """One feed of :func:`alternating_medians`: what it returned in its last timed round, per-stage medians."""

    value: T
    medians_ms: dict[str, float]  # stage -> median over the timed rounds, in the order the feed ran its stages
    rounds: int


def alternating_medians(
    feeds: Sequence[Callable[[StageClock], T]], repeats: int, *, warmup: int = 1, device: Any = None
) -> list[Timed[T]]:
    """Time feeds against each other fairly: ``warmup`` untimed rounds over every feed first (first-call costs --
    allocations, kernel selection, CUDA-graph capture -- stay out of the times), then ``repeats`` timed rounds,
    forward and backward in turn so that no feed always runs first; per-stage medians.

    Each feed times its own stages on the :class:`StageClock` it is given (``with clock("prefill"): ...``) and
    returns a value; one result per feed, in the order given.
    """
    if repeats < 1:
        raise CareError(f"must be at least 1, got {repeats}", parameter="repeats")
    if warmup < 0:
        raise CareError(f"must be at least 0, got {warmup}", parameter="warmup")
    for _ in range(warmup):
        for feed in feeds:
            feed(StageClock(device))
    samples: list[dict[str, list[float]]] = [{} for _ in feeds]
    values: list[Any] = [None for _ in feeds]
    order = list(range(len(feeds)))
    for round_index in range(repeats):
        for i in order if round_index % 2 == 0 else order[::-1]:
            clock = StageClock(device)
            values[i] = feeds[i](clock)
            for stage, ms in clock.ms.items():
                samples[i].setdefault(stage, []).append(ms)
    return [Timed(values[i], {stage: median_ms(ms) for stage, ms in samples[i].items()}, repeats) for i in order]
