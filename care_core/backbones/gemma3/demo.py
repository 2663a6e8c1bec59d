"""The Gemma 3 family's model builders: its tiny demos (random, trained skeleton) and its full-size benchmark model
(Gemma-3-4B's or -12B's shapes, random weights). Imported only when a model is built."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..full_size_parts import full_size_from_demo, spec_widths
from ..tiny_parts import RANDOM_SIZES, TRAINED_SIZES, TinySizes, build_byte_tokenizer, seeded_model, vocab_size

if TYPE_CHECKING:
    from care_core.architecture import BackboneSpec

#: the tokenizer attributes Gemma3Processor reads (``boi_token``, ``eoi_token``, ``image_token`` and their ids)
GEMMA3_NAMED_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                       "image_token": "<image_soft_token>"}  # fmt: skip
GEMMA3_TURN_TOKENS = ["<start_of_turn>", "<end_of_turn>"]

# The template transformers' convert_gemma3_weights.py writes for the -it checkpoints (_CHAT_TEMPLATE), less its
# system-prompt prefix and role-order check: bos, then turns
# "<start_of_turn>user\n<start_of_image>{question}<end_of_turn>\n<start_of_turn>model\n"; the processor expands
# <start_of_image> to "\n\n<start_of_image>" + 256 x <image_soft_token> + "<end_of_image>\n\n".
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
#: the tiny decoder's attention window: narrower than a prompt (256 image rows + text), so the sliding layers cut
#: what they would at full size only past 1024 positions
TINY_SLIDING_WINDOW = 128
TINY_LAYER_TYPES = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]
#: the released 4B / 12B decoders' window (convert_gemma3_weights.py; the config class default is 4096)
FULL_SIZE_SLIDING_WINDOW = 1024


def build_tiny_gemma3(seed: int = 0, sizes: TinySizes | None = None) -> tuple[Any, Any]:
    """Gemma 3 with the real geometry (SigLIP 896 px / 14 = 64x64 patches, no CLS, average-pooled 4x4 to 16x16 =
    256 tokens; RMSNorm + linear projector; pan-and-scan off) and tiny widths (``sizes``; None: the random demo's, a
    3-layer SigLIP tower 64 wide): a 4-layer Gemma 3 decoder (3 sliding-window layers, then one full-attention layer;
    GQA 4/2 heads of hidden / 4). Weights from ``seed``; the projector's weight and its norm's ``w`` (zeros in
    transformers' init, which would make every image row 0) drawn too."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tok = build_byte_tokenizer([*GEMMA3_TURN_TOKENS, *GEMMA3_NAMED_TOKENS.values()], eos_token="<end_of_turn>",
                               named_tokens=GEMMA3_NAMED_TOKENS)  # fmt: skip
    tid = tok.convert_tokens_to_ids
    size = sizes or RANDOM_SIZES
    head_dim = size.text_hidden // size.heads
    config = Gemma3Config(
        vision_config={"model_type": "siglip_vision_model", "hidden_size": size.vision_hidden,
                       "intermediate_size": size.vision_intermediate, "num_hidden_layers": size.vision_layers,
                       "num_attention_heads": size.heads, "image_size": 896, "patch_size": 14,
                       "vision_use_head": False, "layer_norm_eps": 1e-6},
        text_config={"model_type": "gemma3_text", "vocab_size": vocab_size(tok), "hidden_size": size.text_hidden,
                     "intermediate_size": size.text_intermediate, "num_hidden_layers": len(TINY_LAYER_TYPES),
                     "num_attention_heads": size.heads, "num_key_value_heads": size.heads // 2,
                     "head_dim": head_dim, "query_pre_attn_scalar": head_dim,
                     "sliding_window": TINY_SLIDING_WINDOW, "layer_types": TINY_LAYER_TYPES,
                     "max_position_embeddings": 8192, "bos_token_id": tok.bos_token_id,
                     "eos_token_id": tid("<end_of_turn>"), "pad_token_id": tok.pad_token_id},
        mm_tokens_per_image=256, boi_token_index=tid("<start_of_image>"), eoi_token_index=tid("<end_of_image>"),
        image_token_index=tid("<image_soft_token>"),
    )  # fmt: skip
    model = seeded_model(Gemma3ForConditionalGeneration, config, seed)
    _draw_projector(model, seed + 1)
    image_processor = Gemma3ImageProcessorPil(size={"height": 896, "width": 896})
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tok, image_seq_length=256,
                                chat_template=GEMMA3_CHAT_TEMPLATE)  # fmt: skip
    return model, processor


def build_trained_tiny_gemma3(seed: int = 0) -> tuple[Any, Any]:
    """The trained tiny-gemma3's architecture (:data:`TRAINED_SIZES`: SigLIP 128 wide, 4 layers; decoder 128 wide,
    heads of 32), weights from ``seed``."""
    return build_tiny_gemma3(seed, TRAINED_SIZES)


def _draw_projector(model: Any, seed: int) -> None:
    """The projector's weight and its norm's ``w`` drawn from ``seed`` (transformers initialises both to 0, which
    makes every image row 0), leaving the caller's RNG alone."""
    projector = model.model.multi_modal_projector
    weight, gamma = projector.mm_input_projection_weight, projector.mm_soft_emb_norm.weight
    generator = torch.Generator().manual_seed(seed)  # on the CPU, then copied: the same values on every device
    with torch.no_grad():
        weight.copy_(torch.randn(weight.shape, generator=generator) * weight.shape[0] ** -0.5)
        gamma.copy_(torch.randn(gamma.shape, generator=generator) * 0.1)


def full_size_config(tiny_config: Any, spec: BackboneSpec) -> Any:
    """The demo's config at ``spec``'s widths, with the released window and query scaling (1 / sqrt(head_dim));
    the decoder's layer types recomputed for the new depth (five sliding layers per full-attention one)."""
    config = spec_widths(tiny_config, spec)
    config.text_config.sliding_window = FULL_SIZE_SLIDING_WINDOW
    config.text_config.query_pre_attn_scalar = spec.lm.head_dim
    return config


def build_full_size(
    spec: BackboneSpec, device: torch.device, dtype: torch.dtype, tiny: bool = False
) -> tuple[Any, Any]:
    """The record's full-size model (Gemma-3-4B or -12B at ``spec``'s widths; SigLIP-so400m at 896 px): the random
    demo widened, its projector drawn; ``tiny``: the demo. Not yet run on a GPU."""
    model, processor = full_size_from_demo(build_tiny_gemma3, full_size_config, spec, device, dtype, tiny)
    if not tiny:
        _draw_projector(model, 1)
    return model, processor
