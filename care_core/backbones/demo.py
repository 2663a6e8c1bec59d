"""Embedded demo backbones: real geometry, tiny widths, seeded random weights, built offline.

A demo is built once into ``<care home>/demo/<name>-v<version>/`` with ``save_pretrained`` (model and
processor) and then loaded through exactly the same code path as any real checkpoint folder. Its
answers are meaningless (random weights); its token counts, shapes and module layout are the real
model family's, so every command works end to end without a download.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ._hf import quiet_transformers

MARKER = "care_demo.json"

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


@dataclass(frozen=True)
class DemoBackbone:
    """One embedded demo: how to build it (model, processor) from a seed."""

    name: str
    version: int
    family: str
    seed: int
    description: str
    build: Callable[[int], tuple[Any, Any]]

    @property
    def folder_name(self) -> str:
        return f"{self.name}-v{self.version}"


def build_byte_tokenizer(special_tokens: list[str], model_max_length: int = 8192) -> Any:
    """An offline byte-level tokenizer that encodes any text without ``<unk>``.

    A byte-level BPE with the 256-symbol byte alphabet and no merges (one token per UTF-8 byte),
    ``<unk> <s> </s> <pad>`` as ids 0-3, ``<s>`` prepended like Llama, and ``special_tokens``
    (e.g. ``"<image>"``) registered as never-split special tokens after the bytes.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    base = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {t: i for i, t in enumerate(base)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
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
    )
    tok.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    return tok


def build_tiny_llava(seed: int = 0) -> tuple[Any, Any]:
    """LLaVA-1.5 with the real geometry (CLIP 336 px, patch 14, 24x24 = 576 tokens, layer -2,
    strategy "default") and tiny widths; weights drawn from ``seed`` without touching the
    caller's global RNG. Returns ``(model, processor)`` in eval mode, float32, on the CPU."""
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tok = build_byte_tokenizer(["<image>"])
    vocab_size = -(-len(tok) // 8) * 8  # room for every token, rounded up to a multiple of 8
    vision_config = CLIPVisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=336,
        patch_size=14,
        projection_dim=32,
    )
    text_config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=4,  # enough layers for in-LLM methods (FastV layer 1, SparseVLM layer 2)
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    config = LlavaConfig(
        vision_config=vision_config,
        text_config=text_config,
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        image_seq_length=576,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlavaForConditionalGeneration(config).eval()
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}, do_center_crop=True
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=LLAVA15_CHAT_TEMPLATE,
    )
    return model, processor


DEMO_BACKBONES: dict[str, DemoBackbone] = {
    "tiny-llava": DemoBackbone(
        name="tiny-llava",
        version=2,
        family="llava-1.5",
        seed=0,
        description="LLaVA-1.5 geometry (CLIP-336/14, 576 tokens), tiny random weights; demo only",
        build=build_tiny_llava,
    ),
}


def demo_marker(spec: DemoBackbone) -> dict[str, Any]:
    return {
        "name": spec.name,
        "version": spec.version,
        "family": spec.family,
        "seed": spec.seed,
        "weights": "random weights",
        "description": spec.description,
    }


def _is_built(folder: Path, spec: DemoBackbone) -> bool:
    try:
        marker = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return marker.get("name") == spec.name and marker.get("version") == spec.version


def ensure_demo(name: str, home: Path) -> Path:
    """Build demo ``name`` under ``home/demo/`` unless it is already there; return its folder.

    The build goes to a temporary sibling folder that is renamed into place with ``os.replace``,
    so a concurrent process either sees no folder, or a complete one.
    """
    spec = DEMO_BACKBONES[name]
    root = Path(home) / "demo"
    target = root / spec.folder_name
    if _is_built(target, spec):
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.folder_name}.tmp-", dir=root))
    try:
        with quiet_transformers():
            model, processor = spec.build(spec.seed)
            model.save_pretrained(str(tmp))
            processor.save_pretrained(str(tmp))
        (tmp / MARKER).write_text(json.dumps(demo_marker(spec), indent=2) + "\n", encoding="utf-8")
        if target.exists() and not _is_built(target, spec):
            # a stale or half-deleted folder from an older run: move it aside, then replace it
            stale = Path(tempfile.mkdtemp(prefix=f".{spec.folder_name}.stale-", dir=root))
            with contextlib.suppress(OSError):
                os.replace(target, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:
            if not _is_built(target, spec):  # lost a race to a process that built it: fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
