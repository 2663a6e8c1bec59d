"""Multimodal-rope (M-RoPE) positions of a reduced prompt, which Qwen2.5-VL and Qwen3-VL share (docs/design/backbones.md
§Qwen2.5-VL): every kept row takes the (t, h, w) position its token has in the full prompt, the text keeps its own.

Plain functions a family's adapter calls with itself and its memo of full-prompt positions (composition, not a shared
parent class). The family's multimodal model (``model.model``, transformers 5.x) owns ``get_rope_index``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from .._memo import remember
from .base import ImageTokens, check_kept
from .chat_adapter import ChatAdapter
from .static_generation import StaticPrompt

#: (question, image grid) pairs whose full-prompt rope positions an adapter keeps: each holds 3 x L positions (L up to
#: ~16k at the largest images, ~400 KB), so fewer than the prompt ids' PROMPT_CACHE_SIZE (about 100 MB at most)
ROPE_CACHE_SIZE = 256
#: the :meth:`~ChatAdapter._lm_inputs` keys the static loop takes from an M-RoPE prompt: its positions too
#: (``mm_token_type_ids`` only matters without them)
MROPE_STATIC_INPUTS: frozenset[str] = ChatAdapter.static_inputs | {"position_ids", "mm_token_type_ids"}

#: (question, image grid thw, device) -> the full prompt's rope positions (3, L) there (the CPU's worked out, the
#: others copied from it)
RopeCache = dict[tuple[str, tuple[int, ...], str], torch.Tensor]


def _cache_key(question: str, thw: torch.Tensor, device: str) -> tuple[str, tuple[int, ...], str]:
    """A :data:`RopeCache` key: the question, the image grid (host ``thw``) and where the positions are kept."""
    return (question, tuple(int(v) for v in thw.reshape(-1).tolist()), device)


def rope_positions(
    adapter: ChatAdapter, cache: RopeCache, question: str, tokens: ImageTokens
) -> tuple[torch.Tensor, int]:
    """(3, L) multimodal-rope positions (CPU) of the prompt with all N image placeholders, the model's own
    ``get_rope_index`` of it, and the first placeholder's place (the N placeholders are one run from there).

    Worked out on the host and kept in ``cache`` per (question, image grid): ``get_rope_index`` walks the whole
    prompt in Python (and on a GPU reads it back), once per call otherwise."""
    thw = tokens.model_inputs.get("image_grid_thw")
    if thw is None:
        raise ValueError("tokens.model_inputs has no image_grid_thw; use ImageTokens from encode_image")
    thw = thw.cpu()  # the processor's output: on the host already
    key = _cache_key(question, thw, "cpu")
    _, at = adapter._prompt_ids(question)
    cached = cache.get(key)
    if cached is None:
        ids = adapter._prompt_ids_with(question, tokens.num_tokens)
        types = (ids == adapter.image_token_id).to(torch.long)
        positions, _ = adapter.model.model.get_rope_index(
            ids, types, image_grid_thw=thw, attention_mask=torch.ones_like(ids)
        )
        cached = remember(cache, key, positions[:, 0], ROPE_CACHE_SIZE)
    return cached, at


def device_positions(
    cache: RopeCache, question: str, tokens: ImageTokens, positions: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """:func:`rope_positions`' ``positions`` (3, L) on ``device``, kept beside them in ``cache``: copied once (without
    waiting for the queued work: the host tensor is kept, never written), not once per call."""
    key = _cache_key(question, tokens.model_inputs["image_grid_thw"].cpu(), str(device))
    cached = cache.get(key)
    if cached is None:
        cached = remember(cache, key, positions.to(device, non_blocking=True), ROPE_CACHE_SIZE)
    return cached


def full_positions(
    adapter: ChatAdapter, cache: RopeCache, question: str, tokens: ImageTokens
) -> dict[str, torch.Tensor]:
    """The prompt with all N image placeholders: ``input_ids``, ``attention_mask``, ``mm_token_type_ids`` (1 on image
    tokens, as the processor makes them) and ``positions`` (3, 1, L), the model's own ``get_rope_index`` of that
    sequence (:func:`rope_positions`)."""
    positions, _ = rope_positions(adapter, cache, question, tokens)
    enc = adapter._encode_prompt(question, tokens.num_tokens)
    ids = enc["input_ids"]
    types = (ids == adapter.image_token_id).to(torch.long)
    return {**enc, "mm_token_type_ids": types, "positions": positions[:, None].to(ids.device)}


def row_positions(image_positions: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """(3, ..., K) multimodal-rope positions of K rows from the full prompt's image positions (3, N): row r has
    token ``kept[..., r]``'s; a row tied to no token (-1) the last image token's (the bottom-right merged patch)."""
    n = int(image_positions.shape[1])
    kept = kept.to(image_positions.device)
    # clamped: a device kept's range is read after its prompt is queued (check_kept); in range, a no-op
    select = torch.where(kept < 0, torch.full_like(kept, n - 1), kept).clamp(0, n - 1)
    return image_positions[:, select]


def mrope_lm_inputs(
    adapter: ChatAdapter,
    cache: RopeCache,
    question: str,
    tokens: ImageTokens,
    projected: torch.Tensor,
    kept: torch.Tensor | None,
) -> dict[str, Any]:
    """The model's keyword arguments for K placeholders, each with the mrope position of its token (``kept``; -1: the
    last image token's). The positions are put together on the host (no read-back from the device) and moved with the
    ids; ``mm_token_type_ids`` is always passed (without it the model falls back to 1-D positions)."""
    rows = adapter._check_projected(projected)
    k, n = int(rows.shape[0]), tokens.num_tokens
    kept = check_kept(kept, k, n)
    full, start = rope_positions(adapter, cache, question, tokens)
    if kept is not None and kept.device.type != "cpu":  # put together on kept's device: reading kept would wait
        full = device_positions(cache, question, tokens, full, kept.device)
    image = row_positions(full[:, start : start + n], torch.arange(k) if kept is None else kept)
    positions = torch.cat([full[:, :start], image, full[:, start + n :]], dim=1)  # (3, L_K)
    text_row = torch.arange(positions.shape[1], dtype=positions.dtype, device=positions.device)
    position_ids = torch.cat([text_row[None], positions])[:, None]  # (4, 1, L_K): text row, then t, h, w
    enc = adapter._encode_prompt(question, k)
    return {
        **enc,
        "mm_token_type_ids": (enc["input_ids"] == adapter.image_token_id).to(torch.long),
        "position_ids": position_ids.to(adapter.device, non_blocking=True),  # a fresh host tensor: no wait
        "mm_encoder_outputs": adapter._encoder_outputs(rows, tokens, kept),
    }


def with_rope_positions(prompt: StaticPrompt, inputs: dict[str, Any]) -> StaticPrompt:
    """``prompt`` with the (t, h, w) rows of :func:`mrope_lm_inputs`' ``position_ids`` (its text row is 0..L-1, the
    static loop's cache index)."""
    return replace(prompt, positions=inputs["position_ids"][1:, 0])
