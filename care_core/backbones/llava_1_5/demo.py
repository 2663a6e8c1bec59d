"""The LLaVA-1.5 family's model builders: its tiny demos (the random one and the trained skeleton) and its full-size
benchmark model (LLaVA-1.5-7B's shapes, random weights). Imported only when a model is built."""

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


# The chat template of the llava-hf LLaVA-1.5 checkpoints: "USER: <image>\n{question} ASSISTANT:".
LLAVA15_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}"
    "{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}"
    "{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def build_tiny_llava(seed: int = 0, sizes: TinySizes = RANDOM_SIZES) -> tuple[Any, Any]:
    """LLaVA-1.5 with the real geometry (CLIP 336 px, patch 14, 24x24 = 576 tokens, layer -2,
    strategy "default") and tiny widths; weights drawn from ``seed`` without touching the
    caller's global RNG. Returns ``(model, processor)`` in eval mode, float32, on the CPU."""
    from transformers import (
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tok = build_byte_tokenizer(["<image>"])
    vision_config = tiny_clip_config(sizes)
    text_config = tiny_llama_config(tok, max_positions=4096, sizes=sizes)
    config = LlavaConfig(
        vision_config=vision_config,
        text_config=text_config,
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        image_seq_length=576,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
    )
    model = seeded_model(LlavaForConditionalGeneration, config, seed)
    image_processor = CLIPImageProcessorPil(**CLIP_VIEW, do_center_crop=True)
    processor = LlavaProcessor(image_processor=image_processor, **llava_processor_args(tok, LLAVA15_CHAT_TEMPLATE))
    return model, processor


def build_trained_tiny_llava(seed: int = 0) -> tuple[Any, Any]:
    """The trained tiny-llava's architecture (:data:`TRAINED_SIZES`), weights drawn from ``seed``: the starting
    point of ``scripts/train_demo`` and the skeleton the shipped weights are loaded into."""
    return build_tiny_llava(seed, TRAINED_SIZES)


def build_llava_1_5_7b(
    device: torch.device, dtype: torch.dtype, tiny: bool = False, tokenizer: str = DEFAULT_TOKENIZER
) -> tuple[Any, Any]:
    """LLaVA-1.5-7B (CLIP-L/336 24 layers, 1024->4096->4096 GELU projector, Vicuna-7B) with seeded random weights
    built on ``device`` in ``dtype``, the demo's chat template and the stand-in byte ``tokenizer`` (a key of
    :data:`~care_core.backbones.full_size_parts.TOKENIZER_PIECES`); ``tiny``: the same geometry at tiny widths."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tok = TOKENIZER_PIECES[tokenizer].build(["<image>"])
    config = LlavaConfig(**clip_vicuna_configs(tok, tiny, max_positions=4096), image_seq_length=576)
    model = random_model_on(LlavaForConditionalGeneration, config, device, dtype, seed=0)
    images = CLIPImageProcessorPil(**CLIP_VIEW, do_center_crop=True)
    processor = LlavaProcessor(image_processor=images, **llava_processor_args(tok, LLAVA15_CHAT_TEMPLATE))
    return model, processor


def build_full_size(
    spec: BackboneSpec, device: torch.device, dtype: torch.dtype, tiny: bool = False
) -> tuple[Any, Any]:
    """The record's full-size model: :func:`build_llava_1_5_7b` with the task's stand-in tokenizer. Its widths are
    fixed there and are ``spec``'s (llava-1.5-7b; tests/benchmarks/test_models.py checks it)."""
    return build_llava_1_5_7b(device, dtype, tiny, tokenizer=TASK_TOKENIZER)
