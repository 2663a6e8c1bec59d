"""Inputs prepared ahead: a data-set run's next batch is opened and preprocessed while the current one runs.

A data-set run (``care csr --data``, ``care eval``) drives the device from one thread. Opening, decoding and
preprocessing an image is host work that would otherwise sit between two batches while the device waits:

* :class:`Prefetcher` prepares items on background threads; :meth:`Prefetcher.inputs` hands out a chunk's prepared
  items and starts the next ``ahead`` ones (docs/design/batches.md §Batch size, "Inputs");
* :func:`image_preparer` prepares one image for an adapter: through the image processor where the adapter runs it
  one image at a time (on a GPU in the adapter's worker processes,
  :mod:`care_core.backbones.preprocess_pool`), into a :class:`PreparedImage` (its pixels pinned on a GPU);
* :func:`encoded_inputs` turns a batch of images and prepared images into what
  :meth:`care_core.pipeline.ReductionPipeline.run_batch` takes: one vision-tower pass for the prepared ones;
* :func:`image_prefetcher` puts these together for an adapter, with the GIL handed to the driving thread sooner
  (:func:`gil_switch_interval`).

Per image the tokens are exactly those ``adapter.encode_images`` gives (the same processor call per image, the same
collate and tower pass).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from PIL import Image

    from care_core.backbones.base import ImageTokens, VLMAdapter

#: the thread switch interval while loader threads run: the thread driving the device waits at most this long for the
#: GIL after each call that released it (a kernel launch, a copy). At the default 5 ms, loader threads running Python
#: (decoding images, receiving the processor pool's outputs) left the device idle for milliseconds at a time.
LOADER_SWITCH_INTERVAL_S = 0.0005

T = TypeVar("T")  # an item of the run (a request, a pair)
R = TypeVar("R")  # what preparing it gives


class Prefetcher(Generic[T, R]):
    """``prepare`` on the items of ``order``, on ``workers`` background threads, each item once and ahead of need.

    Items are told apart by ``key(item)`` (default: the item itself), unique within ``order``. A chunk asked for by
    :meth:`inputs` may be any run of ``order``, also part of one asked for before (a batch split after running out
    of memory): what was started is reused until :meth:`release`. An item whose ``prepare`` raised raises that
    error whenever it is asked for; the other items, and the threads, are unaffected. Use it as a context manager:
    leaving it waits for the running preparations and cancels the rest.
    """

    def __init__(
        self,
        prepare: Callable[[T], R],
        order: Sequence[T],
        workers: int,
        *,
        key: Callable[[T], Hashable] | None = None,
    ) -> None:
        self._prepare = prepare
        self._key: Callable[[T], Hashable] = key if key is not None else _itself
        self._order = list(order)
        self._place = {self._key(item): i for i, item in enumerate(self._order)}
        self._futures: dict[Hashable, Future[R]] = {}
        self._pool = ThreadPoolExecutor(max_workers=max(1, int(workers)), thread_name_prefix="care-prefetch")

    def __enter__(self) -> Prefetcher[T, R]:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _submit(self, item: T) -> Future[R]:
        key = self._key(item)
        if key not in self._futures:
            self._futures[key] = self._pool.submit(self._prepare, item)
        return self._futures[key]

    def inputs(self, chunk: Sequence[T], ahead: int) -> list[R]:
        """The chunk's prepared items in its order (waiting for them; the first failed item's error is raised);
        first the ``ahead`` items of ``order`` after the chunk start preparing."""
        if not chunk:
            return []
        futures = [self._submit(item) for item in chunk]
        last = self._place[self._key(chunk[-1])]
        for item in self._order[last + 1 : last + 1 + max(0, ahead)]:
            self._submit(item)
        return [future.result() for future in futures]

    def release(self, chunk: Sequence[T]) -> None:
        """Forget the chunk's prepared items (a finished batch's): the memory they hold is freed."""
        for item in chunk:
            self._futures.pop(self._key(item), None)


def _itself(item: Any) -> Hashable:
    return item  # type: ignore[no-any-return]


@dataclass(frozen=True)
class PreparedImage:
    """One image after the image processor (on a loader thread): what the vision tower needs."""

    size: tuple[int, int]  # the original (height, width)
    processed: dict[str, Any]  # the image processor's outputs for this image alone


def image_preparer(adapter: VLMAdapter, *, pool: bool = True) -> Callable[[Image.Image], Image.Image | PreparedImage]:
    """The function that prepares one decoded image for ``adapter`` (safe to call from loader threads).

    Where the adapter runs its image processor one image at a time (``process_image``), the image goes through it:
    on a GPU with ``pool`` in the adapter's worker processes (``processor_pool``: the processor's Python work would
    hold the GIL against the thread driving the GPU; the pool is started here, on the calling thread, and until its
    workers are up the images are processed on the calling thread, so a run's first batch does not wait for them),
    else on the calling thread; on a GPU its pixels pinned (:func:`prepared_image`). Other adapters get the image as
    it is (they encode it in ``run_batch``).
    """
    chat: Any = adapter
    if not hasattr(chat, "process_image"):
        return _unchanged

    pin = pins_pixels(adapter)

    def here(image: Image.Image) -> Image.Image | PreparedImage:
        return prepared_image(image, chat.process_image(image), pin)

    if pool and uses_processor_pool(adapter):
        processes = chat.processor_pool()

        def through_pool(image: Image.Image) -> Image.Image | PreparedImage:
            if not processes.ready:  # its workers are still starting (seconds): this thread gives the same output
                return here(image)
            chat.check_image(image)  # ImageError here, as process_image raises it, for an image the processor refuses
            return prepared_image(image, processes.submit(image).result(), pin)

        return through_pool
    return here


def pins_pixels(adapter: VLMAdapter) -> bool:
    """Whether prepared pixels are page-locked for ``adapter``: where its device is a GPU, which copies them."""
    return adapter.device.type == "cuda"


def uses_processor_pool(adapter: VLMAdapter) -> bool:
    """Whether a run of several batches prepares ``adapter``'s images on its processor's worker processes: where it
    runs its image processor one image at a time and keeps a pool (``processor_pool``), on a GPU, whose driving
    thread the processor's Python work would otherwise hold up."""
    return pins_pixels(adapter) and hasattr(adapter, "process_image") and hasattr(adapter, "processor_pool")


def prepared_image(image: Image.Image, processed: dict[str, Any], pin: bool) -> PreparedImage:
    """``image``'s processor outputs as a :class:`PreparedImage`; with ``pin`` its floating-point tensors (the pixels)
    in page-locked memory, copied there on the loader thread. A collate's copy of pinned pixels to the GPU is queued
    and the thread goes on; from pageable memory the driving thread stages the copy through the driver's buffer,
    waiting for the work queued before it, and the device copies at a fraction of the speed."""
    if pin:
        processed = {key: value.pin_memory() if _is_pixels(value) else value for key, value in processed.items()}
    return PreparedImage((image.height, image.width), processed)


def in_flight_copies(adapter: VLMAdapter, image: Image.Image, count: int) -> list[Image.Image | PreparedImage]:
    """``count`` copies of ``image`` as a run's loader gives them (:func:`image_preparer`): processed once, each
    copy's pixels pinned on their own on a GPU; the image itself for adapters that prepare nothing.

    A warm-up's inputs (:meth:`care_core.integrations.lmms_eval.CareLMM.warm_up`). A run keeps about two batches of
    prepared images alive (one answered, the next prepared: :meth:`Prefetcher.inputs`); dropped after the warm-up,
    these copies' page-locked blocks stay in torch's pinned-memory cache, which reuses a block for any image of the
    same size class (a power of two). Allocated during a run's first batches instead, each block is a
    ``cudaHostAlloc`` on a loader thread, which holds up the driving thread's CUDA calls (issue #47: 0.2-0.4 s of a
    LLaVA-NeXT-7B pass of 516 samples, H200)."""
    chat: Any = adapter
    if not hasattr(chat, "process_image"):
        return [image] * count
    processed = chat.process_image(image)
    pin = pins_pixels(adapter)
    return [prepared_image(image, processed, pin) for _ in range(count)]


def _is_pixels(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor) and value.is_floating_point() and not value.is_pinned()


def _unchanged(image: Image.Image) -> Image.Image | PreparedImage:
    return image


def encoded_inputs(
    adapter: VLMAdapter, images: Sequence[Image.Image | PreparedImage | ImageTokens]
) -> list[Image.Image | ImageTokens]:
    """The images as ``run_batch`` takes them: the prepared ones through the vision tower in one pass (``collate``
    then ``encode_processed``), in place; the others as they are."""
    prepared = [image for image in images if isinstance(image, PreparedImage)]
    if not prepared:
        return list(images)  # type: ignore[arg-type]  # no PreparedImage among them
    import torch

    chat: Any = adapter  # only adapters with process_image prepare images (see image_preparer)
    with torch.no_grad():
        tokens = iter(chat.encode_processed(chat.collate([p.processed for p in prepared]), [p.size for p in prepared]))
    return [next(tokens) if isinstance(image, PreparedImage) else image for image in images]


@contextlib.contextmanager
def image_prefetcher(
    adapter: VLMAdapter,
    open_image: Callable[[T], Image.Image],
    order: Sequence[T],
    batch_size: int,
    *,
    key: Callable[[T], Hashable] | None = None,
) -> Iterator[Prefetcher[T, Image.Image | PreparedImage]]:
    """A :class:`Prefetcher` of each item's image, opened by ``open_image(item)`` and prepared for ``adapter``
    (:func:`image_preparer`), on one thread per image of a batch of ``batch_size`` (at most one per CPU core).

    The processor pool serves a run of more than one batch only: a single batch has nothing to overlap its
    preparation with, and starting a worker process (it imports torch) takes seconds. An item whose image fails to
    open or prepare raises that error when it is asked for. Transformers' warnings are quiet meanwhile (process-wide
    settings: set once here, around the threads).
    """
    from care_core.backbones._hf import quiet_transformers
    from care_core.backbones.chat_adapter import preprocess_workers

    prepare = image_preparer(adapter, pool=len(order) > batch_size)

    def opened(item: T) -> Image.Image | PreparedImage:
        return prepare(open_image(item))

    with (
        quiet_transformers(),
        gil_switch_interval(LOADER_SWITCH_INTERVAL_S),
        Prefetcher(opened, order, preprocess_workers(batch_size), key=key) as loader,
    ):
        yield loader


@contextlib.contextmanager
def gil_switch_interval(seconds: float) -> Iterator[None]:
    """The interpreter's thread switch interval (``sys.setswitchinterval``) at ``seconds`` inside, restored after (a
    process-wide setting: set once, around the loader threads)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(min(before, seconds))
    try:
        yield
    finally:
        sys.setswitchinterval(before)
