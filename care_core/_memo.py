"""Bounded memos that objects keep of pure functions (an adapter's prompt ids and geometries, a scorer's
directions): one insertion rule for all of them, and :class:`Memos` for an owner that keeps several kinds."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, TypeVar, cast

if TYPE_CHECKING:  # torch is not imported at start-up (care --help)
    import torch

K = TypeVar("K")
V = TypeVar("V")
#: what a memo keyed on a tensor's contents compares: (data pointer, version counter, dtype, device)
TensorState = tuple[int, int, "torch.dtype", "torch.device"]


def tensor_state(tensor: torch.Tensor) -> TensorState:
    """(data pointer, version counter, dtype, device) of ``tensor``: what a move, cast, replacement or in-place edit
    changes, so a memo of what was computed from it can tell when that went stale (-1 as the version of an inference
    tensor, which keeps no counter)."""
    try:
        version = tensor._version
    except RuntimeError:
        version = -1
    return tensor.data_ptr(), version, tensor.dtype, tensor.device


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


class Memos:
    """Bounded memos of several kinds of entry that one owner keeps (an adapter's geometries: crop counts, token
    layouts, their copies on the device): each kind its own memo of at most ``limit`` entries, so the entries of one
    kind never push out those of another."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._kinds: dict[str, dict[Hashable, Any]] = {}

    def recall(self, kind: str, key: Hashable, compute: Callable[[], V]) -> V:
        """:func:`recall` in the memo of ``kind``."""
        return cast(V, recall(self._kinds.setdefault(kind, {}), key, compute, self.limit))

    def sizes(self) -> dict[str, int]:
        """Entries held per kind."""
        return {kind: len(memo) for kind, memo in self._kinds.items()}
