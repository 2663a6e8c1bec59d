"""care_core.prefetch: items prepared in order and ahead of need, a failed item's error kept to that item, and
prepared images encoding to exactly the tokens of the adapter's own encode."""

from __future__ import annotations

import sys
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from care_core.errors import ImageError
from care_core.prefetch import (
    Prefetcher,
    PreparedImage,
    encoded_inputs,
    gil_switch_interval,
    image_prefetcher,
    image_preparer,
    in_flight_copies,
    prepared_image,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
WAIT_S = 30.0  # a safety net for a stuck thread, never a measured time


class Recorder:
    """A prepare callable that records which items it prepared and lets a test wait for one of them."""

    def __init__(self, failing: dict[int, Exception] | None = None) -> None:
        self.prepared: list[int] = []
        self.failing = failing or {}
        self._done: dict[int, threading.Event] = {}
        self._lock = threading.Lock()

    def event(self, item: int) -> threading.Event:
        with self._lock:
            return self._done.setdefault(item, threading.Event())

    def __call__(self, item: int) -> str:
        with self._lock:
            self.prepared.append(item)
        self.event(item).set()
        if item in self.failing:
            raise self.failing[item]
        return f"prepared {item}"


def test_a_chunk_comes_back_in_order_and_the_next_items_start_ahead() -> None:
    recorder = Recorder()
    with Prefetcher(recorder, list(range(10)), workers=1) as loader:
        assert loader.inputs([0, 1, 2], ahead=2) == ["prepared 0", "prepared 1", "prepared 2"]
        assert recorder.event(4).wait(WAIT_S)  # one worker, first in first out: 3 and 4 are done too
        assert recorder.prepared == [0, 1, 2, 3, 4]  # the chunk and the 2 items after it, nothing beyond
        assert loader.inputs([3, 4], ahead=1) == ["prepared 3", "prepared 4"]
        assert recorder.event(5).wait(WAIT_S)
        assert recorder.prepared == [0, 1, 2, 3, 4, 5]  # 3 and 4 were not prepared again


def test_part_of_a_started_chunk_is_served_from_what_was_prepared() -> None:
    """A batch split after running out of memory asks for its halves: nothing is prepared twice."""
    recorder = Recorder()
    with Prefetcher(recorder, list(range(6)), workers=2) as loader:
        loader.inputs([0, 1, 2, 3], ahead=0)
        assert loader.inputs([0, 1], ahead=0) == ["prepared 0", "prepared 1"]
        assert loader.inputs([2, 3], ahead=0) == ["prepared 2", "prepared 3"]
        assert sorted(recorder.prepared) == [0, 1, 2, 3]
        loader.release([0, 1, 2, 3])
        assert loader.inputs([4, 5], ahead=3) == ["prepared 4", "prepared 5"]  # ahead past the end: nothing more
        assert sorted(recorder.prepared) == [0, 1, 2, 3, 4, 5]


def test_a_failing_item_raises_its_own_error_and_the_others_are_still_served() -> None:
    broken = ValueError("item 1 cannot be opened")
    recorder = Recorder(failing={1: broken})
    with Prefetcher(recorder, list(range(4)), workers=2) as loader:
        with pytest.raises(ValueError) as raised:
            loader.inputs([0, 1, 2], ahead=1)
        assert raised.value is broken
        assert loader.inputs([0], ahead=0) == ["prepared 0"]
        assert loader.inputs([2], ahead=0) == ["prepared 2"]
        with pytest.raises(ValueError) as again:
            loader.inputs([1], ahead=0)
        assert again.value is broken
        assert loader.inputs([3], ahead=0) == ["prepared 3"]  # started ahead of the failure, served after it


def test_items_are_told_apart_by_their_key() -> None:
    order: list[dict[str, Any]] = [{"id": "a", "x": 1}, {"id": "b", "x": 2}, {"id": "c", "x": 3}]  # not hashable
    with Prefetcher(lambda item: item["x"] * 10, order, workers=1, key=lambda item: item["id"]) as loader:
        assert loader.inputs(order[:2], ahead=1) == [10, 20]
        assert loader.inputs(order[2:], ahead=1) == [30]


def test_prepared_images_encode_to_the_tokens_of_the_adapters_own_encode() -> None:
    """A batch mixing prepared and plain images (three sizes) gives, per image, the tokens of ``encode_images``."""
    from care_core.backbones.loading import load_backbone
    from care_core.images import load_image

    adapter = load_backbone("tiny-llava-next", device="cpu")
    images = [load_image(EXAMPLES / name) for name in ("astronaut.jpg", "coffee.jpg", "chelsea.jpg")]
    prepare = image_preparer(adapter)
    mixed = [prepare(images[0]), images[1], prepare(images[2])]
    assert [isinstance(one, PreparedImage) for one in mixed] == [True, False, True]
    assert mixed[0].size == (images[0].height, images[0].width)  # type: ignore[union-attr]
    with torch.no_grad():  # the same two images in one tower pass: some CPUs round a taller product differently
        expected = dict(zip((0, 2), adapter.encode_images([images[0], images[2]]), strict=True))
    got = encoded_inputs(adapter, mixed)
    assert got[1] is images[1]  # a plain image is left for run_batch to encode
    for index in (0, 2):
        tokens: object = got[index]
        assert torch.equal(tokens.features, expected[index].features)  # type: ignore[attr-defined]
        assert torch.equal(tokens.positions, expected[index].positions)  # type: ignore[attr-defined]
        assert tokens.grid == expected[index].grid  # type: ignore[attr-defined]


class FakeGpuAdapter:
    """An adapter on a GPU as image_preparer sees it: its processor in line and on a pool, each call recorded."""

    device = torch.device("cuda")

    def __init__(self, ready: bool = True, widest: int | None = None) -> None:
        self.pools_started = 0
        self.calls: list[str] = []
        self.ready = ready  # the pool's workers are up
        self.widest = widest  # the widest image its processor takes (None: any)

    def check_image(self, image: Image.Image, name: str | None = None) -> None:
        if self.widest is not None and image.width > self.widest:
            raise ImageError(f"{name or 'image'} is too wide")

    def process_image(self, image: Image.Image) -> dict[str, object]:
        self.check_image(image)
        self.calls.append("thread")
        return {"pixels": image.size}

    def processor_pool(self) -> FakeGpuAdapter:
        self.pools_started += 1
        return self

    def submit(self, image: Image.Image) -> Future[dict[str, object]]:
        self.calls.append("pool")
        done: Future[dict[str, object]] = Future()
        done.set_result({"pixels": image.size})
        return done


@pytest.mark.parametrize(("items", "batch_size", "route"), [(3, 4, "thread"), (4, 4, "thread"), (5, 4, "pool")])
def test_the_processor_pool_serves_runs_of_more_than_one_batch(items: int, batch_size: int, route: str) -> None:
    adapter = FakeGpuAdapter()
    images = {i: Image.new("RGB", (10 + i, 20)) for i in range(items)}
    with image_prefetcher(adapter, images.__getitem__, list(images), batch_size) as loader:  # type: ignore[arg-type]
        prepared = loader.inputs(list(images), ahead=0)
    assert all(isinstance(p, PreparedImage) for p in prepared)
    assert [p.size for p in prepared] == [(20, 10 + i) for i in range(items)]  # type: ignore[union-attr]
    expected = [{"pixels": (10 + i, 20)} for i in range(items)]  # what each route gives for the image
    assert [p.processed for p in prepared] == expected  # type: ignore[union-attr]
    assert adapter.calls == [route] * items and adapter.pools_started == (route == "pool")


def test_images_are_processed_in_line_while_the_pools_workers_start() -> None:
    adapter = FakeGpuAdapter(ready=False)
    images = {i: Image.new("RGB", (10 + i, 20)) for i in range(6)}
    with image_prefetcher(adapter, images.__getitem__, list(images), 2) as loader:  # type: ignore[arg-type]
        first = loader.inputs([0, 1], ahead=0)
        adapter.ready = True  # the workers are up: the next images go to them
        loader.release([0, 1])
        rest = loader.inputs([2, 3, 4, 5], ahead=0)
    assert adapter.pools_started == 1 and adapter.calls == ["thread"] * 2 + ["pool"] * 4
    assert [p.processed for p in first + rest] == [{"pixels": (10 + i, 20)} for i in range(6)]  # type: ignore[union-attr]


def test_an_image_the_processor_refuses_never_reaches_the_pool() -> None:
    adapter = FakeGpuAdapter(widest=12)
    prepare = image_preparer(adapter, pool=True)  # type: ignore[arg-type]
    with pytest.raises(ImageError, match="too wide"):
        prepare(Image.new("RGB", (13, 20)))
    assert adapter.calls == []  # refused before the pool (or this thread) ran the processor
    assert isinstance(prepare(Image.new("RGB", (12, 20))), PreparedImage) and adapter.calls == ["pool"]


def test_prepared_images_pin_their_pixels_only_when_asked() -> None:
    image = Image.new("RGB", (4, 3))
    processed = {"pixel_values": torch.rand(1, 2, 3, 4, 4), "image_sizes": torch.tensor([[3, 4]])}
    plain = prepared_image(image, processed, pin=False)
    assert plain.size == (3, 4)
    assert plain.processed["pixel_values"] is processed["pixel_values"]  # nothing copied
    if not torch.cuda.is_available():  # page-locked memory needs a CUDA driver
        return
    pinned = prepared_image(image, processed, pin=True)
    assert pinned.processed["pixel_values"].is_pinned()
    assert torch.equal(pinned.processed["pixel_values"], processed["pixel_values"])
    assert pinned.processed["image_sizes"] is processed["image_sizes"]  # integers stay as they are, on the host


def test_the_loaders_switch_interval_is_never_longer_and_is_restored() -> None:
    before = sys.getswitchinterval()
    with gil_switch_interval(before / 10):
        assert sys.getswitchinterval() == pytest.approx(before / 10)
    assert sys.getswitchinterval() == before
    with gil_switch_interval(before * 10):
        assert sys.getswitchinterval() == before
    with pytest.raises(KeyError), gil_switch_interval(before / 10):
        raise KeyError("a failing run")
    assert sys.getswitchinterval() == before


class CountingAdapter:
    """An adapter whose processor gives float pixels and integer sizes, counting its calls."""

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)
        self.calls = 0

    def process_image(self, image: Image.Image) -> dict[str, torch.Tensor]:
        self.calls += 1
        return {"pixel_values": torch.rand(1, 2, 3, 4, 4), "image_sizes": torch.tensor([[image.height, image.width]])}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_warm_ups_copies_are_processed_once_and_pinned_apart_on_a_gpu(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("page-locked memory needs a CUDA driver")
    adapter = CountingAdapter(device)
    image = Image.new("RGB", (4, 3))
    copies = in_flight_copies(adapter, image, 3)  # type: ignore[arg-type]
    assert adapter.calls == 1 and len(copies) == 3
    pixels = [copy.processed["pixel_values"] for copy in copies]  # type: ignore[union-attr]
    assert all(torch.equal(p, pixels[0]) for p in pixels)
    assert all(copy.size == (3, 4) for copy in copies)  # type: ignore[union-attr]
    if device == "cpu":  # nothing to pin: the processor's own tensors, shared
        assert all(p is pixels[0] for p in pixels)
    else:  # a block each, as a run's loader pins each image's pixels
        assert all(p.is_pinned() for p in pixels) and len({p.data_ptr() for p in pixels}) == 3


def test_a_warm_up_gives_adapters_that_prepare_nothing_the_picture_itself() -> None:
    image = Image.new("RGB", (4, 3))
    assert in_flight_copies(object(), image, 2) == [image, image]  # type: ignore[arg-type]
