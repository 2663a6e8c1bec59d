"""Bounded memos (care_core/_memo.py)."""

from __future__ import annotations

from collections.abc import Callable

from care_core._memo import recall, remember


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
