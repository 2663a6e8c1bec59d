"""Bounded memos that objects keep of pure functions (an adapter's prompt ids and geometries, a scorer's
directions): one insertion rule for all of them."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


def remember(memo: dict[K, V], key: K, value: V, limit: int) -> V:
    """Store ``value`` under ``key`` in ``memo``, dropping the oldest entry first when it holds ``limit``; returns
    ``value``. A data set repeats a few keys, so the oldest entry is the one least likely to come back."""
    if len(memo) >= limit:
        memo.pop(next(iter(memo)))
    memo[key] = value
    return value


def recall(memo: dict[K, V], key: K, compute: Callable[[], V], limit: int) -> V:
    """``memo[key]``, computed by ``compute()`` and :func:`remember`-ed on a miss."""
    if key in memo:
        return memo[key]
    return remember(memo, key, compute(), limit)
