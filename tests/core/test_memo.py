"""Bounded memos (care_core/_memo.py)."""

from __future__ import annotations

from care_core._memo import remember


def test_a_full_memo_drops_its_oldest_entry_and_returns_the_value() -> None:
    memo: dict[str, int] = {}
    assert [remember(memo, key, value, 2) for key, value in (("a", 1), ("b", 2), ("c", 3))] == [1, 2, 3]
    assert memo == {"b": 2, "c": 3}
