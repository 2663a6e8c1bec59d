"""The LLaVA-NeXT family's model builders: its tiny demos (random, trained skeleton) and its full-size benchmark
model (LLaVA-NeXT-7B (vicuna)'s shapes, random weights). Imported only when a model is built."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..full_size_parts import DEFAULT_TOKENIZER, TASK_TOKENIZER, TOKENIZER_PIECES, clip_vicuna_configs, random_model_on
from ..tiny_parts import (
    CLIP_VIEW,
    RANDOM_SIZES,
    TRAINED_SIZES,
    TinySizes,
    build_byte_tokenizer,
    llava_processor_args,
    seeded_model,
    tiny_clip_config,
    tiny_llama_config,
)

if TYPE_CHECKING:
    from care_core.architecture import BackboneSpec


# The llava-hf LLaVA-NeXT (Mistral) template, user turns only: "[INST] <image>\n{question} [/INST]".
LLAVA_NEXT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' }}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] }}{% endfor %}{{ ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ ' ' + content['text'] + '</s>' }}{% endfor %}"
    "{% endif %}"
    "{% endfor %}"
)


def build_tiny_llava_next(seed: int = 0, sizes: TinySizes = RANDOM_SIZES) -> tuple[Any, Any]:
    """LLaVA-NeXT with the real geometry (CLIP 336 px / 14, layer -2, strategy "default", the default anyres
    pinpoints, base view + unpadded high-resolution grid: 2880 tokens for 672x672) and tiny widths."""
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    tok = build_byte_tokenizer(["<image>"])
    text_config = tiny_llama_config(tok, max_positions=8192, sizes=sizes)
    config = LlavaNextConfig(
        vision_config=tiny_clip_config(sizes),
        text_config=text_config,
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
    )
    model = seeded_model(LlavaNextForConditionalGeneration, config, seed)
    pinpoints = config.image_grid_pinpoints
    assert pinpoints is not None  # typed optional, but the config fills in its default grid
    image_processor = LlavaNextImageProcessorPil(
        **CLIP_VIEW,
        image_grid_pinpoints=[list(p) for p in pinpoints],
    )
    shared = llava_processor_args(tok, LLAVA_NEXT_CHAT_TEMPLATE)
    return model, LlavaNextProcessor(image_processor=image_processor, **shared)


def build_trained_tiny_llava_next(seed: int = 0) -> tuple[Any, Any]:
    """The trained tiny-llava-next's architecture (:data:`TRAINED_SIZES`, tiny-llava's), weights from ``seed``."""
    return build_tiny_llava_next(seed, TRAINED_SIZES)


def build_llava_next_7b(
    device: torch.device, dtype: torch.dtype, tiny: bool = False, tokenizer: str = DEFAULT_TOKENIZER
) -> tuple[Any, Any]:
    """LLaVA-NeXT-7B (vicuna): the LLaVA-1.5-7B parts + anyres (the default pinpoints), seeded random weights built on
    ``device`` in ``dtype``, the stand-in byte ``tokenizer``; ``tiny``: the same geometry at tiny widths."""
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    tok = TOKENIZER_PIECES[tokenizer].build(["<image>"])
    config = LlavaNextConfig(**clip_vicuna_configs(tok, tiny, max_positions=8192))
    model = random_model_on(LlavaNextForConditionalGeneration, config, device, dtype, seed=1)
    pinpoints = [list(p) for p in config.image_grid_pinpoints or ()]
    images = LlavaNextImageProcessorPil(**CLIP_VIEW, image_grid_pinpoints=pinpoints)
    processor = LlavaNextProcessor(image_processor=images, **llava_processor_args(tok, LLAVA_NEXT_CHAT_TEMPLATE))
    return model, processor


def build_full_size(
    spec: BackboneSpec, device: torch.device, dtype: torch.dtype, tiny: bool = False
) -> tuple[Any, Any]:
    """The record's full-size model: :func:`build_llava_next_7b` with the task's stand-in tokenizer. Its widths are
    fixed there and are ``spec``'s (llava-next-7b; tests/benchmarks/test_models.py checks it)."""
    return build_llava_next_7b(device, dtype, tiny, tokenizer=TASK_TOKENIZER)
