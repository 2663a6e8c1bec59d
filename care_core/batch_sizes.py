"""Batch sizes for data-set runs: parsing ``batch_size``, the device's default, out-of-memory splitting and failing
items isolated.

One definition each, read by ``care eval``, ``care csr --data`` and the lmms-eval plugin:

* :func:`parse_batch_size`: a whole number >= 1, ``"auto"`` or lmms-eval's ``"auto:N"``, read once where a run is
  set up into a :class:`BatchSize` that is passed down as it is;
* :func:`choose_batch_size`: a :class:`BatchSize` resolved for one setting on a loaded backbone (auto: the device
  rule of :func:`default_batch_size`, docs/design/batches.md §Batch size);
* :class:`Batches`: items answered in chunks; a chunk that runs out of GPU memory is split in halves and retried,
  and the size that fits is kept for the chunks that follow; a chunk that fails otherwise is split the same way
  until the failing item is alone, which then gives its caller's stand-in result (:meth:`Batches.run`'s
  ``on_failure``) while every other item keeps its own.

No torch at import (``care --help`` reads the option's help from here).
"""

from __future__ import annotations

import gc
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from care_core.errors import CareError
from care_core.vocabulary import BATCH_BUCKETS

if TYPE_CHECKING:
    from care_core.backbones.base import VLMAdapter
    from care_core.budget import Budget

T = TypeVar("T")
R = TypeVar("R")

AUTO = "auto"
#: the default on a CPU: decoding reads every weight once per step for the whole batch, so a few samples share
#: that read; more adds padding (samples finish at different steps) and coarser progress and saves for little gain
CPU_BATCH_SIZE = 4
#: auto never picks more than this (nor less than 1)
MAX_BATCH_SIZE = 64
#: the estimate's assumptions: text tokens of the prompt (template + question) and the reference image, about
#: 1 megapixel (larger images are caught by out-of-memory splitting)
PROMPT_TOKENS = 128
REFERENCE_IMAGE_SIDE = 1008
#: share of the free memory auto plans to fill, and what it leaves aside first: the scoring engines' largest
#: intermediates (two chunks of care_core._chunks.CHUNK_ELEMENTS float32 values, 512 MiB)
MEMORY_SHARE = 0.8
RESERVED_BYTES = 2 * (1 << 26) * 4


@dataclass(frozen=True)
class BatchSize:
    """``batch_size`` as a run was asked for it (:func:`parse_batch_size` reads the text): a fixed number, or auto
    (``fixed`` None: the device rule's pick for each setting, at most ``cap`` where given; a fixed size has no cap)."""

    fixed: int | None = None
    cap: int | None = None

    def __post_init__(self) -> None:
        for name, value in (("batch_size", self.fixed), ("max_batch_size", self.cap)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise CareError(f"must be a whole number >= 1, got {value!r}", parameter=name)

    @property
    def is_auto(self) -> bool:
        return self.fixed is None

    def resolve(self, default: int) -> int:
        """The size used where the device rule picks ``default``: the fixed number, or ``default`` up to the cap."""
        if self.fixed is not None:
            return self.fixed
        return default if self.cap is None else min(default, self.cap)

    def at_most(self, size: int) -> BatchSize:
        """What a setting whose batches were split down to ``size`` hands on to the next: a fixed number no larger
        than ``size`` (the memory pressure of one model persists); auto is picked again for each setting."""
        return self if self.fixed is None else BatchSize(min(self.fixed, size))

    def to_json(self) -> int | str:
        """The number, or ``"auto"`` (a report's ``requested``)."""
        return AUTO if self.fixed is None else self.fixed


def parse_batch_size(value: object, *, cap: object = None) -> BatchSize:
    """The one reader of ``batch_size`` as given (an int, or text: ``"8"``, ``"auto"``, ``"auto:N"``) and of auto's
    ``cap`` (lmms-eval's ``max_batch_size``: None or a whole number >= 1). lmms-eval's ``auto:N`` (re-pick N times
    in lm-eval-harness) is auto here: the size is picked once and out-of-memory splitting adapts it. CareError (one
    line) for anything else."""
    return BatchSize(_whole_number_or_auto(value), None if cap is None else _cap(cap))


def _whole_number_or_auto(value: object) -> int | None:
    """``value`` as a whole number >= 1, or None for auto."""
    text = str(value).strip().lower() if isinstance(value, (str, int)) and not isinstance(value, bool) else None
    if text is not None:
        if text == AUTO or (text.startswith(AUTO + ":") and text[5:].isdigit() and int(text[5:]) >= 1):
            return None
        if text.lstrip("+").isdigit() and int(text) >= 1:
            return int(text)
    raise CareError(f"must be a whole number >= 1, 'auto' or 'auto:N', got {value!r}", parameter="batch_size")


def _cap(value: object) -> int:
    text = str(value).strip() if isinstance(value, (str, int)) and not isinstance(value, bool) else ""
    if not (text.lstrip("+").isdigit() and int(text) >= 1):
        raise CareError(f"must be a whole number >= 1, got {value!r}", parameter="max_batch_size")
    return int(text)


@dataclass(frozen=True)
class BatchChoice:
    """The batch size a run (or one setting of it) starts with, and where it came from."""

    size: int  # the batch size used (before any out-of-memory split)
    requested: BatchSize  # what was asked for
    default: int  # what the device rule (default_batch_size) picks

    def to_dict(self) -> dict[str, Any]:
        return {"batch_size": self.size, "requested": self.requested.to_json(), "default": self.default}


def choose_batch_size(
    requested: BatchSize,
    adapter: VLMAdapter,
    *,
    max_new_tokens: int | None,
    attention_layers: int = 0,
    budget: Budget | None = None,
) -> BatchChoice:
    """The one place a batch size is resolved: ``requested`` on ``adapter`` for one setting, with the default the
    device rule picks (:func:`default_batch_size`, computed either way, for the run's report). ``attention_layers``:
    how many language-model layers' attention maps a method reads (FastV, SparseVLM: ``Method.attention_layers``),
    which every sample of a batch holds (:func:`sample_bytes`); ``budget``: the setting's, whose answers read only
    the kept tokens (None: all of them)."""
    default = default_batch_size(adapter, max_new_tokens=max_new_tokens, attention_layers=attention_layers,
                                 budget=budget)  # fmt: skip
    return BatchChoice(requested.resolve(default), requested, default)


def default_batch_size(
    adapter: VLMAdapter,
    *,
    max_new_tokens: int | None,
    prompt_tokens: int = PROMPT_TOKENS,
    attention_layers: int = 0,
    budget: Budget | None = None,
) -> int:
    """The batch size ``auto`` picks for ``adapter`` (docs/design/batches.md §Batch size): :data:`CPU_BATCH_SIZE`
    off CUDA; on CUDA the free memory over :func:`sample_bytes` for the visual tokens of a reference image, in [1, 64].
    ``max_new_tokens`` None: no answers (CSR), the language model does not run. ``budget``: the answers read only
    the tokens a method keeps (None: all of them)."""
    if adapter.device.type != "cuda":
        return CPU_BATCH_SIZE
    import torch
    from PIL import Image

    side = REFERENCE_IMAGE_SIDE
    with torch.no_grad():
        visual_tokens = adapter.encode_images([Image.new("RGB", (side, side), (128, 128, 128))])[0].num_tokens
    fed = budget.resolve_at_most(visual_tokens) if budget is not None else None
    per_sample = sample_bytes(adapter.model.config, visual_tokens=visual_tokens, prompt_tokens=prompt_tokens,
                              max_new_tokens=max_new_tokens, dtype_bytes=adapter.dtype.itemsize,
                              attention_layers=attention_layers, fed_tokens=fed)  # fmt: skip
    return batch_size_for(free_cuda_bytes(adapter.device), per_sample)


def batch_size_for(free_bytes: int, per_sample_bytes: int) -> int:
    """floor((MEMORY_SHARE * free - RESERVED_BYTES) / per sample), clamped to [1, MAX_BATCH_SIZE], then down to a
    batch bucket of the static decoder (a batch of 20 would decode in a bucket of 32: 60% more cache than counted)."""
    room = MEMORY_SHARE * free_bytes - RESERVED_BYTES
    fits = max(1, min(MAX_BATCH_SIZE, math.floor(room / max(1, per_sample_bytes))))
    return max(bucket for bucket in BATCH_BUCKETS if bucket <= fits)


def sample_bytes(
    config: Any,
    *,
    visual_tokens: int,
    prompt_tokens: int,
    max_new_tokens: int | None,
    dtype_bytes: int,
    attention_layers: int = 0,
    fed_tokens: int | None = None,
) -> int:
    """Memory one sample needs beyond the weights (a config with ``text_config``/``vision_config`` or flat):

    KV cache 2 L_t H_kv d_h (T + K + new) + prefill activations (T + K)(4 d_t + 2 I_t) + vision tower
    N_v ((L_v + 1) d_v + 2 I_v), times the LM dtype's bytes; N_v = N s^2 (s: the tower's spatial merge, 1 without);
    K = ``fed_tokens``, the visual rows the answer reads (None: all N). ``max_new_tokens`` None: no answers, so no KV
    cache. K < N (a method reduces): plus the reduction's float32 working set N (N + 4 d_t) · 4 bytes (an N x N
    affinity and four copies of the N projected rows). ``attention_layers`` a > 0 (a method reads the language-model
    probe's attention maps of layers 0..a-1): the probe's prefill activations over T + N and float32 maps
    (a + 1) H (T + N)^2 · 4 bytes (the a kept, which every sample of a batch holds until its methods have run, and
    the layer being computed).
    """
    text = getattr(config, "text_config", None) or config
    vision = getattr(config, "vision_config", None)
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    fed = visual_tokens if fed_tokens is None else min(int(fed_tokens), visual_tokens)
    full, answered = prompt_tokens + visual_tokens, prompt_tokens + fed
    kv = prefill = attention_maps = reduction = 0
    if max_new_tokens is not None:
        kv = 2 * int(text.num_hidden_layers) * kv_heads * head_dim * (answered + max_new_tokens)
        prefill = answered * (4 * int(text.hidden_size) + 2 * int(text.intermediate_size))
    if attention_layers > 0:  # the probe's prefill runs over every token
        prefill = full * (4 * int(text.hidden_size) + 2 * int(text.intermediate_size))
        attention_maps = (min(attention_layers, int(text.num_hidden_layers)) + 1) * heads * full**2 * 4
    if fed < visual_tokens:
        reduction = visual_tokens * (visual_tokens + 4 * int(text.hidden_size)) * 4
    tower = 0
    if vision is not None:
        merge = int(getattr(vision, "spatial_merge_size", None) or 1)
        layers = int(getattr(vision, "num_hidden_layers", 0) or getattr(vision, "depth", 0))
        width = int(getattr(vision, "hidden_size", 0) or getattr(vision, "embed_dim", 0))
        tower = visual_tokens * merge**2 * ((layers + 1) * width + 2 * int(getattr(vision, "intermediate_size", 0)))
    return (kv + prefill + tower) * dtype_bytes + attention_maps + reduction


def free_cuda_bytes(device: Any) -> int:
    """Free memory of a CUDA device, counting what torch's caching allocator holds but does not use."""
    import torch

    free, _total = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def reset_peak_gpu_memory(device: Any) -> None:
    """Start a new peak for :func:`peak_gpu_memory_gib` on a CUDA ``device`` (nothing elsewhere)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gpu_memory_gib(device: Any) -> float | None:
    """The most memory torch's allocator held for tensors on a CUDA ``device`` since the last
    :func:`reset_peak_gpu_memory`, in GiB; None off CUDA."""
    import torch

    if torch.device(device).type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / (1 << 30)


def is_out_of_memory(exc: BaseException) -> bool:
    """A CUDA out-of-memory error (torch's OutOfMemoryError, or a RuntimeError saying "out of memory")."""
    if isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower():
        return True

    torch = sys.modules.get("torch")
    return torch is not None and isinstance(exc, torch.cuda.OutOfMemoryError)


def free_memory() -> None:
    """Drop what a failed attempt left: unreachable tensors, then torch's cached CUDA blocks."""
    import torch

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class Batches:
    """Items run in chunks of :attr:`size`, with out-of-memory splitting and failing items isolated; the caller owns
    it across calls.

    :meth:`run` cuts the items into chunks; a chunk whose run raises a CUDA out-of-memory error is split in two
    halves, each retried (recursively, after freeing the cache), and from then on :attr:`size` is at most the half
    (the size that fits is kept for the following chunks; it never grows back, since the memory pressure of one
    model on similar inputs persists). ``on_notice`` is called once, the first time a chunk is split. A single item
    that runs out of memory raises a one-line CareError naming the batch size and the device.

    A chunk that raises any other error is split in halves the same way where :meth:`run` has an ``on_failure``
    (without changing :attr:`size`: one bad item says nothing about the memory), down to the item that fails
    alone; ``on_failure(item, error)`` gives that item's result (or raises). Without ``on_failure`` the error is
    raised as it is. KeyboardInterrupt is never caught.
    """

    def __init__(self, size: int, *, device: object = "cuda", on_notice: Callable[[str], None] | None = None) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"a batch size is a whole number >= 1, got {size!r}")
        self.size = size
        self.requested = size
        self.device = str(device)
        self.on_notice = on_notice
        self.splits = 0

    def run(
        self,
        items: Sequence[T],
        work: Callable[[list[T]], list[R]],
        on_done: Callable[[list[T], list[R]], None] | None = None,
        on_failure: Callable[[T, Exception], R] | None = None,
    ) -> list[R]:
        """``work`` on every item, in chunks; the results in input order. ``on_done(chunk, results)`` after every
        chunk that finished whole (what a caller persists), each item exactly once; an item that failed alone comes
        to ``on_done`` as a chunk of one with ``on_failure``'s result."""
        calls = _Calls(work, on_done, on_failure)
        out: list[R] = []
        start = 0
        while start < len(items):
            chunk = list(items[start : start + self.size])
            out.extend(self._attempt(chunk, calls))
            start += len(chunk)
        return out

    def _attempt(self, chunk: list[T], calls: _Calls[T, R]) -> list[R]:
        results: list[R] | None = None
        failure: Exception | None = None
        out_of_memory = False
        try:
            results = list(calls.work(chunk))
        except Exception as exc:
            out_of_memory = is_out_of_memory(exc)
            if not out_of_memory and calls.on_failure is None:
                raise
            if out_of_memory and len(chunk) == 1:
                split = f"{self.requested} split down to 1" if self.requested > 1 else "1"
                raise CareError(f"out of memory on {self.device} even for one sample at a time ({{batch_size}} "
                                f"{split}): {type(exc).__name__}") from exc  # fmt: skip
            if len(chunk) == 1:
                failure = exc  # handed on below, outside the except block (no traceback kept beyond on_failure)
        if results is None and failure is None:  # outside the except block: the error's frames are released
            free_memory()
            return self._split(chunk, calls, shrink=out_of_memory)
        if results is None:
            assert failure is not None and calls.on_failure is not None
            results = [calls.on_failure(chunk[0], failure)]
            del failure  # its frames (and their tensors) go with it
            free_memory()
        if len(results) != len(chunk):
            raise RuntimeError(f"a batch of {len(chunk)} items gave {len(results)} results")
        if calls.on_done is not None:
            calls.on_done(chunk, results)
        return results

    def _split(self, chunk: list[T], calls: _Calls[T, R], *, shrink: bool) -> list[R]:
        """Both halves of ``chunk`` in order; with ``shrink`` (out of memory) :attr:`size` at most the first half's
        from now on."""
        half = (len(chunk) + 1) // 2
        if shrink:
            self.size = min(self.size, half)
            self.splits += 1
            if self.splits == 1 and self.on_notice is not None:
                self.on_notice(f"out of memory on {self.device} with a batch of {len(chunk)}: splitting batches in "
                               f"halves, continuing with at most {half} per batch")  # fmt: skip
        return self._attempt(chunk[:half], calls) + self._attempt(chunk[half:], calls)


@dataclass(frozen=True)
class _Calls(Generic[T, R]):
    """What one :meth:`Batches.run` calls back."""

    work: Callable[[list[T]], list[R]]
    on_done: Callable[[list[T], list[R]], None] | None
    on_failure: Callable[[T, Exception], R] | None
