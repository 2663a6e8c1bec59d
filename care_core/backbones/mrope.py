"""Multimodal-rope (M-RoPE) positions of a reduced prompt, which Qwen2.5-VL and Qwen3-VL share (docs/design/backbones.md
§Qwen2.5-VL): every kept row takes the (t, h, w) position its token has in the full prompt, the text keeps its own.

Plain functions a family's adapter calls with itself and its memo of full-prompt positions (composition, not a shared
parent class). The family's multimodal model (``model.model``, transformers 5.x) owns ``get_rope_index``.
"""

from __future__ import annotations

from typing import Any

import torch

from .._memo import recall
from .base import ImageTokens, check_kept
from .chat_adapter import ChatAdapter, PromptParts

#: (question, image grid) pairs whose full-prompt rope positions an adapter keeps: each holds 3 x L positions (L up to
#: ~16k at the largest images, ~400 KB), so fewer than the prompt ids' PROMPT_CACHE_SIZE (about 100 MB at most)
ROPE_CACHE_SIZE = 256
#: the :func:`mrope_model_inputs` keys the static loop takes from an M-RoPE prompt: its positions too
#: (``mm_token_type_ids`` only matters without them)
MROPE_STATIC_INPUTS: frozenset[str] = ChatAdapter.static_inputs | {"position_ids", "mm_token_type_ids"}

#: (question, image grid thw, device) -> the full prompt's rope positions (3, L) there (the CPU's worked out, the
#: others copied from it)
RopeCache = dict[tuple[str, tuple[int, ...], str], torch.Tensor]


def rope_positions(
    adapter: ChatAdapter, cache: RopeCache, question: str, tokens: ImageTokens, device: torch.device | None = None
) -> tuple[torch.Tensor, int]:
    """(3, L) multimodal-rope positions of the prompt with all N image placeholders, the model's own
    ``get_rope_index`` of it, and the first placeholder's place (the N placeholders are one run from there).

    Worked out on the host and kept in ``cache`` per (question, image grid): ``get_rope_index`` walks the whole
    prompt in Python (and on a GPU reads it back), once per call otherwise. On the host, or on ``device`` where one is
    given: then copied there once and kept beside the host's (without waiting for the queued work: the host tensor is
    kept, never written), not once per call."""
    thw = tokens.model_inputs.get("image_grid_thw")
    if thw is None:
        raise ValueError("tokens.model_inputs has no image_grid_thw; use ImageTokens from encode_image")
    thw = thw.cpu()  # the processor's output: on the host already
    grid = tuple(int(v) for v in thw.reshape(-1).tolist())
    _, at = adapter._prompt_ids(question)

    def worked_out() -> torch.Tensor:
        ids = adapter._prompt_ids_with(question, tokens.num_tokens)
        types = (ids == adapter.image_token_id).to(torch.long)
        positions, _ = adapter.model.model.get_rope_index(
            ids, types, image_grid_thw=thw, attention_mask=torch.ones_like(ids)
        )
        return positions[:, 0]

    cached = recall(cache, (question, grid, "cpu"), worked_out, ROPE_CACHE_SIZE)
    if device is None or device.type == "cpu":
        return cached, at
    placed = recall(cache, (question, grid, str(device)), lambda: cached.to(device, non_blocking=True), ROPE_CACHE_SIZE)
    return placed, at


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
    # -1 wraps to n - 1 and 0..n-1 stay; out of range (a device kept's range is read after its prompt is queued:
    # check_kept), any index wraps into range, so the gather never fails before that read
    select = kept.to(image_positions.device).remainder(n)
    return image_positions[:, select]


def mrope_prompt_parts(
    adapter: ChatAdapter,
    cache: RopeCache,
    question: str,
    tokens: ImageTokens,
    projected: torch.Tensor,
    kept: torch.Tensor | None,
) -> PromptParts:
    """The prompt with K placeholders in parts, each row with the mrope position of its token (``kept``; -1: the last
    image token's): the positions (3, L) are put together where ``kept`` is (no read-back from the device) and moved
    with the ids."""
    rows = adapter._check_projected(projected)
    k, n = int(rows.shape[0]), tokens.num_tokens
    kept = check_kept(kept, k, n)
    # put together where kept is: reading a device kept would wait for the work queued before it
    full, start = rope_positions(adapter, cache, question, tokens, None if kept is None else kept.device)
    image = row_positions(full[:, start : start + n], torch.arange(k) if kept is None else kept)
    positions = torch.cat([full[:, :start], image, full[:, start + n :]], dim=1)  # (3, L_K)
    ids, _ = adapter._placeholder_ids(question, k)
    placed = positions.to(ids.device, non_blocking=True)  # the model's device: a fresh host tensor, or there already
    return PromptParts(ids, start, rows, tokens, kept, question, positions=placed)


def mrope_model_inputs(adapter: ChatAdapter, parts: PromptParts) -> dict[str, Any]:
    """The model's keyword arguments for M-RoPE ``parts``: ChatAdapter's, with ``mm_token_type_ids`` (always passed:
    without it the model falls back to 1-D positions) and ``position_ids`` (4, 1, L): the text row 0..L-1, then the
    parts' t, h, w rows."""
    ids, positions = parts.input_ids, parts.positions
    assert positions is not None, "M-RoPE prompt parts carry their positions (mrope_prompt_parts)"
    text_row = torch.arange(positions.shape[1], dtype=positions.dtype, device=positions.device)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "mm_token_type_ids": (ids == adapter.image_token_id).to(torch.long),
        "position_ids": torch.cat([text_row[None], positions])[:, None],  # (4, 1, L_K)
        **parts.extras,
        "mm_encoder_outputs": adapter._encoder_outputs(parts.rows, parts.tokens, parts.kept),
    }
