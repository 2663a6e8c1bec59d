"""The image processor on worker processes, for data-set runs on a GPU (docs/design/batches.md §Batch size, "Inputs").

A Hugging Face image processor spends much of its time in Python (numpy padding and patching per crop): on threads
it holds the GIL against the thread that drives the GPU, so a batched run on a GPU waits for its inputs. A
:class:`ProcessorPool` runs :func:`process_image` on spawned worker processes instead;
per image the output is exactly what the processor gives in this process. The pool belongs to whoever made it
(``ChatAdapter.processor_pool`` keeps one per adapter); each worker keeps its copy of the image processor.
"""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

from PIL import Image

from ..images import to_rgb
from ._hf import quiet_transformers

#: most worker processes a pool starts
MAX_POOL_WORKERS = 8
#: bytes: in a worker, blocks below this come from the heap (glibc's M_MMAP_THRESHOLD; its default starts at 128 KiB)
WORKER_MMAP_THRESHOLD_BYTES = 64 << 20
#: bytes: free memory a worker's heap keeps at its top instead of returning it (glibc's M_TRIM_THRESHOLD)
WORKER_TRIM_THRESHOLD_BYTES = 256 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (glibc's malloc.h)

_worker_processor: Any = None  # in a worker process only: its copy of the image processor (set by _start)


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity where the system tells it, else every core)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def pool_workers() -> int:
    """Worker processes for a pool: :func:`usable_cores` less two (the driving thread and the image decoding),
    between 1 and :data:`MAX_POOL_WORKERS`."""
    return max(1, min(MAX_POOL_WORKERS, usable_cores() - 2))


def keep_freed_memory() -> bool:
    """This process's heap keeps what it frees for reuse (glibc's ``mallopt``, :data:`WORKER_MMAP_THRESHOLD_BYTES`,
    :data:`WORKER_TRIM_THRESHOLD_BYTES`); False where the C library has no ``mallopt`` (nothing changed).

    A worker does the same work per image on an otherwise empty heap: by default each image's buffers (megabytes)
    are mapped fresh, or freed at the heap's top and returned, and the next image faults every page in again.
    LLaVA-NeXT's processor took 20 ms an image on a worker against 7 ms in a long-running process (H200 host, issue
    #47), the difference in the calls that allocate (stack, pad, copies); with these settings a worker on a 2-core
    CPU machine took the in-process time (21.7 against 22.4 ms an image; 29.7 without)."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, WORKER_MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, WORKER_TRIM_THRESHOLD_BYTES)
    )


def _start(image_processor: Any) -> None:
    global _worker_processor  # one per worker process, owned by that process
    import torch

    torch.set_num_threads(1)  # the pool's parallelism is its processes
    keep_freed_memory()
    _worker_processor = image_processor


def process_image(image_processor: Any, image: Image.Image) -> dict[str, Any]:
    """``image_processor``'s outputs (CPU tensors) for one image, as for a list of one; touches no process-wide state,
    so worker threads may call it (wrap the calls in ``quiet_transformers()`` once, outside them)."""
    return dict(image_processor(images=to_rgb(image), return_tensors="pt"))


def _process(image: Image.Image) -> dict[str, Any]:
    with quiet_transformers():
        return process_image(_worker_processor, image)


def _started() -> bool:
    return True  # run by a worker once its initializer has run: the worker is up


class ProcessorPool:
    """``image_processor`` on ``workers`` spawned processes: :meth:`submit` an image, get its processor outputs.

    Starting a worker (a new interpreter importing torch and transformers) takes seconds; the workers start at
    once, in the background, and :attr:`ready` says when they have."""

    def __init__(self, image_processor: Any, workers: int | None = None) -> None:
        import torch.multiprocessing as mp

        self.workers = workers or pool_workers()
        # spawn: a forked child of a process holding a CUDA context is unsafe; torch's context shares tensors
        self._pool = ProcessPoolExecutor(self.workers, mp_context=mp.get_context("spawn"), initializer=_start,
                                         initargs=(image_processor,))  # fmt: skip
        # one trivial task per worker: the executor starts a process for each task no idle worker takes
        self._starting = [self._pool.submit(_started) for _ in range(self.workers)]

    @property
    def ready(self) -> bool:
        """Whether the workers have started (each start task has run); until then a caller may process in line."""
        return all(task.done() for task in self._starting)

    def submit(self, image: Image.Image) -> Future[dict[str, Any]]:
        return self._pool.submit(_process, image)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
