"""Qwen2.5-VL and Qwen3-VL processors that need no torchvision (images only).

transformers 5.24's ``Qwen2_5_VLProcessor`` insists on a video processor, whose classes need torchvision;
``AutoProcessor`` therefore cannot build one where torchvision is missing (our CPU install). This subclass
drops the video part: ``ProcessorMixin`` derives the sub-processors from the ``__init__`` signature, so an
``__init__`` without ``video_processor`` gives an image processor + tokenizer processor with the same outputs
for images (``input_ids``, ``attention_mask``, ``mm_token_type_ids``, ``pixel_values``, ``image_grid_thw``).
It loads a hub folder (``preprocessor_config.json``, tokenizer files, chat template) or one it saved itself,
offline; the image processor resolves to ``Qwen2VLImageProcessorPil`` without torchvision.
"""

from __future__ import annotations

from typing import Any

from transformers import ProcessorMixin, Qwen2_5_VLProcessor, Qwen3VLProcessor


def _image_only_init(processor: Any, image_processor: Any, tokenizer: Any, chat_template: Any) -> None:
    """What both Qwen processors' own ``__init__`` set up, less the video processor: the image and video token
    strings and ids (the tokenizer's, else Qwen's defaults), then the image processor and tokenizer."""
    processor.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
    processor.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
    processor.image_token_id = tokenizer.convert_tokens_to_ids(processor.image_token)
    processor.video_token_id = tokenizer.convert_tokens_to_ids(processor.video_token)
    ProcessorMixin.__init__(processor, image_processor, tokenizer, chat_template=chat_template)


class CareQwen2_5_VLProcessor(Qwen2_5_VLProcessor):
    """``Qwen2_5_VLProcessor`` without the video processor."""

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kwargs: Any):
        _image_only_init(self, image_processor, tokenizer, chat_template)


class CareQwen3VLProcessor(Qwen3VLProcessor):
    """``Qwen3VLProcessor`` without the video processor (the same reason and outputs as above; its image processor
    is ``Qwen2VLImageProcessorPil`` at patch 16, resize factor 32)."""

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kwargs: Any):
        _image_only_init(self, image_processor, tokenizer, chat_template)
        self.vision_start_token = getattr(tokenizer, "vision_start_token", None) or "<|vision_start|>"
        self.vision_end_token = getattr(tokenizer, "vision_end_token", None) or "<|vision_end|>"
        self.vision_start_token_id = tokenizer.convert_tokens_to_ids(self.vision_start_token)
        self.vision_end_token_id = tokenizer.convert_tokens_to_ids(self.vision_end_token)


__all__ = ["CareQwen2_5_VLProcessor", "CareQwen3VLProcessor"]
