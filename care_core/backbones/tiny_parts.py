"""The parts the families' tiny demo builders share (each family's builders: ``care_core.backbones.<family>.demo``).

An offline byte-level tokenizer, the tiny widths (:class:`TinySizes`: the random demos' and the trained skeletons'),
seeded construction that leaves the caller's RNG alone, and the tiny CLIP / Llama / Qwen configs and widths several
families build from. The geometry of each demo is its family's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

#: the Qwen chat markup's control tokens and image placeholders (Qwen2.5-VL, Qwen3-VL; LLaVA-OneVision the first 3)
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
    split_pattern: str | None = None,
) -> Any:
    """An offline byte-level tokenizer that encodes any text without ``<unk>``.

    A byte-level BPE with the 256-symbol byte alphabet and no merges (one token per UTF-8 byte),
    ``<unk> <s> </s> <pad>`` as ids 0-3, ``<s>`` prepended like Llama (unless ``add_bos`` is False, as
    for Qwen), and ``special_tokens`` (e.g. ``"<image>"``) registered as never-split special tokens after
    the bytes. ``eos_token`` / ``pad_token`` may name one of ``special_tokens``. ``named_tokens``: tokenizer
    attributes naming some of ``special_tokens`` (e.g. InternVL's ``context_image_token``), saved with it.
    ``pieces``: strings encoded as one token each wherever a word is made of them (merges built byte by byte,
    in the order given), e.g. the pieces a real tokenizer splits a benchmark's prompts into. ``split_pattern``: the
    regex that real tokenizer cuts text into words with before merging (None: byte-level BPE's own, GPT-2's); it
    decides which pieces can be one token (Qwen2's ``"?\\n"``), and with no pieces changes no id.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    base = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {t: i for i, t in enumerate(base)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    words = _word_splitter(split_pattern)
    merges = _piece_merges(pieces, vocab, words)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tk.pre_tokenizer = words
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


def _word_splitter(split_pattern: str | None) -> Any:
    """The byte-level pre-tokenizer: GPT-2's word regex (None) or ``split_pattern``'s, then bytes as symbols."""
    from tokenizers import Regex, pre_tokenizers

    if split_pattern is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split_pattern), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])  # fmt: skip


def _piece_merges(pieces: Sequence[str], vocab: dict[str, int], split: Any) -> list[tuple[str, str]]:
    """Byte-level BPE merges that build each piece left to right from its bytes (new symbols added to ``vocab``);
    ``split``: the pre-tokenizer, to which each piece must be one word."""
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

#: CLIP-336's view: the shortest edge resized to 336 px, the centre 336 x 336 cropped
CLIP_VIEW: dict[str, Any] = {"size": {"shortest_edge": 336}, "crop_size": {"height": 336, "width": 336}}


def llava_processor_args(tokenizer: Any, chat_template: str) -> dict[str, Any]:
    """What the LLaVA-1.5 and LLaVA-NeXT processors share (demos and full-size models): CLIP's 14 px patches, CLS
    dropped."""
    return {"tokenizer": tokenizer, "patch_size": 14, "vision_feature_select_strategy": "default",
            "num_additional_image_tokens": 1, "chat_template": chat_template}  # fmt: skip


def vocab_size(tok: Any) -> int:
    """Room for every token of the tokenizer, rounded up to a multiple of 8."""
    return -(-len(tok) // 8) * 8


def seeded_model(model_cls: Any, config: Any, seed: int) -> Any:
    """`model_cls(config)` with weights from `seed`, leaving the caller's global RNG untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model_cls(config).eval()


def tiny_llama_config(tok: Any, max_positions: int, sizes: TinySizes = RANDOM_SIZES) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size(tok),
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


def tiny_clip_config(sizes: TinySizes = RANDOM_SIZES) -> Any:
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


def qwen_vision_widths(sizes: TinySizes | None) -> dict[str, int]:
    """The tiny Qwen2.5-VL tower's widths: the random demo's (None) or ``sizes``' (merger output: the text width)."""
    if sizes is None:
        return {"depth": 4, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}
    return {"depth": sizes.vision_layers, "hidden_size": sizes.vision_hidden, "num_heads": sizes.heads,
            "intermediate_size": sizes.vision_intermediate, "out_hidden_size": sizes.text_hidden}  # fmt: skip


def qwen_text_widths(sizes: TinySizes | None) -> dict[str, Any]:
    """The tiny Qwen2 language model's widths, two query heads per key head; the multimodal-rope sections split
    half a head in the real model's 2:3:3 ratio (t, h, w)."""
    hidden, intermediate, layers, heads = (64, 128, 4, 4) if sizes is None else (
        sizes.text_hidden, sizes.text_intermediate, sizes.text_layers, sizes.heads)  # fmt: skip
    eighth = hidden // heads // 16
    return {"hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": heads // 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                "mrope_section": [2 * eighth, 3 * eighth, 3 * eighth]}}  # fmt: skip


def tower_and_qwen2_widths(
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
