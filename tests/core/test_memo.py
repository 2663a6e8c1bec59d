"""Bounded memos (care_core/_memo.py)."""

from __future__ import annotations

from collections.abc import Callable

from care_core._memo import Memos, recall, remember


def test_a_full_memo_drops_its_oldest_entry_and_returns_the_value() -> None:
    memo: dict[str, int] = {}
    assert [remember(memo, key, value, 2) for key, value in (("a", 1), ("b", 2), ("c", 3))] == [1, 2, 3]
    assert memo == {"b": 2, "c": 3}


def test_recall_computes_only_on_a_miss_and_keeps_the_limit() -> None:
    memo: dict[str, int] = {}
    calls: list[str] = []

    def computing(key: str, value: int) -> Callable[[], int]:
        def computed() -> int:
            calls.append(key)
            return value

        return computed

    got = [recall(memo, key, computing(key, value), 2)
           for key, value in (("a", 1), ("a", 9), ("b", 2), ("c", 3), ("a", 4))]  # fmt: skip
    assert got == [1, 1, 2, 3, 4]  # the second "a" is the kept 1; the last "a" was dropped when "c" came
    assert calls == ["a", "b", "c", "a"] and memo == {"c": 3, "a": 4}


def test_each_kind_of_memo_keeps_its_own_limit() -> None:
    """Entries of one kind never push out another kind's: three kinds of two entries each in a Memos of limit 2."""
    memos = Memos(2)
    for kind in ("crops", "geometry", "device"):
        for key in (1, 2):
            assert memos.recall(kind, key, lambda kind=kind, key=key: f"{kind}{key}") == f"{kind}{key}"
    assert memos.sizes() == {"crops": 2, "geometry": 2, "device": 2}
    assert memos.recall("crops", 1, lambda: "computed again") == "crops1"  # still held
    assert memos.recall("crops", 3, lambda: "crops3") == "crops3"
    assert memos.recall("crops", 1, lambda: "computed again") == "computed again"  # the oldest went for 3
    assert memos.sizes() == {"crops": 2, "geometry": 2, "device": 2}
