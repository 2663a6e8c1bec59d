"""An InternVL processor that needs no torchvision (images only).

transformers' ``InternVLProcessor`` takes a video processor, whose classes need torchvision; ``AutoProcessor``
therefore cannot build one where torchvision is missing (our CPU install). This subclass drops the video part:
``ProcessorMixin`` derives the sub-processors from the ``__init__`` signature, so an ``__init__`` without
``video_processor`` gives an image processor + tokenizer processor with the same outputs for images
(``input_ids``, ``attention_mask``, ``pixel_values``; ``<img>`` + ``<IMG_CONTEXT>`` x 256 per tile + ``</img>``,
left padding). The image processor resolves to ``GotOcr2ImageProcessorPil`` without torchvision.
"""

from __future__ import annotations

import re
from typing import Any

from transformers import InternVLProcessor, ProcessorMixin


class CareInternVLProcessor(InternVLProcessor):
    """``InternVLProcessor`` without the video processor."""

    def __init__(
        self,
        image_processor: Any = None,
        tokenizer: Any = None,
        image_seq_length: int = 256,
        chat_template: Any = None,
        **kwargs: Any,
    ) -> None:
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
        self.image_seq_length = image_seq_length
        self.start_image_token = tokenizer.start_image_token
        self.end_image_token = tokenizer.end_image_token
        self.start_image_token_id = tokenizer.start_image_token_id
        self.end_image_token_id = tokenizer.end_image_token_id
        self.image_token = tokenizer.context_image_token
        self.video_token = getattr(tokenizer, "video_token", None) or "<video>"
        self.image_token_id = tokenizer.context_image_token_id
        self.multimodal_pattern = re.compile(
            f"(?P<image>{re.escape(self.image_token)})|(?P<video>{re.escape(self.video_token)})"
        )


__all__ = ["CareInternVLProcessor"]
