"""The Qwen3-VL family's model builders: its tiny demos (random, trained skeleton) and its full-size benchmark model
(Qwen3-VL-8B's shapes, random weights). Imported only when a model is built."""

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
from ..qwen2_5_vl.demo import QWEN25VL_CHAT_TEMPLATE
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


def build_tiny_qwen3_vl(
    seed: int = 0, sizes: TinySizes | None = None, tokenizer: str = DEFAULT_TOKENIZER
) -> tuple[Any, Any]:
    """Qwen3-VL with the real geometry (patch 16, 2x2 merge, resize factor 32, learned 48x48 position grid, the
    assumed hub pixel budget 65536..16777216, deepstack taps after vision blocks 1 and 2 of 4, interleaved
    M-RoPE) and tiny widths (``sizes``; None: the random demo's own); the image-only processor (no torchvision
    needed) with the stand-in byte ``tokenizer`` (a key of
    :data:`~care_core.backbones.full_size_parts.TOKENIZER_PIECES`)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tok = TOKENIZER_PIECES[tokenizer].build(
        QWEN_CONTROL_TOKENS, add_bos=False, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tid = tok.convert_tokens_to_ids
    # the random demo's text widths are Qwen2.5-VL's random ones (head 16, M-RoPE sections 2:3:3)
    text = qwen_text_widths(sizes)
    config = Qwen3VLConfig(
        vision_config={**tiny_vision_config(sizes), "deepstack_visual_indexes": [1, 2]},
        text_config={"vocab_size": vocab_size(tok), **text, "max_position_embeddings": 8192,
                     "head_dim": text["hidden_size"] // text["num_attention_heads"],
                     "rope_parameters": {**text["rope_parameters"], "rope_theta": 5e5, "mrope_interleaved": True},
                     "bos_token_id": None, "eos_token_id": tid("<|im_end|>"), "pad_token_id": tid("<|endoftext|>")},
        image_token_id=tid("<|image_pad|>"),
        video_token_id=tid("<|video_pad|>"),
        vision_start_token_id=tid("<|vision_start|>"),
        vision_end_token_id=tid("<|vision_end|>"),
    )  # fmt: skip
    return seeded_model(Qwen3VLForConditionalGeneration, config, seed), tiny_processor(tok)


def tiny_vision_config(sizes: TinySizes | None) -> dict[str, Any]:
    """The tower's config for a tiny demo: ``sizes``' widths with the real geometry (patch 16, 2x2 merge, temporal
    patch 2, learned 48x48 position grid); Qwen3.5's tower shares it (without deepstack levels)."""
    return {**qwen_vision_widths(sizes), "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
            "num_position_embeddings": 2304}  # fmt: skip


def tiny_processor(tok: Any) -> Any:
    """The image-only processor of a tiny demo (no torchvision needed): resize factor 32, the assumed hub pixel budget
    65536..16777216, mean and std 0.5; Qwen3.5's demos share it."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from ..qwen_processor import CareQwen3VLProcessor

    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": 65536, "longest_edge": 16777216}, patch_size=16, temporal_patch_size=2, merge_size=2,
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    )  # fmt: skip
    return CareQwen3VLProcessor(image_processor=image_processor, tokenizer=tok, chat_template=QWEN25VL_CHAT_TEMPLATE)


def build_trained_tiny_qwen3_vl(seed: int = 0) -> tuple[Any, Any]:
    """The trained tiny-qwen3-vl's architecture (:data:`TRAINED_SIZES`: tower 128 wide, 4 blocks, two deepstack
    mergers; language model 128 wide, 4 layers), weights from ``seed``."""
    return build_tiny_qwen3_vl(seed, TRAINED_SIZES)


def qwen3_vl_8b_config(tiny_config: Any, spec: BackboneSpec) -> Any:
    """Qwen3-VL-8B: the 27-block ViT (1152 wide, deepstack after blocks 8, 16, 24) and the 36-layer Qwen3-8B text
    model (GQA 32/8, head_dim 128; interleaved M-RoPE sections 24/20/20 of its 64 frequencies): ``spec``'s dims, on
    the demo's ``tiny_config``."""
    vit = spec.vision
    vision = dict(depth=vit.layers, hidden_size=vit.hidden, intermediate_size=vit.intermediate,
                  num_heads=vit.heads, out_hidden_size=spec.projector.out_dim,
                  deepstack_visual_indexes=list(vit.deepstack_layers))  # fmt: skip
    rope = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20], "mrope_interleaved": True}
    return widened(tiny_config, vision, {**text_widths(spec.lm), "rope_parameters": rope})


def build_full_size(
    spec: BackboneSpec, device: torch.device, dtype: torch.dtype, tiny: bool = False
) -> tuple[Any, Any]:
    """The record's full-size model: the random demo at :func:`qwen3_vl_8b_config`'s widths (``tiny``: the demo)
    with the Qwen2 tokenizer's pieces (:data:`~care_core.backbones.full_size_parts.QWEN_TASK_TOKENIZER`; Qwen3's is
    the same)."""
    demo = partial(build_tiny_qwen3_vl, tokenizer=QWEN_TASK_TOKENIZER)
    return full_size_from_demo(demo, qwen3_vl_8b_config, spec, device, dtype, tiny)
