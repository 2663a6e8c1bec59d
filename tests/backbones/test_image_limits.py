"""What the families' image processors refuse is refused first, in one line of ours: the Qwen families' aspect ratio."""

from __future__ import annotations

from typing import Any

import pytest
from PIL import Image

from care_core.errors import ImageError
from care_core.prefetch import image_preparer

# transformers' smart_resize takes a long side up to 200 times the short one: 2000x10 is the widest it takes
SIZES_TAKEN = [(2000, 10), (10, 2000)]
SIZES_REFUSED = [((2001, 10), "200.1"), ((10, 2001), "200.1"), ((3000, 10), "300")]  # (width, height), long / short


@pytest.fixture(params=["qwen_demo", "qwen3_demo"])
def qwen(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(request.param)


@pytest.mark.parametrize(("size", "ratio"), SIZES_REFUSED)
def test_what_the_qwen_processor_refuses_is_one_image_error_before_it_runs(
    qwen: Any, size: tuple[int, int], ratio: str
) -> None:
    image = Image.new("RGB", size, (200, 30, 30))
    with pytest.raises(ValueError, match="aspect ratio"):  # the processor's own refusal, for the record
        qwen.processor.image_processor(images=image, return_tensors="pt")
    expected = f"image ({size[0]}×{size[1]} px): aspect ratio {ratio}:1 exceeds {qwen.display}'s limit of 200:1"
    for into_the_processor in (qwen.encode_image, qwen.process_image, image_preparer(qwen, pool=False)):
        with pytest.raises(ImageError) as caught:
            into_the_processor(image)
        assert str(caught.value).startswith(expected) and "\n" not in str(caught.value)
    with pytest.raises(ImageError, match=r"^thin\.png \("):
        qwen.check_image(image, name="thin.png")


@pytest.mark.parametrize("size", SIZES_TAKEN)
def test_the_widest_image_the_qwen_processor_takes_is_encoded(qwen: Any, size: tuple[int, int]) -> None:
    image = Image.new("RGB", size, (200, 30, 30))
    qwen.check_image(image)
    tokens = qwen.encode_image(image)
    assert tokens.num_tokens >= 1 and tokens.image_size == (size[1], size[0])
