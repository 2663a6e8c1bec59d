"""Every family at full size with seeded random weights, built directly on the device (:data:`FULL_SIZE`).

care_core ships tiny demo builders only (``care_core.backbones.demo``); the GPU benchmarks need the real shapes.
LLaVA-1.5-7B and LLaVA-NeXT-7B: CLIP-L/336 (24 layers), the 1024->4096->4096 GELU projector and Vicuna-7B, with the
demos' byte tokenizer and chat templates (or, with ``tokenizer="llama-pieces"``, that tokenizer knowing the pieces
the real one splits the shipped POPE-style prompts into). ``tiny=True`` keeps the same image geometry (576 tokens
per 336x336 view) at tiny widths, for a smoke test on the CPU. Qwen2.5-VL-7B, Qwen3-VL-8B, LLaVA-OneVision-7B
and InternVL3-8B: their demo's config at the flops spec's widths, with the demo's processor. Weights are random:
timings do not depend on their values.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from care_core.backbones.demo import LLAVA15_CHAT_TEMPLATE, LLAVA_NEXT_CHAT_TEMPLATE, build_byte_tokenizer

Widths = dict[str, Any]
VISION_7B: Widths = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16)
TEXT_7B: Widths = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=32)  # fmt: skip
VISION_TINY: Widths = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4)
TEXT_TINY: Widths = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=4)  # fmt: skip
VIEW: dict[str, Any] = {"size": {"shortest_edge": 336}, "crop_size": {"height": 336, "width": 336}}
#: the pieces of more than one character that the Llama 2 tokenizer (Vicuna v1.5's, so LLaVA-1.5-7B's and
#: LLaVA-NeXT-vicuna-7B's) splits the shipped POPE-style task's prompts into under both chat templates below (read with
#: llama-tokenizer-js 1.2.2 from the npm registry, 2026-11-27; its vocabulary is not shipped here): with them the
#: stand-in tokenizer gives those prompts the real row counts (29-30 text rows with <s>, against 96-102 bytes)
LLAMA_POPE_PIECES = ("USER", "Is", " there", " a", " person", " in", " the", " image", "Answer", " question", " using",
                     " single", " word", " or", " phrase", " A", "SS", "IST", "ANT", " flag", " cat", " cup", " sp",
                     "oon", " dog", " car", " an", " animal", "INST", " [")  # fmt: skip
#: the stand-in tokenizers a benchmark model may carry: every text byte by byte (the demos'), or with the pieces above
TOKENIZER_PIECES: dict[str, tuple[str, ...]] = {"bytes": (), "llama-pieces": LLAMA_POPE_PIECES}
DEFAULT_TOKENIZER = "bytes"  # the models' default: every benchmark's but bench_eval_gpu's (its own until 2026-11-27)
#: bench_eval_gpu's default from 2026-11-27 night: care eval on the task as a user runs it, whose real checkpoint
#: gives its prompts 29-30 text rows
TASK_TOKENIZER = "llama-pieces"


def _configs(tok: Any, tiny: bool, max_positions: int) -> dict[str, Any]:
    """The keyword arguments both LLaVA configs share: CLIP-L/336 and Vicuna-7B (or tiny widths)."""
    from transformers import CLIPVisionConfig, LlamaConfig

    vision = CLIPVisionConfig(**(VISION_TINY if tiny else VISION_7B), image_size=336, patch_size=14,
                              projection_dim=768, hidden_act="quick_gelu")  # fmt: skip
    text = LlamaConfig(vocab_size=32064, max_position_embeddings=max_positions, rms_norm_eps=1e-5,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                       **(TEXT_TINY if tiny else TEXT_7B))  # fmt: skip
    return {"vision_config": vision, "text_config": text, "image_token_index": tok.convert_tokens_to_ids("<image>"),
            "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
            "projector_hidden_act": "gelu"}  # fmt: skip


def _random_model(model_cls: Any, config: Any, device: torch.device, dtype: torch.dtype, seed: int) -> Any:
    """The model built directly on ``device`` in ``dtype`` with seeded random weights, eval mode, no grads."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(seed)
        with torch.device(device):
            model = model_cls(config)
    finally:
        torch.set_default_dtype(saved)
    model = model.to(device=device).eval()
    model.requires_grad_(False)
    return model


def _processor_options(template: str) -> dict[str, Any]:
    return {"patch_size": 14, "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1,
            "chat_template": template}  # fmt: skip


def build_llava(
    device: torch.device, dtype: torch.dtype, tiny: bool = False, tokenizer: str = DEFAULT_TOKENIZER
) -> tuple[Any, Any]:
    """LLaVA-1.5-7B (CLIP-L/336 24 layers, 1024->4096->4096 GELU projector, Vicuna-7B): (model, processor)."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tok = build_byte_tokenizer(["<image>"], pieces=TOKENIZER_PIECES[tokenizer])
    config = LlavaConfig(**_configs(tok, tiny, max_positions=4096), image_seq_length=576)
    model = _random_model(LlavaForConditionalGeneration, config, device, dtype, seed=0)
    images = CLIPImageProcessorPil(**VIEW, do_center_crop=True)
    processor = LlavaProcessor(image_processor=images, tokenizer=tok, **_processor_options(LLAVA15_CHAT_TEMPLATE))
    return model, processor


def build_llava_next(
    device: torch.device, dtype: torch.dtype, tiny: bool = False, tokenizer: str = DEFAULT_TOKENIZER
) -> tuple[Any, Any]:
    """LLaVA-NeXT-7B (vicuna): the LLaVA-1.5-7B parts + anyres (default pinpoints): (model, processor)."""
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    tok = build_byte_tokenizer(["<image>"], pieces=TOKENIZER_PIECES[tokenizer])
    config = LlavaNextConfig(**_configs(tok, tiny, max_positions=8192))
    model = _random_model(LlavaNextForConditionalGeneration, config, device, dtype, seed=1)
    pinpoints = [list(p) for p in config.image_grid_pinpoints or ()]
    images = LlavaNextImageProcessorPil(**VIEW, image_grid_pinpoints=pinpoints)
    options = _processor_options(LLAVA_NEXT_CHAT_TEMPLATE)
    processor = LlavaNextProcessor(image_processor=images, tokenizer=tok, **options)
    return model, processor


# ------------------------------------------------------------------ Qwen2.5-VL, Qwen3-VL, LLaVA-OneVision, InternVL3
# The demo builders (care_core.backbones.demo) hold each family's geometry, token ids and processor; the full-size
# models take the demo's config and replace its widths with the flops spec's (care_core.flops.specs.KNOWN_BACKBONES).


def _text_widths(lm: Any) -> Widths:
    """A transformers text config's widths from a flops spec's LanguageModelSpec (``layer_types`` dropped: the
    config recomputes it for the new depth)."""
    return dict(vocab_size=lm.vocab, hidden_size=lm.hidden, intermediate_size=lm.intermediate,
                num_hidden_layers=lm.layers, num_attention_heads=lm.heads, num_key_value_heads=lm.kv_heads,
                head_dim=lm.head_dim, max_position_embeddings=32768)  # fmt: skip


def _widened(config: Any, vision: Widths, text: Widths) -> Any:
    """``config`` (a demo's) with its vision and text widths replaced."""
    data = config.to_dict()
    data["text_config"].pop("layer_types", None)
    data["vision_config"].update(vision)
    data["text_config"].update(text)
    return type(config).from_dict(data)


def qwen3_vl_8b_config(tiny_config: Any) -> Any:
    """Qwen3-VL-8B: the 27-block ViT (1152 wide, deepstack after blocks 8, 16, 24) and the 36-layer Qwen3-8B text
    model (GQA 32/8, head_dim 128; interleaved M-RoPE sections 24/20/20 of its 64 frequencies)."""
    from care_core.flops.specs import KNOWN_BACKBONES

    spec = KNOWN_BACKBONES["qwen3-vl-8b"]
    vit = spec.vision
    vision = dict(depth=vit.layers, hidden_size=vit.hidden, intermediate_size=vit.intermediate,
                  num_heads=vit.heads, out_hidden_size=spec.projector.out_dim,
                  deepstack_visual_indexes=list(vit.deepstack_layers))  # fmt: skip
    rope = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20], "mrope_interleaved": True}
    return _widened(tiny_config, vision, {**_text_widths(spec.lm), "rope_parameters": rope})


def qwen2_5_vl_7b_config(tiny_config: Any) -> Any:
    """Qwen2.5-VL-7B: the 32-block windowed ViT (1280 wide, full attention in blocks 7, 15, 23, 31) and the 28-layer
    Qwen2.5-7B text model (GQA 28/4; M-RoPE sections 16/24/24 of its 64 frequencies, theta 1e6), as
    Qwen/Qwen2.5-VL-7B-Instruct's config.json gives them (the flops spec's dims)."""
    from care_core.flops.specs import KNOWN_BACKBONES

    spec = KNOWN_BACKBONES["qwen2.5-vl-7b"]
    vit = spec.vision
    vision = dict(depth=vit.layers, hidden_size=vit.hidden, intermediate_size=vit.intermediate, num_heads=vit.heads,
                  out_hidden_size=spec.projector.out_dim, window_size=vit.window_size,
                  fullatt_block_indexes=list(vit.full_attention_layers))  # fmt: skip
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}
    return _widened(tiny_config, vision, {**_text_widths(spec.lm), "rope_parameters": rope})


def _spec_widths(tiny_config: Any, spec_name: str) -> Any:
    """``tiny_config`` at the widths of the flops spec ``spec_name``: its ViT's and its language model's."""
    from care_core.flops.specs import KNOWN_BACKBONES

    spec = KNOWN_BACKBONES[spec_name]
    vit = spec.vision
    vision = dict(hidden_size=vit.hidden, intermediate_size=vit.intermediate, num_hidden_layers=vit.layers,
                  num_attention_heads=vit.heads)  # fmt: skip
    return _widened(tiny_config, vision, _text_widths(spec.lm))


def llava_onevision_7b_config(tiny_config: Any) -> Any:
    """LLaVA-OneVision-7B: SigLIP-so400m/384 (26 layers used) and Qwen2-7B."""
    return _spec_widths(tiny_config, "llava-onevision-7b")


def internvl3_8b_config(tiny_config: Any) -> Any:
    """InternVL3-8B: InternViT-300M (24 layers, 1024 wide) and the Qwen2.5-7B-sized text model."""
    return _spec_widths(tiny_config, "internvl3-8b")


#: family -> (the flops spec, the demo builder, the full-size config from the demo's, the adapter class name)
FAMILY_MODELS: dict[str, tuple[str, str, Any, str]] = {
    "qwen2.5-vl": ("qwen2.5-vl-7b", "build_tiny_qwen2_5_vl", qwen2_5_vl_7b_config, "Qwen2_5_VLAdapter"),
    "qwen3-vl": ("qwen3-vl-8b", "build_tiny_qwen3_vl", qwen3_vl_8b_config, "Qwen3VLAdapter"),
    "llava-onevision": ("llava-onevision-7b", "build_tiny_llava_onevision", llava_onevision_7b_config,
                        "LlavaOnevisionAdapter"),
    "internvl3": ("internvl3-8b", "build_tiny_internvl3", internvl3_8b_config, "InternVLAdapter"),
}  # fmt: skip


def build_family(family: str, device: torch.device, dtype: torch.dtype, tiny: bool = False) -> tuple[Any, Any]:
    """The family's full-size model (random weights seeded 0, built on ``device`` in ``dtype``) with its demo's
    processor (same image processor settings; the byte tokenizer); ``tiny``: the demo model itself."""
    from care_core.backbones import demo

    _, builder, full_config, _ = FAMILY_MODELS[family]
    small, processor = getattr(demo, builder)(0)
    if tiny:
        return small.to(device=device, dtype=dtype).requires_grad_(False), processor
    return _random_model(type(small), full_config(small.config), device, dtype, seed=0), processor


@dataclass(frozen=True)
class FullSize:
    """One family at full size for the GPU benchmarks: its flops spec, adapter class, builder and image side."""

    spec: str  # the flops spec (care_core.flops.specs.KNOWN_BACKBONES) whose dims the model takes
    adapter: str  # the adapter class in care_core.backbones
    side: int  # the square image side the latency gate feeds it (issue #47's table)
    build: Callable[[torch.device, torch.dtype, bool], tuple[Any, Any]]  # (device, dtype, tiny) -> (model, processor)


#: every family the benchmarks build at full size, in the latency gate's order
FULL_SIZE: dict[str, FullSize] = {
    "llava-1.5": FullSize("llava-1.5-7b", "LlavaAdapter", 336, partial(build_llava, tokenizer=TASK_TOKENIZER)),
    "llava-next": FullSize("llava-next-7b", "LlavaNextAdapter", 672,
                           partial(build_llava_next, tokenizer=TASK_TOKENIZER)),
    "llava-onevision": FullSize("llava-onevision-7b", "LlavaOnevisionAdapter", 768,
                                partial(build_family, "llava-onevision")),
    "qwen2.5-vl": FullSize("qwen2.5-vl-7b", "Qwen2_5_VLAdapter", 1008, partial(build_family, "qwen2.5-vl")),
    "qwen3-vl": FullSize("qwen3-vl-8b", "Qwen3VLAdapter", 1024, partial(build_family, "qwen3-vl")),
    "internvl3": FullSize("internvl3-8b", "InternVLAdapter", 672, partial(build_family, "internvl3")),
}  # fmt: skip


def full_size_adapter(family: str, device: torch.device, tiny: bool = False) -> Any:
    """The family's adapter over its full-size model (bf16 on CUDA, float32 elsewhere; ``tiny``: the small widths)."""
    from care_core import backbones

    entry = FULL_SIZE[family]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, processor = entry.build(device, dtype, tiny)
    return getattr(backbones, entry.adapter)(model, processor, name=f"{entry.spec} (random weights)")


def save_full_size_model(family: str, folder: Path, device: str, tiny: bool) -> dict[str, Any]:
    """:func:`save_random_model` for a family of :data:`FULL_SIZE` (its builder, its byte tokenizer)."""
    return save_random_model("_full_size_build", folder, device, tiny, family=family)


def _full_size_build(device: torch.device, dtype: torch.dtype, tiny: bool, *, family: str) -> tuple[Any, Any]:
    return FULL_SIZE[family].build(device, dtype, tiny)


def save_random_model(builder: str, folder: Path, device: str, tiny: bool, **options: Any) -> dict[str, Any]:
    """``builder``'s model (a function of this module; ``options`` are its own, e.g. ``tokenizer``) with seeded random
    weights, bf16 on CUDA, saved to ``folder`` and flushed to the disk; returns what it cost. For benchmarks that time
    a command loading it."""
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    start = time.perf_counter()
    model, processor = globals()[builder](torch.device(device), dtype, tiny, **options)
    built = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters())
    start = time.perf_counter()
    model.save_pretrained(str(folder))
    processor.save_pretrained(str(folder))
    # A 7B checkpoint is 14 GB of dirty pages: until they reach the disk, any fsync of the timed command waits on
    # them (lmms-eval's response cache: 1.78 s in the first timed setting against 0.09 s in the next, H100 2026-11-27)
    os.sync()
    saved = time.perf_counter() - start
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the timed command runs in its own process: leave it the memory
    return {"parameters": params, "dtype": str(dtype).removeprefix("torch."), "build_s": built, "save_s": saved,
            "tiny": tiny, **options}  # fmt: skip
