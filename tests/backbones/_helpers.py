"""Helpers shared by the backbone tests."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from PIL import Image

from care_core.backbones.probes import attention_settings
from care_core.backbones.static_generation import StaticPrompt


def noise_image(height: int, width: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((height, width, 3)) * 255).astype(np.uint8))


def forward_with_image_rows(adapter: Any, inputs: Any) -> tuple[Any, torch.Tensor]:
    """``adapter.model(**inputs)`` and the rows its language model receives at the image placeholders.

    Read from the decoder's ``inputs_embeds`` (not the output's ``image_outputs``, which only transformers
    >= 5.24 returns), so the processor-path comparisons run on every supported version.
    """
    seen: dict[str, torch.Tensor] = {}

    def grab(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen["embeds"] = kwargs["inputs_embeds"]

    hook = adapter._language_model.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            out = adapter.model(**inputs)
    finally:
        hook.remove()
    placeholders = inputs["input_ids"][0] == adapter.image_token_id
    return out, seen["embeds"][0][placeholders.to(seen["embeds"].device)]


def reference_ids(adapter: Any, inputs: dict[str, Any], max_new_tokens: int) -> list[int]:
    """``model.generate``'s greedy continuation of one prompt, called directly (not through the adapter)."""
    tok = adapter.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    with torch.no_grad():
        out = adapter.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                                     pad_token_id=pad)  # fmt: skip
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def hub_key(key: str) -> str:
    """A transformers 5.x saved key -> the hub's 4.x layout (llava-hf checkpoints)."""
    if key.startswith("model."):  # 5.x module path, in case save_pretrained ever writes it
        key = key[len("model.") :]
        if key.startswith("language_model."):
            key = "language_model.model." + key[len("language_model.") :]
    if key.startswith("lm_head."):
        key = "language_model." + key
    if key.startswith("vision_tower.") and not key.startswith("vision_tower.vision_model."):
        key = "vision_tower.vision_model." + key[len("vision_tower.") :]
    return key


def position_image(height: int, width: int) -> Image.Image:
    """R encodes x, G encodes y: R = (x + 0.5) / W * 255, G = (y + 0.5) / H * 255; B = 128 (padding stays 0)."""
    xs = (np.arange(width) + 0.5) / width * 255
    ys = (np.arange(height) + 0.5) / height * 255
    arr = np.zeros((height, width, 3), dtype=np.uint8)
    arr[..., 0] = np.round(xs)[None, :]
    arr[..., 1] = np.round(ys)[:, None]
    arr[..., 2] = 128
    return Image.fromarray(arr)


HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def hook_snapshot(model: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], ...]]:
    return {
        name: tuple(tuple(getattr(module, attr, {}).keys()) for attr in HOOK_DICTS)
        for name, module in model.named_modules()
    }


def attn_strings(model: torch.nn.Module) -> tuple[str, str, str]:
    cfg = model.config
    return cfg._attn_implementation, cfg.text_config._attn_implementation, cfg.vision_config._attn_implementation


class Unchanged:
    """Asserts that the model has the same hooks and attention settings afterwards as before."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __enter__(self) -> Unchanged:
        self.hooks = hook_snapshot(self.model)
        self.settings = attention_settings(self.model)
        self.strings = attn_strings(self.model)
        return self

    def __exit__(self, *exc: object) -> None:
        assert hook_snapshot(self.model) == self.hooks
        assert attention_settings(self.model) == self.settings
        assert attn_strings(self.model) == self.strings


def static_prompt_from_inputs(adapter: Any, inputs: dict[str, Any]) -> StaticPrompt:
    """The static loop's prompt built from the model's own inputs (``adapter._lm_inputs``), the reference for the
    package's ``_loop_prompt``, which builds it from the prompt's parts: the input embeddings with the visual rows
    scattered over the placeholders; with M-RoPE, the (t, h, w) rows of ``position_ids`` (its text row is the cache
    index); with DeepStack, each level's rows over the placeholders and zeros elsewhere."""
    embeds = adapter._prompt_embeddings(inputs)[0]
    positions = inputs["position_ids"][1:, 0] if "position_ids" in inputs else None
    levels = getattr(inputs["mm_encoder_outputs"]["image"], "deepstack_features", None)
    if levels is None:
        return StaticPrompt(embeds, positions)
    rows = torch.stack([torch.cat(list(level)) for level in levels])  # (levels, K, d_t)
    placeholders = (inputs["input_ids"][0] == adapter.image_token_id)[None, :, None]  # (1, L, 1)
    deepstack = rows.new_zeros(rows.shape[0], placeholders.shape[1], rows.shape[-1])
    deepstack.masked_scatter_(placeholders.expand_as(deepstack), rows)  # level by level, the K rows in order
    return StaticPrompt(embeds, positions, deepstack)
