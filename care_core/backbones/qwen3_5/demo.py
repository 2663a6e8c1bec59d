"""The Qwen3.5 family's model builders: its tiny demos (random, trained skeleton) and its full-size benchmark model
(Qwen3.5-9B's shapes, random weights). Imported only when a model is built."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..full_size_parts import full_size_from_demo, text_widths, widened
from ..qwen3_vl.demo import tiny_processor, tiny_vision_config
from ..tiny_parts import (
    QWEN_CONTROL_TOKENS,
    TRAINED_SIZES,
    TinySizes,
    build_byte_tokenizer,
    seeded_model,
    vocab_size,
)

if TYPE_CHECKING:
    from care_core.architecture import BackboneSpec

#: the real decoder's pattern (``full_attention_interval`` 4): three Gated DeltaNet layers, then full attention
TINY_LAYER_TYPES = ("linear_attention", "linear_attention", "linear_attention", "full_attention")


def tiny_text_config(tok: Any, sizes: TinySizes | None) -> dict[str, Any]:
    """The tiny hybrid decoder: :data:`TINY_LAYER_TYPES`, GQA 4/2 heads of 32 with the output gate, a quarter of each
    head rotated (the real ``partial_rotary_factor``) with interleaved M-RoPE sections 2:1:1 of its 4 frequencies,
    and Gated DeltaNet layers of heads 16 wide (kernel 4) whose value width is the hidden width and key width half of
    it, as in the released sizes (the random demo, 64 wide: 2 key / 4 value heads; the trained one, 128: 4 / 8)."""
    hidden, intermediate = (64, 128) if sizes is None else (sizes.text_hidden, sizes.text_intermediate)
    tid = tok.convert_tokens_to_ids
    return {"vocab_size": vocab_size(tok), "hidden_size": hidden, "intermediate_size": intermediate,
            "num_hidden_layers": len(TINY_LAYER_TYPES), "layer_types": list(TINY_LAYER_TYPES),
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 8192,
            "linear_num_key_heads": hidden // 32, "linear_num_value_heads": hidden // 16, "linear_key_head_dim": 16,
            "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                "mrope_section": [2, 1, 1]},
            "bos_token_id": None, "eos_token_id": tid("<|im_end|>"), "pad_token_id": tid("<|endoftext|>")}  # fmt: skip


def build_tiny_qwen3_5(seed: int = 0, sizes: TinySizes | None = None) -> tuple[Any, Any]:
    """Qwen3.5 with the real geometry (patch 16, 2x2 merge, resize factor 32, learned 48x48 position grid, Qwen3-VL's
    assumed hub pixel budget 65536..16777216, no deepstack) and the tiny hybrid decoder (:func:`tiny_text_config`);
    the image-only Qwen3-VL processor (Qwen3.5's own processor class; no torchvision needed)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    tok = build_byte_tokenizer(QWEN_CONTROL_TOKENS, add_bos=False, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tid = tok.convert_tokens_to_ids
    config = Qwen3_5Config(
        vision_config=tiny_vision_config(sizes),
        text_config=tiny_text_config(tok, sizes),
        image_token_id=tid("<|image_pad|>"),
        video_token_id=tid("<|video_pad|>"),
        vision_start_token_id=tid("<|vision_start|>"),
        vision_end_token_id=tid("<|vision_end|>"),
    )  # fmt: skip
    return seeded_model(Qwen3_5ForConditionalGeneration, config, seed), tiny_processor(tok)


def build_trained_tiny_qwen3_5(seed: int = 0) -> tuple[Any, Any]:
    """The trained tiny-qwen3.5's architecture (:data:`TRAINED_SIZES`: tower 128 wide, 4 blocks; hybrid decoder 128
    wide, Gated DeltaNet layers of 4 key / 8 value heads), weights from ``seed``."""
    return build_tiny_qwen3_5(seed, TRAINED_SIZES)


def qwen3_5_9b_config(tiny_config: Any, spec: BackboneSpec) -> Any:
    """Qwen3.5-9B on the demo's ``tiny_config``: ``spec``'s dims (the 27-block ViT without deepstack; 32 decoder
    layers, every 4th full attention with GQA 16/4 heads of 256, the others Gated DeltaNet of 16 key / 32 value heads
    of 128) and the released rope (theta 1e7, a quarter of each head rotated, interleaved sections 11/11/10)."""
    vit, lm, gdn = spec.vision, spec.lm, spec.lm.linear_attention
    if gdn is None:
        raise ValueError(f"{spec.name} states no Gated DeltaNet layers")
    vision = dict(depth=vit.layers, hidden_size=vit.hidden, intermediate_size=vit.intermediate, num_heads=vit.heads,
                  out_hidden_size=spec.projector.out_dim)  # fmt: skip
    types = ["linear_attention" if i in lm.linear_layers else "full_attention" for i in range(lm.layers)]
    rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10]}
    text = {**text_widths(lm), "layer_types": types, "linear_num_key_heads": gdn.key_heads,
            "linear_num_value_heads": gdn.value_heads, "linear_key_head_dim": gdn.key_head_dim,
            "linear_value_head_dim": gdn.value_head_dim, "linear_conv_kernel_dim": gdn.conv_kernel,
            "rope_parameters": rope}  # fmt: skip
    return widened(tiny_config, vision, text)


def build_full_size(
    spec: BackboneSpec, device: torch.device, dtype: torch.dtype, tiny: bool = False
) -> tuple[Any, Any]:
    """The record's full-size model: the random demo at :func:`qwen3_5_9b_config`'s widths (``tiny``: the demo)."""
    return full_size_from_demo(build_tiny_qwen3_5, qwen3_5_9b_config, spec, device, dtype, tiny)
