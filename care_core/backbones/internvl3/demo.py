"""The InternVL3 family's model builders: its tiny demos (random, trained skeleton) and its full-size benchmark model
(InternVL3-8B's shapes, random weights). Imported only when a model is built."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from ..full_size_parts import DEFAULT_TOKENIZER, QWEN_TASK_TOKENIZER, TOKENIZER_PIECES, full_size_from_demo, spec_widths
from ..tiny_parts import (
    TRAINED_SIZES,
    TinySizes,
    seeded_model,
    tower_and_qwen2_widths,
    vocab_size,
)

if TYPE_CHECKING:
    from care_core.architecture import BackboneSpec


# The InternVL3 -hf layout (Qwen2 chat): the image as "<IMG_CONTEXT>\n" before the text, which the processor expands
# to <img> + <IMG_CONTEXT> x 256 per tile + </img>; no system message (the hub's Chinese one is not needed here).
INTERNVL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
INTERNVL_NAMED_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>",
                         "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}  # fmt: skip


def build_tiny_internvl3(
    seed: int = 0, sizes: TinySizes | None = None, tokenizer: str = DEFAULT_TOKENIZER
) -> tuple[Any, Any]:
    """InternVL3 with the real geometry (InternViT 448 px tiles, patch 14, CLS, pixel shuffle 0.5: 256 tokens per
    tile; 1..12 tiles + a thumbnail, the GotOcr2 processor's defaults) and tiny InternViT / Qwen2 widths (``sizes``;
    None: the random demo's own); the image-only processor (no torchvision needed) with the stand-in byte ``tokenizer``
    (a key of :data:`~care_core.backbones.full_size_parts.TOKENIZER_PIECES`)."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    from .processor import CareInternVLProcessor

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *INTERNVL_NAMED_TOKENS.values()]
    tok = TOKENIZER_PIECES[tokenizer].build(specials, add_bos=False, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                            named_tokens=INTERNVL_NAMED_TOKENS)  # fmt: skip
    tid = tok.convert_tokens_to_ids
    tower, text = tower_and_qwen2_widths(sizes, (32, 64, 2, 2), (64, 128))
    config = InternVLConfig(
        vision_config={**tower, "image_size": [448, 448], "patch_size": [14, 14]},
        text_config={"model_type": "qwen2", "vocab_size": vocab_size(tok), **text,
                     "max_position_embeddings": 8192, "bos_token_id": None,
                     "eos_token_id": tid("<|im_end|>"), "pad_token_id": tid("<|endoftext|>")},
        image_token_id=tid("<IMG_CONTEXT>"), image_seq_length=256, downsample_ratio=0.5,
        vision_feature_layer=-1, vision_feature_select_strategy="default", projector_hidden_act="gelu",
        tie_word_embeddings=False,
    )  # fmt: skip
    model = seeded_model(InternVLForConditionalGeneration, config, seed)
    image_processor = GotOcr2ImageProcessorPil(
        size={"height": 448, "width": 448}, crop_to_patches=True, min_patches=1, max_patches=12
    )
    processor = CareInternVLProcessor(image_processor=image_processor, tokenizer=tok, image_seq_length=256,
                                      chat_template=INTERNVL_CHAT_TEMPLATE)  # fmt: skip
    return model, processor


def build_trained_tiny_internvl3(seed: int = 0) -> tuple[Any, Any]:
    """The trained tiny-internvl3's architecture (:data:`TRAINED_SIZES`: InternViT 128 wide, 4 layers; Qwen2 128
    wide, 4 layers), weights from ``seed``."""
    return build_tiny_internvl3(seed, TRAINED_SIZES)


def build_full_size(
    spec: BackboneSpec, device: torch.device, dtype: torch.dtype, tiny: bool = False
) -> tuple[Any, Any]:
    """The record's full-size model, InternVL3-8B: the random demo at ``spec``'s widths (InternViT-300M, 24 layers,
    1024 wide, and the Qwen2.5-7B-sized text model) with the Qwen2 tokenizer's pieces
    (:data:`~care_core.backbones.full_size_parts.QWEN_TASK_TOKENIZER`); ``tiny``: the demo."""
    demo = partial(build_tiny_internvl3, tokenizer=QWEN_TASK_TOKENIZER)
    return full_size_from_demo(demo, spec_widths, spec, device, dtype, tiny)
