"""One image's reduction replayed from a captured CUDA graph (docs/design/generation.md §Reduction graphs).

On a GPU, CaRe's single-image reduction (Eq. 1–9) is a few hundred small launches -- the scoring chunks, the robust
z-scores, the Eq. 3 greedy, the calibration -- and the host spends longer launching them than the GPU spends running
them. :class:`ReductionGraphs` captures such a computation per key once the key comes back (its
:data:`CAPTURE_ON_SIGHTING`-th call), and from then on copies the call's inputs into the graph's static inputs and
replays it: one launch for the host instead of hundreds. A key seen only once (a Qwen image's N follows its size, so
varied images rarely repeat a key) runs eagerly and pays no capture that would never be replayed.

What it keeps per captured key (at most :data:`MAX_GRAPHS`, least recently used dropped first): the static inputs,
the static outputs and the graph; all graphs of a device share one private memory pool (the peak of their
intermediates); and the keys seen but not yet captured (at most :data:`MAX_SEEN_KEYS`, no tensors). The owner
releases them with :meth:`ReductionGraphs.release`. It decides nothing about *when* a computation may be
replayed: the caller gives a key naming everything the computation's shapes and constants depend on
(:func:`care_core.care.graph_key`) and calls only where replaying is allowed (:func:`care_core.care.graph_reason`).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from care_core.batch_sizes import free_memory, is_out_of_memory
from care_core.errors import one_line

T = TypeVar("T")

MAX_GRAPHS = 8  # keys whose graph is kept (budgets x methods of one image's timed answers fit)
#: the call with a key that captures it: the second, i.e. once the key has come back -- a capture costs a second
#: eager launch sequence, the graph's instantiation and pool memory, worth paying only for a key that is replayed
CAPTURE_ON_SIGHTING = 2
#: keys seen but not captured yet that are remembered (least recently seen forgotten first). A key is a short tuple
#: of shapes and settings, no tensors, so 256 take little memory; a key that returns within 256 other new keys (far
#: more shapes than MAX_GRAPHS graphs hold) is still recognised; and a long run of ever-new keys (a data set of
#: varied image sizes) cannot grow the record without end
MAX_SEEN_KEYS = 256


@dataclass
class _Entry:
    """A captured key: its static inputs and outputs, the graph, and what the graph reads outside its pool."""

    inputs: tuple[torch.Tensor, ...]
    outputs: Any
    graph: Any
    held: object  # kept alive as long as the graph: tensors it reads that the caller could otherwise free


class ReductionGraphs:
    """Captured CUDA graphs of single-image reductions, by key; owned by the caller (a
    :class:`~care_core.pipeline.ReductionPipeline` keeps one), never module state. One object per thread.

    :meth:`run` with a key: calls before its :data:`CAPTURE_ON_SIGHTING`-th run ``step`` plainly (on the current
    stream, nothing copied), each counted. The :data:`CAPTURE_ON_SIGHTING`-th runs ``step`` eagerly on fresh static
    inputs on a side stream (its result is the call's: that run also warms cuBLAS and autotunes the Triton kernels for
    these shapes on the stream the capture uses), then captures ``step`` into a graph. Later calls copy their inputs
    into the static inputs, replay, and return clones of the static outputs: the same kernels in the same order as
    the eager run, so bitwise its result on the same card (bfloat16 products may be summed in another order on the
    side stream than on the caller's: the same tokens, scores within float32 rounding; docs/design/generation.md).
    A key whose graph is dropped (:data:`MAX_GRAPHS`) is forgotten: it is captured again at its
    :data:`CAPTURE_ON_SIGHTING`-th call from then (keys cycling through more shapes than the graphs hold pay a capture
    on one call in :data:`CAPTURE_ON_SIGHTING`, not on every call).
    A capture that fails (an operation a graph cannot hold) is recorded in :attr:`failures` and that key runs eagerly
    from then on; an out-of-memory error during a capture releases every graph and the pool, then propagates.
    """

    def __init__(self) -> None:
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._failures: dict[Hashable, str] = {}
        # key -> calls so far, for keys not captured yet (at most MAX_SEEN_KEYS). A key names its scorer by id and
        # holds no reference to it, so a new scorer at a freed one's address may find its key "seen": that only
        # captures it one call early (the capture itself holds the new scorer), never replays a wrong graph
        self._sightings: OrderedDict[Hashable, int] = OrderedDict()
        self._pools: dict[torch.device, Any] = {}
        self._streams: dict[torch.device, Any] = {}
        self.captures = 0  # graphs captured so far (for tests and reports)
        self.replays = 0  # calls answered by a replay

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def failures(self) -> dict[Hashable, str]:
        """Keys whose capture failed -> why (one line); they run eagerly."""
        return dict(self._failures)

    def release(self) -> None:
        """Drop every graph, its static tensors and the memory pools, and forget the keys seen (the next block of
        work starts fresh: a key is captured at its :data:`CAPTURE_ON_SIGHTING`-th call from now); recorded
        failures and the side streams (no memory of their own) are kept."""
        had = bool(self._entries or self._pools)
        self._entries.clear()
        self._pools.clear()
        self._sightings.clear()
        if had:
            free_memory()

    def run(
        self,
        key: Hashable,
        inputs: Sequence[torch.Tensor],
        step: Callable[[tuple[torch.Tensor, ...]], T],
        held: Callable[[], object] = lambda: None,
    ) -> T:
        """``step(inputs)``: eagerly until the :data:`CAPTURE_ON_SIGHTING`-th call with ``key`` (which captures it),
        replayed later.

        ``inputs``: CUDA tensors of the shapes, dtypes and device the key names (copied into the static inputs).
        ``step``: the computation on its inputs, launching no host synchronisation and no host-to-device copy, its
        outputs tensors (in dataclasses or tuples, as deep as needed) that do not alias its inputs. ``held()``:
        what the graph reads besides its inputs and pool that must outlive it (called once, after the eager run).
        """
        if key in self._failures:
            return step(tuple(inputs))
        entry = self._entries.get(key)
        if entry is None:
            if self._sighted(key) < CAPTURE_ON_SIGHTING:
                return step(tuple(inputs))
            return self._run_and_capture(key, inputs, step, held)
        self._entries.move_to_end(key)
        with torch.no_grad():  # the static inputs never join an autograd graph, whatever the inputs require
            for static, value in zip(entry.inputs, inputs, strict=True):
                static.copy_(value)
        entry.graph.replay()
        self.replays += 1
        return _cloned(entry.outputs, {})

    def _sighted(self, key: Hashable) -> int:
        """Count a call with ``key`` (not captured): the calls with it so far, this one included. A key that reaches
        :data:`CAPTURE_ON_SIGHTING` is forgotten here (it is captured now, or failed and runs eagerly)."""
        count = self._sightings.pop(key, 0) + 1
        if count < CAPTURE_ON_SIGHTING:
            self._sightings[key] = count  # the most recently seen
            while len(self._sightings) > MAX_SEEN_KEYS:
                self._sightings.popitem(last=False)
        return count

    def _run_and_capture(
        self,
        key: Hashable,
        inputs: Sequence[torch.Tensor],
        step: Callable[[tuple[torch.Tensor, ...]], T],
        held: Callable[[], object],
    ) -> T:
        """The eager run on fresh static inputs (this call's result), then the capture."""
        with torch.no_grad():
            statics = tuple(torch.empty_like(x, memory_format=torch.contiguous_format).copy_(x) for x in inputs)
        device = statics[0].device
        with self._side_stream(device):
            result = step(statics)
        try:
            with self._side_stream(device):
                graph, outputs = self._capture(statics, step, device)
        except Exception as exc:  # any failure to capture means: eager for this key
            if is_out_of_memory(exc):  # not the computation's fault: make room, and the caller splits or reports
                self.release()
                raise
            self._failures[key] = f"capturing the reduction failed ({type(exc).__name__}: {one_line(exc)})"
            return result
        self._entries[key] = _Entry(statics, outputs, graph, held())
        while len(self._entries) > MAX_GRAPHS:
            self._entries.popitem(last=False)
        return result

    @contextmanager
    def _side_stream(self, device: torch.device) -> Iterator[None]:
        """Work inside runs on this object's side stream of ``device``, ordered after everything queued before it
        and before everything queued after it on the current stream (a capture needs a stream other than the
        default one; the eager run uses the same stream so that the capture finds it warmed)."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        current = torch.cuda.current_stream(device)
        stream.wait_stream(current)
        # the eager run's outputs are allocated on this stream and used on the current one: a block they free is
        # reused only by later work on this stream, which waits for the current stream's queue first (above)
        try:
            with torch.cuda.stream(stream):
                yield
        finally:
            current.wait_stream(stream)

    def _capture(
        self, statics: tuple[torch.Tensor, ...], step: Callable[[tuple[torch.Tensor, ...]], T], device: torch.device
    ) -> tuple[Any, T]:
        """``step`` on the static inputs captured into a graph in the device's pool (recorded, not run); the graph
        and its static outputs."""
        pool = self._pools.get(device)
        if pool is None:
            pool = self._pools[device] = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # capture_begin/end rather than torch.cuda.graph(), whose entry empties the caching allocators (as
        # care_core.backbones.static_generation does it)
        graph.capture_begin(pool=pool)
        try:
            outputs = step(statics)
        finally:
            graph.capture_end()
        self.captures += 1
        return graph, outputs


def _cloned(value: T, seen: dict[int, torch.Tensor]) -> T:
    """``value`` with every tensor cloned (once per tensor: outputs that were one tensor stay one), through
    dataclasses and tuples: the static outputs are overwritten by the next replay."""
    if isinstance(value, torch.Tensor):
        if id(value) not in seen:
            seen[id(value)] = value.clone()
        return seen[id(value)]  # type: ignore[return-value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: _cloned(getattr(value, f.name), seen) for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **changes)  # type: ignore[type-var]
    if isinstance(value, tuple):
        return type(value)(_cloned(item, seen) for item in value)  # type: ignore[return-value]
    return value
