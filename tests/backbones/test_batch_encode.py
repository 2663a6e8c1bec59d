"""Batched encoding: the vision tower once for several images, per image exactly what one image gives."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.backbones._helpers import noise_image

SIZES = [(300, 420), (500, 260), (336, 336)]  # landscape, portrait, square: different crops and grids


@pytest.fixture(scope="module")
def images() -> list[Any]:
    return [noise_image(h, w, seed=i) for i, (h, w) in enumerate(SIZES)]


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-llava-next", "tiny-qwen2.5-vl"])
def test_batched_encoding_gives_each_image_its_own_tokens(demos: dict[str, Any], images: list[Any], name: str) -> None:
    adapter = demos[name]
    batch = adapter.encode_images(images)
    alone = [adapter.encode_image(image) for image in images]
    assert len(batch) == len(images)
    for one, ref in zip(batch, alone, strict=True):
        assert one.num_tokens == ref.num_tokens
        torch.testing.assert_close(one.features, ref.features, rtol=1e-6, atol=1e-6)
        assert torch.equal(one.positions, ref.positions)
        assert torch.equal(one.boxes, ref.boxes)
        assert one.image_size == ref.image_size and one.grid == ref.grid and one.seen_box == ref.seen_box
        for key, value in ref.model_inputs.items():  # each image keeps its own processor outputs, for its probes
            got = one.model_inputs[key]
            assert torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value, key


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-llava-next", "tiny-qwen2.5-vl"])
def test_preprocessing_one_image_per_thread_collates_as_the_processor_does(
    demos: dict[str, Any], images: list[Any], name: str
) -> None:
    adapter = demos[name]
    ours = adapter.preprocess(images)
    theirs = adapter.processor.image_processor(images=images, return_tensors="pt")  # the processor on the list
    assert set(ours) <= set(theirs)
    for key, value in ours.items():
        assert torch.equal(value, theirs[key]), key


def test_tower_runs_once_for_a_batch(demos: dict[str, Any], images: list[Any], count_calls: Any) -> None:
    adapter = demos["tiny-llava-next"]
    calls = count_calls(adapter._vision_tower)
    adapter.encode_images(images)
    assert len(calls) == 1


def test_processed_inputs_that_do_not_match_the_sizes_are_refused(demos: dict[str, Any], images: list[Any]) -> None:
    adapter = demos["tiny-llava"]
    processed = adapter.preprocess(images)
    with pytest.raises(ValueError, match=r"of 2 images"):
        adapter.encode_processed(processed, [(10, 10), (20, 20)])


@pytest.mark.parametrize("workers", [1, 3])
def test_preprocess_images_gives_each_image_the_processors_output_for_it_alone(
    demos: dict[str, Any], images: list[Any], workers: int
) -> None:
    from care_core.backbones.chat_adapter import preprocess_images

    image_processor = demos["tiny-llava-next"].processor.image_processor
    parts = preprocess_images(image_processor, images, workers=workers)
    assert len(parts) == len(images)
    for part, image in zip(parts, images, strict=True):  # in input order, whatever thread ran it
        alone = image_processor(images=image, return_tensors="pt")
        assert set(part) == set(alone)
        for key, value in alone.items():
            assert torch.equal(part[key], value), key


def test_the_worker_processes_give_the_image_processors_own_output(demos: dict[str, Any], images: list[Any]) -> None:
    from care_core.backbones.preprocess_pool import ProcessorPool

    adapter = demos["tiny-llava-next"]
    pool = ProcessorPool(adapter.processor.image_processor, workers=1)  # a spawned process (as on a GPU machine)
    try:
        got = [pool.submit(image).result(timeout=120) for image in images]
        assert pool.ready  # its start task ran before the images
    finally:
        pool.close()
    for one, image in zip(got, images, strict=True):
        ref = adapter.process_image(image)
        assert set(one) == set(ref) and all(torch.equal(one[k], ref[k]) for k in ref)
