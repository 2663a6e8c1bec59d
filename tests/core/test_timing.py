"""The timing protocol: warm-ups first, then rounds in alternating order, medians per stage."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from care_core.errors import CareError
from care_core.timing import StageClock, alternating_medians


class _Feeds:
    """Feeds whose stage times are set by hand through a fake clock: the i-th call of the process costs ``cost(i)``."""

    def __init__(self, names: list[str], first_cost_ms: float) -> None:
        self.names = names
        self.calls: list[str] = []
        self.first_cost_ms = first_cost_ms

    def feed(self, name: str) -> Callable[[StageClock], str]:
        def run(clock: StageClock) -> str:
            cost = self.first_cost_ms if not self.calls else 2.0 + len(self.calls) % 3  # 2, 3 or 4 ms
            self.calls.append(name)
            clock.ms["step"] = clock.ms.get("step", 0.0) + cost  # a stage of known length
            return f"{name} after {len(self.calls)} calls"

        return run


def test_warm_up_then_alternating_rounds_then_medians() -> None:
    feeds = _Feeds(["a", "b", "c"], first_cost_ms=300.0)
    timed = alternating_medians([feeds.feed(n) for n in feeds.names], repeats=3)
    assert feeds.calls[:3] == ["a", "b", "c"]  # the warm-up round, untimed
    assert feeds.calls[3:] == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]  # no feed always goes first
    # calls 3..11 cost 2 + (call index % 3): a gets calls 3, 8, 9 -> 2, 4, 2 ms; b 4, 7, 10 -> 3, 3, 3; c 5, 6, 11
    assert [t.medians_ms["step"] for t in timed] == [2.0, 3.0, 4.0]
    assert [t.value for t in timed] == ["a after 10 calls", "b after 11 calls", "c after 12 calls"]
    assert all(t.rounds == 3 for t in timed)  # the cold 300 ms call was the warm-up: in no median


def test_no_warm_up_and_bad_repeats() -> None:
    feeds = _Feeds(["a", "b"], first_cost_ms=300.0)
    timed = alternating_medians([feeds.feed(n) for n in feeds.names], repeats=1, warmup=0)
    assert feeds.calls == ["a", "b"] and timed[0].medians_ms["step"] == 300.0
    with pytest.raises(CareError, match="repeats must be at least 1"):
        alternating_medians([feeds.feed("a")], repeats=0)


def test_a_timed_clock_on_cuda_synchronises_around_each_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    clock = StageClock("cuda")
    with clock("scoring"):
        pass
    assert calls == ["cuda", "cuda"] and list(clock.ms) == ["scoring"]


def test_an_untimed_clock_records_nothing_and_never_synchronises(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(device: object = None) -> None:
        raise AssertionError("an untimed clock synchronised")

    monkeypatch.setattr(torch.cuda, "synchronize", refuse)
    clock = StageClock("cuda", timed=False)
    with clock("method"), clock("scoring"):
        pass
    with pytest.raises(ValueError, match="inside"), clock("csr"):  # what the stage raises goes through
        raise ValueError("inside")
    assert clock.ms == {}
