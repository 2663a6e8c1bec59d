"""Embedded demo backbones: real geometry, tiny widths, built offline.

Which demos exist, their versions and builders are the family registry's (:mod:`care_core.backbones.families`);
this module holds the builders. A demo is built once into ``<care home>/demo/<name>-v<version>/`` with
``save_pretrained`` (model and processor) and then loaded through exactly the same code path as any real checkpoint
folder. Its token counts, shapes and module layout are the real model family's, so every command works end to end
without a download.

``tiny-llava`` ships trained weights (``demo_weights/tiny-llava.safetensors``, float16, sha256 in
``demo_weights/manifest.json``; trained by ``scripts/train_demo`` on the synthetic shapes world of
:mod:`care_core.synthetic`): it answers one-word questions about coloured shapes; so does ``tiny-llava-next``, whose
file is installed too. ``tiny-qwen2.5-vl``, ``tiny-qwen3-vl``, ``tiny-internvl3`` and ``tiny-llava-onevision`` load
their trained weights (wider skeletons, :data:`TRAINED_SIZES`) once the files are installed in the manifest, and are
random until then. The ``-random`` demos have seeded random weights and meaningless answers. Every demo folder holds
a marker (``care_demo.json``) with the weight file's sha256, checked on each load: a damaged cached copy is restored.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ModelLoadError
from ._hf import quiet_transformers
from .families import MANIFEST as MANIFEST  # re-exported: the registry defines where the weights ship
from .families import RANDOM_DEMO_NOTE, TRAINED_DEMO_NOTE, DemoBackbone, demo_backbones
from .families import WEIGHTS_DIR as WEIGHTS_DIR
from .families import read_manifest as read_manifest
from .families import weights_dir as weights_dir

MARKER = "care_demo.json"
WEIGHTS_FILE = "model.safetensors"

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

QWEN_CONTROL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]


def build_byte_tokenizer(
    special_tokens: list[str],
    model_max_length: int = 8192,
    *,
    add_bos: bool = True,
    eos_token: str = "</s>",
    pad_token: str = "<pad>",
    named_tokens: dict[str, str] | None = None,
    pieces: Sequence[str] = (),
) -> Any:
    """An offline byte-level tokenizer that encodes any text without ``<unk>``.

    A byte-level BPE with the 256-symbol byte alphabet and no merges (one token per UTF-8 byte),
    ``<unk> <s> </s> <pad>`` as ids 0-3, ``<s>`` prepended like Llama (unless ``add_bos`` is False, as
    for Qwen), and ``special_tokens`` (e.g. ``"<image>"``) registered as never-split special tokens after
    the bytes. ``eos_token`` / ``pad_token`` may name one of ``special_tokens``. ``named_tokens``: tokenizer
    attributes naming some of ``special_tokens`` (e.g. InternVL's ``context_image_token``), saved with it.
    ``pieces``: strings encoded as one token each wherever a word is made of them (merges built byte by byte,
    in the order given), e.g. the pieces a real tokenizer splits a benchmark's prompts into.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    base = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {t: i for i, t in enumerate(base)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    merges = _piece_merges(pieces, vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    if add_bos:
        tk.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])]
        )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=model_max_length,
        **(named_tokens or {}),
    )
    tok.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    if eos_token != "</s>" or pad_token != "<pad>":
        tok.add_special_tokens({"eos_token": eos_token, "pad_token": pad_token})
    return tok


def _piece_merges(pieces: Sequence[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Byte-level BPE merges that build each piece left to right from its bytes (new symbols added to ``vocab``)."""
    from tokenizers import pre_tokenizers

    split = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    merges: list[tuple[str, str]] = []
    for piece in pieces:
        words = split.pre_tokenize_str(piece)
        if len(words) != 1:
            raise ValueError(f"piece {piece!r} is not one word to the byte-level pre-tokenizer")
        symbol = words[0][0]
        for end in range(2, len(symbol) + 1):
            merged = symbol[:end]
            if merged not in vocab:
                merges.append((symbol[: end - 1], symbol[end - 1]))
                vocab[merged] = len(vocab)
    return merges


@dataclass(frozen=True)
class TinySizes:
    """Widths and depths of a tiny CLIP tower + Llama language model (the geometry is the real model's)."""

    vision_hidden: int = 64
    vision_intermediate: int = 128
    vision_layers: int = 3
    text_hidden: int = 64
    text_intermediate: int = 160
    text_layers: int = 4  # enough layers for in-LLM methods (FastV layer 1, SparseVLM layer 2)
    heads: int = 4


#: the random-weight demos' sizes
RANDOM_SIZES = TinySizes()
#: the trained tiny-llava: twice as wide, one more vision layer (about 1.6 M parameters, 3 MB in float16)
TRAINED_SIZES = TinySizes(
    vision_hidden=128, vision_intermediate=256, vision_layers=4, text_hidden=128, text_intermediate=320
)


def _llava_processor_args(tokenizer: Any, chat_template: str) -> dict[str, Any]:
    """What the LLaVA-1.5 and LLaVA-NeXT demo processors share: CLIP's 14 px patches, CLS dropped."""
    return {"tokenizer": tokenizer, "patch_size": 14, "vision_feature_select_strategy": "default",
            "num_additional_image_tokens": 1, "chat_template": chat_template}  # fmt: skip


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
    vision_config = _tiny_clip_config(sizes)
    text_config = _tiny_llama_config(tok, max_positions=4096, sizes=sizes)
    config = LlavaConfig(
        vision_config=vision_config,
        text_config=text_config,
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        image_seq_length=576,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
    )
    model = _seeded(LlavaForConditionalGeneration, config, seed)
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}, do_center_crop=True
    )
    processor = LlavaProcessor(image_processor=image_processor, **_llava_processor_args(tok, LLAVA15_CHAT_TEMPLATE))
    return model, processor


def _vocab_size(tok: Any) -> int:
    """Room for every token of the tokenizer, rounded up to a multiple of 8."""
    return -(-len(tok) // 8) * 8


def _seeded(model_cls: Any, config: Any, seed: int) -> Any:
    """`model_cls(config)` with weights from `seed`, leaving the caller's global RNG untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model_cls(config).eval()


def _tiny_llama_config(tok: Any, max_positions: int, sizes: TinySizes = RANDOM_SIZES) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=_vocab_size(tok),
        hidden_size=sizes.text_hidden,
        intermediate_size=sizes.text_intermediate,
        num_hidden_layers=sizes.text_layers,
        num_attention_heads=sizes.heads,
        num_key_value_heads=sizes.heads,
        max_position_embeddings=max_positions,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )


def _tiny_clip_config(sizes: TinySizes = RANDOM_SIZES) -> Any:
    from transformers import CLIPVisionConfig

    return CLIPVisionConfig(
        hidden_size=sizes.vision_hidden,
        intermediate_size=sizes.vision_intermediate,
        num_hidden_layers=sizes.vision_layers,
        num_attention_heads=sizes.heads,
        image_size=336,
        patch_size=14,
        projection_dim=32,
    )


def build_tiny_llava_next(seed: int = 0, sizes: TinySizes = RANDOM_SIZES) -> tuple[Any, Any]:
    """LLaVA-NeXT with the real geometry (CLIP 336 px / 14, layer -2, strategy "default", the default anyres
    pinpoints, base view + unpadded high-resolution grid: 2880 tokens for 672x672) and tiny widths."""
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    tok = build_byte_tokenizer(["<image>"])
    text_config = _tiny_llama_config(tok, max_positions=8192, sizes=sizes)
    config = LlavaNextConfig(
        vision_config=_tiny_clip_config(sizes),
        text_config=text_config,
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
    )
    model = _seeded(LlavaNextForConditionalGeneration, config, seed)
    pinpoints = config.image_grid_pinpoints
    assert pinpoints is not None  # typed optional, but the config fills in its default grid
    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": 336},
        crop_size={"height": 336, "width": 336},
        image_grid_pinpoints=[list(p) for p in pinpoints],
    )
    shared = _llava_processor_args(tok, LLAVA_NEXT_CHAT_TEMPLATE)
    return model, LlavaNextProcessor(image_processor=image_processor, **shared)


def _qwen_vision_widths(sizes: TinySizes | None) -> dict[str, int]:
    """The tiny Qwen2.5-VL tower's widths: the random demo's (None) or ``sizes``' (merger output: the text width)."""
    if sizes is None:
        return {"depth": 4, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}
    return {"depth": sizes.vision_layers, "hidden_size": sizes.vision_hidden, "num_heads": sizes.heads,
            "intermediate_size": sizes.vision_intermediate, "out_hidden_size": sizes.text_hidden}  # fmt: skip


def _qwen_text_widths(sizes: TinySizes | None) -> dict[str, Any]:
    """The tiny Qwen2 language model's widths, two query heads per key head; the multimodal-rope sections split
    half a head in the real model's 2:3:3 ratio (t, h, w)."""
    hidden, intermediate, layers, heads = (64, 128, 4, 4) if sizes is None else (
        sizes.text_hidden, sizes.text_intermediate, sizes.text_layers, sizes.heads)  # fmt: skip
    eighth = hidden // heads // 16
    return {"hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": heads // 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                "mrope_section": [2 * eighth, 3 * eighth, 3 * eighth]}}  # fmt: skip


def build_tiny_qwen2_5_vl(seed: int = 0, sizes: TinySizes | None = None) -> tuple[Any, Any]:
    """Qwen2.5-VL with the real geometry (patch 14, 2x2 merge, window 112, full-attention blocks, the hub's
    pixel budget 3136..12845056) and tiny widths (``sizes``; None: the random demo's own); the image-only processor
    (no torchvision needed)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from .qwen_processor import CareQwen2_5_VLProcessor

    tok = build_byte_tokenizer(QWEN_CONTROL_TOKENS, add_bos=False, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tid = tok.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        vision_config={
            **_qwen_vision_widths(sizes),
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [1, 3],
            "tokens_per_second": 2,
        },
        text_config={
            "vocab_size": _vocab_size(tok),
            **_qwen_text_widths(sizes),
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
    model = _seeded(Qwen2_5_VLForConditionalGeneration, config, seed)
    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": 3136, "longest_edge": 12845056}, patch_size=14, temporal_patch_size=2, merge_size=2
    )
    processor = CareQwen2_5_VLProcessor(
        image_processor=image_processor, tokenizer=tok, chat_template=QWEN25VL_CHAT_TEMPLATE
    )
    return model, processor


def build_tiny_qwen3_vl(seed: int = 0, sizes: TinySizes | None = None) -> tuple[Any, Any]:
    """Qwen3-VL with the real geometry (patch 16, 2x2 merge, resize factor 32, learned 48x48 position grid, the
    assumed hub pixel budget 65536..16777216, deepstack taps after vision blocks 1 and 2 of 4, interleaved
    M-RoPE) and tiny widths (``sizes``; None: the random demo's own); the image-only processor (no torchvision
    needed)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from .qwen_processor import CareQwen3VLProcessor

    tok = build_byte_tokenizer(QWEN_CONTROL_TOKENS, add_bos=False, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tid = tok.convert_tokens_to_ids
    # the random demo's text widths are Qwen2.5-VL's random ones (head 16, M-RoPE sections 2:3:3)
    text = _qwen_text_widths(sizes)
    config = Qwen3VLConfig(
        vision_config={**_qwen_vision_widths(sizes), "patch_size": 16, "spatial_merge_size": 2,
                       "temporal_patch_size": 2, "num_position_embeddings": 2304, "deepstack_visual_indexes": [1, 2]},
        text_config={"vocab_size": _vocab_size(tok), **text, "max_position_embeddings": 8192,
                     "head_dim": text["hidden_size"] // text["num_attention_heads"],
                     "rope_parameters": {**text["rope_parameters"], "rope_theta": 5e5, "mrope_interleaved": True},
                     "bos_token_id": None, "eos_token_id": tid("<|im_end|>"), "pad_token_id": tid("<|endoftext|>")},
        image_token_id=tid("<|image_pad|>"),
        video_token_id=tid("<|video_pad|>"),
        vision_start_token_id=tid("<|vision_start|>"),
        vision_end_token_id=tid("<|vision_end|>"),
    )  # fmt: skip
    model = _seeded(Qwen3VLForConditionalGeneration, config, seed)
    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": 65536, "longest_edge": 16777216}, patch_size=16, temporal_patch_size=2, merge_size=2,
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    )  # fmt: skip
    processor = CareQwen3VLProcessor(
        image_processor=image_processor, tokenizer=tok, chat_template=QWEN25VL_CHAT_TEMPLATE
    )
    return model, processor


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


def _tower_and_qwen2_widths(
    sizes: TinySizes | None, tower: tuple[int, int, int, int], text: tuple[int, int]
) -> tuple[dict[str, int], dict[str, int]]:
    """A ViT tower's and a Qwen2 language model's widths (two query heads per key head, 4 layers): the random demo's
    (``sizes`` None: ``tower`` = hidden, intermediate, layers, heads; ``text`` = hidden, intermediate, 4 heads) or
    ``sizes``'."""
    hidden, intermediate, layers, heads = tower if sizes is None else (
        sizes.vision_hidden, sizes.vision_intermediate, sizes.vision_layers, sizes.heads)  # fmt: skip
    text_hidden, text_intermediate, text_layers, text_heads = (*text, 4, 4) if sizes is None else (
        sizes.text_hidden, sizes.text_intermediate, sizes.text_layers, sizes.heads)  # fmt: skip
    return ({"hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
             "num_attention_heads": heads},
            {"hidden_size": text_hidden, "intermediate_size": text_intermediate, "num_hidden_layers": text_layers,
             "num_attention_heads": text_heads, "num_key_value_heads": text_heads // 2})  # fmt: skip


def build_tiny_internvl3(seed: int = 0, sizes: TinySizes | None = None) -> tuple[Any, Any]:
    """InternVL3 with the real geometry (InternViT 448 px tiles, patch 14, CLS, pixel shuffle 0.5: 256 tokens per
    tile; 1..12 tiles + a thumbnail, the GotOcr2 processor's defaults) and tiny InternViT / Qwen2 widths (``sizes``;
    None: the random demo's own); the image-only processor (no torchvision needed)."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    from .internvl3.processor import CareInternVLProcessor

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *INTERNVL_NAMED_TOKENS.values()]
    tok = build_byte_tokenizer(specials, add_bos=False, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                               named_tokens=INTERNVL_NAMED_TOKENS)  # fmt: skip
    tid = tok.convert_tokens_to_ids
    tower, text = _tower_and_qwen2_widths(sizes, (32, 64, 2, 2), (64, 128))
    config = InternVLConfig(
        vision_config={**tower, "image_size": [448, 448], "patch_size": [14, 14]},
        text_config={"model_type": "qwen2", "vocab_size": _vocab_size(tok), **text,
                     "max_position_embeddings": 8192, "bos_token_id": None,
                     "eos_token_id": tid("<|im_end|>"), "pad_token_id": tid("<|endoftext|>")},
        image_token_id=tid("<IMG_CONTEXT>"), image_seq_length=256, downsample_ratio=0.5,
        vision_feature_layer=-1, vision_feature_select_strategy="default", projector_hidden_act="gelu",
        tie_word_embeddings=False,
    )  # fmt: skip
    model = _seeded(InternVLForConditionalGeneration, config, seed)
    image_processor = GotOcr2ImageProcessorPil(
        size={"height": 448, "width": 448}, crop_to_patches=True, min_patches=1, max_patches=12
    )
    processor = CareInternVLProcessor(image_processor=image_processor, tokenizer=tok, image_seq_length=256,
                                      chat_template=INTERNVL_CHAT_TEMPLATE)  # fmt: skip
    return model, processor


def build_tiny_llava_onevision(seed: int = 0, sizes: TinySizes | None = None) -> tuple[Any, Any]:
    """LLaVA-OneVision with the real geometry (SigLIP 384 px / 14 = 27x27 = 729 patches, no CLS, layer -1, strategy
    "full", the anyres_max_9 pinpoints: 36 canvases 384..2304 in steps of 384) and tiny widths (``sizes``; None: the
    random demo's own): a SigLIP tower and a Qwen2 language model (GQA, qkv biases); the image-only processor (no
    torchvision needed)."""
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    from .llava_onevision.adapter import CareLlavaOnevisionProcessor

    tok = build_byte_tokenizer(
        [*QWEN_CONTROL_TOKENS[:3], "<image>", "<video>"],
        add_bos=False,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    tid = tok.convert_tokens_to_ids
    tower, text = _tower_and_qwen2_widths(sizes, (64, 128, 3, 4), (64, 160))
    config = LlavaOnevisionConfig(
        vision_config={"model_type": "siglip_vision_model", **tower, "image_size": 384, "patch_size": 14,
                       "vision_use_head": False},
        text_config={"model_type": "qwen2", "vocab_size": _vocab_size(tok), **text, "max_position_embeddings": 32768,
                     "bos_token_id": None, "eos_token_id": tid("<|im_end|>"),
                     "pad_token_id": tid("<|endoftext|>")},
        image_token_index=tid("<image>"),
        video_token_index=tid("<video>"),
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        vision_aspect_ratio="anyres_max_9",
    )  # fmt: skip
    model = _seeded(LlavaOnevisionForConditionalGeneration, config, seed)
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


def build_trained_tiny_llava(seed: int = 0) -> tuple[Any, Any]:
    """The trained tiny-llava's architecture (:data:`TRAINED_SIZES`), weights drawn from ``seed``: the starting
    point of ``scripts/train_demo`` and the skeleton the shipped weights are loaded into."""
    return build_tiny_llava(seed, TRAINED_SIZES)


def build_trained_tiny_llava_next(seed: int = 0) -> tuple[Any, Any]:
    """The trained tiny-llava-next's architecture (:data:`TRAINED_SIZES`, tiny-llava's), weights from ``seed``."""
    return build_tiny_llava_next(seed, TRAINED_SIZES)


def build_trained_tiny_qwen2_5_vl(seed: int = 0) -> tuple[Any, Any]:
    """The trained tiny-qwen2.5-vl's architecture (:data:`TRAINED_SIZES`: tower 128 wide, 4 blocks; language model
    128 wide, 4 layers), weights from ``seed``."""
    return build_tiny_qwen2_5_vl(seed, TRAINED_SIZES)


def build_trained_tiny_qwen3_vl(seed: int = 0) -> tuple[Any, Any]:
    """The trained tiny-qwen3-vl's architecture (:data:`TRAINED_SIZES`: tower 128 wide, 4 blocks, two deepstack
    mergers; language model 128 wide, 4 layers), weights from ``seed``."""
    return build_tiny_qwen3_vl(seed, TRAINED_SIZES)


def build_trained_tiny_llava_onevision(seed: int = 0) -> tuple[Any, Any]:
    """The trained tiny-llava-onevision's architecture (:data:`TRAINED_SIZES`: SigLIP 128 wide, 4 layers; Qwen2 128
    wide, 4 layers), weights from ``seed``."""
    return build_tiny_llava_onevision(seed, TRAINED_SIZES)


def build_trained_tiny_internvl3(seed: int = 0) -> tuple[Any, Any]:
    """The trained tiny-internvl3's architecture (:data:`TRAINED_SIZES`: InternViT 128 wide, 4 layers; Qwen2 128
    wide, 4 layers), weights from ``seed``."""
    return build_tiny_internvl3(seed, TRAINED_SIZES)


#: demo name -> demo, from the family registry (each family's record names its demos and their builders above)
DEMO_BACKBONES: dict[str, DemoBackbone] = demo_backbones()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def shipped_weights(spec: DemoBackbone) -> tuple[Path, dict[str, Any]]:
    """The shipped weight file of a trained demo and its manifest entry, checked (ModelLoadError if unusable)."""
    assert spec.weights is not None
    path = weights_dir() / spec.weights
    entry = read_manifest().get(spec.weights)
    if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str):
        raise ModelLoadError(f"{spec.name}: no entry for {spec.weights} in {weights_dir() / MANIFEST}; reinstall care")
    if not path.is_file() or file_sha256(path) != entry["sha256"]:
        raise ModelLoadError(
            f"{spec.name}: the weights shipped with care ({path}) are missing or damaged; reinstall care"
        )
    return path, entry


def demo_marker(spec: DemoBackbone, sha256: str | None = None) -> dict[str, Any]:
    return {
        "name": spec.name,
        "version": spec.version,
        "family": spec.family,
        "seed": spec.seed,
        "weights": "trained on synthetic shapes" if spec.trained else "random weights",
        "description": spec.description,
        "note": spec.note,
        "sha256": sha256,
    }


def read_marker(folder: Path) -> dict[str, Any] | None:
    """The folder's ``care_demo.json`` (None when absent or unreadable)."""
    try:
        marker = json.loads((Path(folder) / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def marker_note(marker: dict[str, Any]) -> str:
    """The demo note a marker stands for (older markers carry none: their demos had random weights)."""
    note = marker.get("note")
    if isinstance(note, str) and note:
        return note
    return TRAINED_DEMO_NOTE if "trained" in str(marker.get("weights", "")) else RANDOM_DEMO_NOTE


def weights_problem(folder: Path, marker: dict[str, Any]) -> str | None:
    """Why the folder's weight file does not match the hash its marker records (None: it matches, or no hash)."""
    expected = marker.get("sha256")
    if not isinstance(expected, str):
        return None
    path = Path(folder) / WEIGHTS_FILE
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    wanted = marker.get("bytes")
    if isinstance(wanted, int) and size < wanted:
        return f"truncated ({size} of {wanted} bytes)"
    if file_sha256(path) != expected:
        return "corrupt (sha256 mismatch)"
    return None


def outdated(spec: DemoBackbone, marker: dict[str, Any]) -> str | None:
    """Why a cached trained demo is not the one this care ships (None: it is, or the demo is random).

    The marker's hash only says the cached file is what was cached; a care whose shipped weights were retrained
    (a new manifest entry) must not keep answering with the old ones, so a trained demo's marker must also carry
    the manifest's sha256."""
    if spec.weights is None:
        return None
    entry = read_manifest().get(spec.weights)  # none listed: a random demo (an optional file not installed)
    shipped = entry.get("sha256") if isinstance(entry, dict) else None
    cached = marker.get("sha256")
    if shipped is None or cached == shipped:
        return None
    return f"another release's (sha256 {str(cached)[:12]}, this care ships {str(shipped)[:12]})"


def _is_built(folder: Path, spec: DemoBackbone) -> bool:
    marker = read_marker(folder)
    return marker is not None and marker.get("name") == spec.name and marker.get("version") == spec.version


@dataclass(frozen=True)
class DemoInstall:
    """Where a demo lives, and what happened on the way (one-line notices for the user)."""

    folder: Path
    notices: tuple[str, ...] = ()


def install_demo(name: str, home: Path) -> DemoInstall:
    """Build demo ``name`` under ``home/demo/`` unless a complete, intact copy is there; return where it is.

    A trained demo is the spec's architecture saved with ``save_pretrained`` (config, processor) whose
    ``model.safetensors`` is a byte copy of the shipped weights (sha256 from ``demo_weights/manifest.json``);
    a random one is built from its seed. The marker records the weight file's sha256, checked on every call:
    a truncated, edited or missing weight file is rebuilt (restored) and reported in ``notices``. The build
    goes to a temporary sibling folder renamed into place with ``os.replace``, so a concurrent process sees
    no folder, or a complete one.
    """
    spec = demo_backbones()[name]
    root = Path(home) / "demo"
    target = root / spec.folder_name
    notices: list[str] = []
    marker = read_marker(target) if _is_built(target, spec) else None
    if marker is not None:
        damage, older = weights_problem(target, marker), outdated(spec, marker)
        if damage is None and older is None:
            return DemoInstall(target)
        source = "the copy shipped with care" if spec.trained else f"seed {spec.seed}"
        done = f"restored from {source}" if damage else f"replaced by {source}"
        notices.append(f"{spec.name}: cached weights in {target} were {damage or older}; {done}")
    if _other_rank_builds():
        _wait_until_intact(target, spec)
        return DemoInstall(target, tuple(notices))
    _build_into(spec, root, target)
    return DemoInstall(target, tuple(notices))


def group_rank() -> int | None:
    """This process's rank in an initialised process group, or None where there is none (no import of
    torch.distributed unless something else imported it: then no group can exist)."""
    if "torch.distributed" not in sys.modules:
        return None
    import torch.distributed as dist

    return int(dist.get_rank()) if dist.is_available() and dist.is_initialized() else None


def _other_rank_builds() -> bool:
    """True in a process group's rank > 0: there transformers' save_pretrained writes nothing (only rank 0
    saves), so rank 0 builds the demo and the other ranks wait for it."""
    return group_rank() not in (None, 0)


def _wait_until_intact(target: Path, spec: DemoBackbone, timeout_s: float = 900.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not _intact(target, spec):
        if time.monotonic() > deadline:
            raise ModelLoadError(f"{spec.name}: rank 0 did not finish building {target} in {timeout_s:.0f} s")
        time.sleep(0.2)


def _intact(folder: Path, spec: DemoBackbone) -> bool:
    marker = read_marker(folder) if _is_built(folder, spec) else None
    return (marker is not None and (folder / "config.json").is_file() and weights_problem(folder, marker) is None
            and outdated(spec, marker) is None)  # fmt: skip


def _build_into(spec: DemoBackbone, root: Path, target: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.folder_name}.tmp-", dir=root))
    try:
        with quiet_transformers():
            model, processor = spec.build(spec.seed)
            model.save_pretrained(str(tmp))
            processor.save_pretrained(str(tmp))
        if spec.trained:
            source, _ = shipped_weights(spec)
            shutil.copyfile(source, tmp / WEIGHTS_FILE)
        weights = tmp / WEIGHTS_FILE
        if not ((tmp / "config.json").is_file() and weights.is_file()):
            raise ModelLoadError(f"{spec.name}: building the demo in {tmp} wrote no config.json or weights")
        marker = {**demo_marker(spec, file_sha256(weights)), "bytes": weights.stat().st_size}
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
        if target.exists() and not _intact(target, spec):
            # a stale, damaged or half-deleted folder: move it aside, then replace it
            stale = Path(tempfile.mkdtemp(prefix=f".{spec.folder_name}.stale-", dir=root))
            with contextlib.suppress(OSError):
                os.replace(target, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:
            if not _intact(target, spec):  # lost a race to a process that built it: fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_demo(name: str, home: Path) -> Path:
    """:func:`install_demo`'s folder (notices dropped)."""
    return install_demo(name, home).folder
