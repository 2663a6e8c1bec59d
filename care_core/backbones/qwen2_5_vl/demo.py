"""The Qwen2.5-VL family's model builders: its tiny demos (random, trained skeleton) and its full-size benchmark model
(Qwen2.5-VL-7B's shapes, random weights). Imported only when a model is built."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from ..full_size_parts import (
    DEFAULT_TOKENIZER,
    QWEN_TASK_TOKENIZER,
    TOKENIZER_PIECES,
    full_size_from_demo,
    text_widths,
    widened,
)
from ..tiny_parts import (
    QWEN_CONTROL_TOKENS,
    TRAINED_SIZES,
    TinySizes,
    qwen_text_widths,
    qwen_vision_widths,
    seeded_model,
    vocab_size,
)

if TYPE_CHECKING:
    from care_core.architecture import BackboneSpec


# The Qwen2.5-VL template (default system message; images as <|vision_start|><|image_pad|><|vision_end|>).
QWEN25VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tiny_qwen2_5_vl(
    seed: int = 0, sizes: TinySizes | None = None, tokenizer: str = DEFAULT_TOKENIZER
) -> tuple[Any, Any]:
    """Qwen2.5-VL with the real geometry (patch 14, 2x2 merge, window 112, full-attention blocks, the hub's
    pixel budget 3136..12845056) and tiny widths (``sizes``; None: the random demo's own); the image-only processor
    (no torchvision needed) with the stand-in byte ``tokenizer`` (a key of
    :data:`~care_core.backbones.full_size_parts.TOKENIZER_PIECES`)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from ..qwen_processor import CareQwen2_5_VLProcessor

    tok = TOKENIZER_PIECES[tokenizer].build(
        QWEN_CONTROL_TOKENS, add_bos=False, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tid = tok.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        vision_config={
            **qwen_vision_widths(sizes),
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [1, 3],
            "tokens_per_second": 2,
        },
        text_config={
            "vocab_size": vocab_size(tok),
            **qwen_text_widths(sizes),
            "max_position_embeddings": 8192,
            "bos_token_id": None,
            "eos_token_id": tid("<|im_end|>"),
            "pad_token_id": tid("<|endoftext|>"),
        },
        image_token_id=tid("<|image_pad|>"),
        video_token_id=tid("<|video_pad|>"),
        vision_start_token_id=tid("<|vision_start|>"),
        vision_end_token_id=tid("<|vision_end|>"),
    )
    model = seeded_model(Qwen2_5_VLForConditionalGeneration, config, seed)
    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": 3136, "longest_edge": 12845056}, patch_size=14, temporal_patch_size=2, merge_size=2
    )
    processor = CareQwen2_5_VLProcessor(
        image_processor=image_processor, tokenizer=tok, chat_template=QWEN25VL_CHAT_TEMPLATE
    )
    return model, processor


def build_trained_tiny_qwen2_5_vl(seed: int = 0) -> tuple[Any, Any]:
    """The trained tiny-qwen2.5-vl's architecture (:data:`TRAINED_SIZES`: tower 128 wide, 4 blocks; language model
    128 wide, 4 layers), weights from ``seed``."""
    return build_tiny_qwen2_5_vl(seed, TRAINED_SIZES)


def qwen2_5_vl_7b_config(tiny_config: Any, spec: BackboneSpec) -> Any:
    """Qwen2.5-VL-7B: the 32-block windowed ViT (1280 wide, full attention in blocks 7, 15, 23, 31) and the 28-layer
    Qwen2.5-7B text model (GQA 28/4; M-RoPE sections 16/24/24 of its 64 frequencies, theta 1e6), as
    Qwen/Qwen2.5-VL-7B-Instruct's config.json gives them (``spec``'s dims), on the demo's ``tiny_config``."""
    vit = spec.vision
    vision = dict(depth=vit.layers, hidden_size=vit.hidden, intermediate_size=vit.intermediate, num_heads=vit.heads,
                  out_hidden_size=spec.projector.out_dim, window_size=vit.window_size,
                  fullatt_block_indexes=list(vit.full_attention_layers))  # fmt: skip
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}
    return widened(tiny_config, vision, {**text_widths(spec.lm), "rope_parameters": rope})


def build_full_size(
    spec: BackboneSpec, device: torch.device, dtype: torch.dtype, tiny: bool = False
) -> tuple[Any, Any]:
    """The record's full-size model: the random demo at :func:`qwen2_5_vl_7b_config`'s widths (``tiny``: the demo)
    with the Qwen2 tokenizer's pieces (:data:`~care_core.backbones.full_size_parts.QWEN_TASK_TOKENIZER`)."""
    demo = partial(build_tiny_qwen2_5_vl, tokenizer=QWEN_TASK_TOKENIZER)
    return full_size_from_demo(demo, qwen2_5_vl_7b_config, spec, device, dtype, tiny)
