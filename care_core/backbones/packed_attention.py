"""Block-diagonal attention over packed segments with one ``scaled_dot_product_attention`` call per segment length.

The Qwen2.5-VL and Qwen3-VL vision towers (transformers 5.21–5.24) pack the patches of all images into one
sequence and describe its segments by ``cu_seqlens`` (one segment per window in Qwen2.5-VL's windowed blocks,
one per image in the full-attention blocks). Only when the vision config's attention implementation names
"flash" (``is_flash_attention_requested``) does the attention module hand the whole sequence and ``cu_seqlens`` to
the attention function in one call; any other implementation gets one call per segment. A batch of 128 images of
336 x 336 pixels is 2,560 calls per Qwen2.5-VL forward (9 windows per image in the two windowed blocks, one per
image in the two full ones), which leaves a GPU waiting on launches.

:func:`packed_sdpa_attention` takes the ``cu_seq_lens_q`` / ``cu_seq_lens_k`` call and runs the same maths as the
per-segment loop: it groups the segments by length, gathers each group into (segments, heads, length, head_dim),
runs one ``scaled_dot_product_attention`` per group and puts the rows back in place. Images of one size give one
call per block. It is registered in transformers' attention registry under :data:`PACKED_ATTENTION` (the name must
contain "flash" for the towers to take the packed path; it runs no flash-attn code and needs no flash-attn install).
Registering adds that one name to ``AttentionInterface``; no existing name changes. :func:`packed_vision_attention`
sets it on a model's vision config for the length of a ``with`` block
(docs/design/backbones.md §Packed vision attention).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from .module_attrs import model_config, pretrained_model

#: the name the packed function is registered under in transformers' ``AttentionInterface``
PACKED_ATTENTION = "care_flash_sdpa"
#: vision configs (``model_type``) whose attention modules pass ``cu_seqlens`` to a "flash"-named function
PACKED_VISION_TOWERS = frozenset({"qwen2_5_vl_vision", "qwen3_vl_vision"})
#: most attention scores (segments x heads x query length x key length) one call computes: where sdpa falls back to
#: its math kernel (which holds them all), a call holds what one 336x336 batch of 128 needs on Qwen2.5-VL-7B's
#: full-attention blocks (128 x 16 x 576^2 = 6.8e8), not more; the fused kernels hold none of them
MAX_SCORES_PER_CALL = 2**30


def _segments(
    cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int
) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """(query length, key length) -> the (query start, key start) of every segment of those lengths, in order."""
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()  # one host read each: the group shapes are host numbers
    if len(bounds_q) != len(bounds_k):
        raise ValueError(f"cu_seq_lens_q has {len(bounds_q) - 1} segments, cu_seq_lens_k {len(bounds_k) - 1}")
    if (bounds_q[0], bounds_q[-1], bounds_k[0], bounds_k[-1]) != (0, total_q, 0, total_k):
        raise ValueError(f"cu_seq_lens must run from 0 to the packed lengths {total_q} and {total_k}")
    groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for i in range(len(bounds_q) - 1):
        lq, lk = bounds_q[i + 1] - bounds_q[i], bounds_k[i + 1] - bounds_k[i]
        if lq < 0 or lk < 0:
            raise ValueError("cu_seq_lens must not decrease")
        if lq:
            groups.setdefault((lq, lk), []).append((bounds_q[i], bounds_k[i]))
    return groups


def _rows(starts: list[int], length: int, device: torch.device) -> slice | torch.Tensor:
    """The rows of segments of ``length`` starting at ``starts``: a slice when they are one contiguous run."""
    first = starts[0]
    if starts == list(range(first, first + len(starts) * length, length)):
        return slice(first, first + len(starts) * length)
    base = torch.tensor(starts, device=device)
    return (base[:, None] + torch.arange(length, device=device)).flatten()


def _gather(x: torch.Tensor, rows: slice | torch.Tensor, length: int) -> torch.Tensor:
    """(heads, T, d) -> (segments, heads, length, d) for the segments whose rows are ``rows``."""
    block = x[:, rows] if isinstance(rows, slice) else x.index_select(1, rows)
    return block.unflatten(1, (-1, length)).transpose(0, 1)


def _check_call(query: torch.Tensor, key: torch.Tensor, attention_mask: Any, cu_q: Any, cu_k: Any) -> None:
    """The call is a packed one: cu_seq_lens given, no mask, one sequence."""
    if cu_q is None or cu_k is None:
        raise ValueError(f"{PACKED_ATTENTION} serves packed calls only (cu_seq_lens_q and cu_seq_lens_k); set it on a "
                         "vision tower that packs its segments (Qwen2.5-VL, Qwen3-VL)")  # fmt: skip
    if attention_mask is not None:
        raise ValueError(f"{PACKED_ATTENTION} takes no attention_mask: the segments are the mask")
    if query.shape[0] != 1 or key.shape[0] != 1:
        raise ValueError(f"{PACKED_ATTENTION} expects one packed sequence (batch 1), got {query.shape[0]}")


def packed_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention within each packed segment: query (1, H, T_q, d), key / value (1, H_kv, T_k, d) -> (1, T_q, H, d).

    Segment i is rows ``cu_seq_lens_q[i]:cu_seq_lens_q[i + 1]`` of the query attending to rows
    ``cu_seq_lens_k[i]:cu_seq_lens_k[i + 1]`` of key and value, as the per-segment ``sdpa`` loop computes it; one
    ``scaled_dot_product_attention`` call per distinct (query length, key length). ``is_causal`` (default: the
    module's) masks within a segment and needs equal lengths per segment. ``max_length_*`` are not needed.
    """
    del max_length_q, max_length_k, kwargs  # the group shapes come from cu_seq_lens
    _check_call(query, key, attention_mask, cu_seq_lens_q, cu_seq_lens_k)
    assert cu_seq_lens_q is not None and cu_seq_lens_k is not None  # checked above (for mypy)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", False))
    q, k, v = query[0], key[0], value[0]  # (heads, T, d)
    if k.shape[0] != q.shape[0]:  # grouped-query attention: each key head serves heads / kv_heads query heads
        k, v = (t.repeat_interleave(q.shape[0] // k.shape[0], dim=0) for t in (k, v))
    parts, where = [], []
    for (lq, lk), starts in _segments(cu_seq_lens_q, cu_seq_lens_k, q.shape[1], k.shape[1]).items():
        if causal and lq != lk:
            raise ValueError(f"causal packed attention needs equal query and key lengths, got {lq} and {lk}")
        per_call = max(1, MAX_SCORES_PER_CALL // (q.shape[0] * lq * lk))
        for first in range(0, len(starts), per_call):
            chunk = starts[first : first + per_call]
            rows_q = _rows([s for s, _ in chunk], lq, q.device)
            rows_k = _rows([s for _, s in chunk], lk, q.device)
            qs, ks, vs = _gather(q, rows_q, lq), _gather(k, rows_k, lk), _gather(v, rows_k, lk)
            out = F.scaled_dot_product_attention(qs, ks, vs, dropout_p=dropout, scale=scaling,
                                                 is_causal=causal and lq > 1)  # fmt: skip
            parts.append(out.transpose(1, 2).flatten(0, 1))  # (segments * lq, heads, d)
            where.append(rows_q)
    if not parts:  # no query rows at all
        return query.new_zeros((1, query.shape[2], query.shape[1], value.shape[-1])), None
    return _place(parts, where, query.shape[2]).unsqueeze(0), None


def _place(parts: list[torch.Tensor], where: list[slice | torch.Tensor], total: int) -> torch.Tensor:
    """The groups' output rows put back at their query rows: (T, heads, d)."""
    if len(parts) == 1 and isinstance(where[0], slice) and (where[0].start, where[0].stop) == (0, total):
        return parts[0]  # one length, in order: nothing to move
    device = parts[0].device
    index = torch.cat([torch.arange(w.start, w.stop, device=device) if isinstance(w, slice) else w for w in where])
    rows = torch.cat(parts)
    return rows.new_zeros((total, *rows.shape[1:])).index_copy(0, index, rows)


# ----------------------------------------------------------------------------- registration and setting
def register_packed_attention() -> str:
    """Add :data:`PACKED_ATTENTION` -> :func:`packed_sdpa_attention` to transformers' ``AttentionInterface`` (once;
    no existing name changes) and return the name. A name already taken by another function is a RuntimeError."""
    from transformers import AttentionInterface

    registered = AttentionInterface().get(PACKED_ATTENTION)
    if registered is None:
        AttentionInterface.register(PACKED_ATTENTION, packed_sdpa_attention)
    elif registered is not packed_sdpa_attention:
        raise RuntimeError(f"transformers' attention name {PACKED_ATTENTION!r} is taken by {registered!r}")
    return PACKED_ATTENTION


def packs_vision_segments(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a VLM whose vision tower takes the packed path (its vision config's model type)."""
    vision = getattr(getattr(model, "config", None), "vision_config", None)
    return getattr(vision, "model_type", None) in PACKED_VISION_TOWERS


def _check_packs(model: torch.nn.Module) -> None:
    if not packs_vision_segments(model):
        kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise ValueError(f"{kind}: packed vision attention serves the Qwen2.5-VL and Qwen3-VL towers only "
                         "(their attention is per window or image; other towers attend over whole crops)")  # fmt: skip


def use_packed_vision_attention(model: torch.nn.Module) -> str:
    """Set the vision tower of ``model`` (Qwen2.5-VL, Qwen3-VL) to :func:`packed_sdpa_attention`; the language model
    keeps its setting. Returns the vision config's previous setting: ``model.set_attn_implementation({"vision_config":
    previous})`` restores it. Set on the built model: building with ``attn_implementation=`` this name fails, as
    transformers then looks for a flash-attention kernel of that name."""
    _check_packs(model)
    previous = str(model_config(model).vision_config._attn_implementation)
    pretrained_model(model).set_attn_implementation({"vision_config": register_packed_attention()})
    return previous


@contextlib.contextmanager
def packed_vision_attention(model: torch.nn.Module) -> Iterator[None]:
    """:func:`use_packed_vision_attention` for the ``with`` block; every config's setting is restored on exit.

    Not thread-safe: the setting lives on the (shared) model config while the block runs."""
    from .probes import attention_implementation

    _check_packs(model)
    with attention_implementation(model, {"vision_config": register_packed_attention()}):
        yield


def tower_attention(
    model: torch.nn.Module, device: torch.device, *, pack: bool = True
) -> contextlib.AbstractContextManager[None]:
    """The context a Qwen adapter runs its vision tower in: :func:`packed_vision_attention` where the tower runs on
    CUDA with ``sdpa`` (its per-segment loop is launch-bound there; the maths is the same), else nothing, so an
    explicit ``eager`` or ``flash_attention_2`` and every CPU run stay as they are
    (docs/design/backbones.md §Packed vision attention). ``pack=False`` keeps the loop."""
    vision = getattr(model.config, "vision_config", None)
    if pack and device.type == "cuda" and getattr(vision, "_attn_implementation", None) == "sdpa":
        return packed_vision_attention(model)
    return contextlib.nullcontext()
