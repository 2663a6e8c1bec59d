"""The LLaVA-OneVision family's model builders: its tiny demos (random, trained skeleton) and its full-size benchmark
model (LLaVA-OneVision-7B's shapes, random weights). Imported only when a model is built."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from ..full_size_parts import DEFAULT_TOKENIZER, QWEN_TASK_TOKENIZER, TOKENIZER_PIECES, full_size_from_demo, spec_widths
from ..tiny_parts import (
    QWEN_CONTROL_TOKENS,
    TRAINED_SIZES,
    TinySizes,
    seeded_model,
    tower_and_qwen2_widths,
    vocab_size,
)

if TYPE_CHECKING:
    from care_core.architecture import BackboneSpec


# Modelled on the llava-hf LLaVA-OneVision template (Qwen2 chat markup, images first in a user turn; unverified
# against the hub file): "<|im_start|>user <image>\n{question}<|im_end|>\n<|im_start|>assistant\n".
LLAVA_ONEVISION_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + ' ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ '\n' + content['text'] }}{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tiny_llava_onevision(
    seed: int = 0, sizes: TinySizes | None = None, tokenizer: str = DEFAULT_TOKENIZER
) -> tuple[Any, Any]:
    """LLaVA-OneVision with the real geometry (SigLIP 384 px / 14 = 27x27 = 729 patches, no CLS, layer -1, strategy
    "full", the anyres_max_9 pinpoints: 36 canvases 384..2304 in steps of 384) and tiny widths (``sizes``; None: the
    random demo's own): a SigLIP tower and a Qwen2 language model (GQA, qkv biases); the image-only processor (no
    torchvision needed) with the stand-in byte ``tokenizer`` (a key of
    :data:`~care_core.backbones.full_size_parts.TOKENIZER_PIECES`)."""
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    from .adapter import CareLlavaOnevisionProcessor

    tok = TOKENIZER_PIECES[tokenizer].build(
        [*QWEN_CONTROL_TOKENS[:3], "<image>", "<video>"],
        add_bos=False,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    tid = tok.convert_tokens_to_ids
    tower, text = tower_and_qwen2_widths(sizes, (64, 128, 3, 4), (64, 160))
    config = LlavaOnevisionConfig(
        vision_config={"model_type": "siglip_vision_model", **tower, "image_size": 384, "patch_size": 14,
                       "vision_use_head": False},
        text_config={"model_type": "qwen2", "vocab_size": vocab_size(tok), **text, "max_position_embeddings": 32768,
                     "bos_token_id": None, "eos_token_id": tid("<|im_end|>"),
                     "pad_token_id": tid("<|endoftext|>")},
        image_token_index=tid("<image>"),
        video_token_index=tid("<video>"),
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        vision_aspect_ratio="anyres_max_9",
    )  # fmt: skip
    model = seeded_model(LlavaOnevisionForConditionalGeneration, config, seed)
    pinpoints = config.image_grid_pinpoints
    assert pinpoints is not None  # typed optional, but the config fills in its default grid
    image_processor = LlavaOnevisionImageProcessorPil(
        size={"height": 384, "width": 384}, image_grid_pinpoints=[list(p) for p in pinpoints]
    )
    processor = CareLlavaOnevisionProcessor(
        image_processor=image_processor, tokenizer=tok, num_image_tokens=729, vision_feature_select_strategy="full",
        chat_template=LLAVA_ONEVISION_CHAT_TEMPLATE, vision_aspect_ratio="anyres_max_9",
    )  # fmt: skip
    return model, processor


def build_trained_tiny_llava_onevision(seed: int = 0) -> tuple[Any, Any]:
    """The trained tiny-llava-onevision's architecture (:data:`TRAINED_SIZES`: SigLIP 128 wide, 4 layers; Qwen2 128
    wide, 4 layers), weights from ``seed``."""
    return build_tiny_llava_onevision(seed, TRAINED_SIZES)


def build_full_size(
    spec: BackboneSpec, device: torch.device, dtype: torch.dtype, tiny: bool = False
) -> tuple[Any, Any]:
    """The record's full-size model, LLaVA-OneVision-7B: the random demo at ``spec``'s widths (SigLIP-so400m/384, 26
    layers used, and Qwen2-7B) with the Qwen2 tokenizer's pieces
    (:data:`~care_core.backbones.full_size_parts.QWEN_TASK_TOKENIZER`); ``tiny``: the demo."""
    demo = partial(build_tiny_llava_onevision, tokenizer=QWEN_TASK_TOKENIZER)
    return full_size_from_demo(demo, spec_widths, spec, device, dtype, tiny)
