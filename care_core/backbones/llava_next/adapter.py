"""LLaVA-NeXT (`LlavaNextForConditionalGeneration`, transformers 5.24) seen through :class:`VLMAdapter`.

Visual tokens (docs/design/backbones.md §LLaVA-NeXT): the base view's 576 CLIP patch tokens, then the unpadded
high-resolution grid, in exactly the order of the model's own ``pack_image_features`` but **without** the
``image_newline`` rows: N = 576 + rows * cols (2880 for 672x672, 2016 for 500x800, 2304 for 900x300). The
features are CLIP layer ``vision_feature_layer`` (-2), CLS dropped, per crop, then packed (the packing only
reorders and drops the rows/columns of the padding band, so packing before the projector equals packing
after it). The projector is the model's per-token MLP.

Geometry. The anyres processor picks a canvas from ``image_grid_pinpoints``, resizes the image into it keeping
the aspect ratio (``get_patch_output_size``: the long side fills the canvas, the other is ``ceil``-ed), pastes it
centred on zero padding (``(canvas - size) // 2`` before) and cuts 336x336 crops row-major; the base view is
the whole image squashed to 336x336. Each token's ``boxes`` row is its 14x14 patch mapped back through these
steps into original pixels and clipped to the image; ``positions`` are the clipped boxes' centres divided by
(H, W), as (row, col): the whole image's frame for both views (base and high-resolution tokens overlap in
space). ``views`` is 0 for base-view tokens and 1 for high-resolution ones; ``grid`` is None (two grids).
``model_inputs`` holds the processor's ``pixel_values`` (1, crops, 3, 336, 336) and ``image_sizes``, plus
``crop_index`` / ``patch_index`` (N,) long (crop 0 = base view; patch = raster index inside the crop's 24x24
grid) and ``hires_grid`` (rows, cols) of the unpadded high-resolution grid.

Language model. Rows are fed in the order given, without newline rows (design: the reduced sequence is the K kept
tokens). Only when the rows are exactly all N tokens in packed order is the model's own sequence rebuilt, one
``image_newline`` after every high-resolution row (N + rows visual rows, see :meth:`visual_tokens_fed`), so
K = N reproduces the standard processor path.

Probes. The vision probes are the LLaVA-1.5 ones computed on every crop in one tower pass (crops as a batch)
and mapped into packed order; ``T = 1 + N`` with row/column 0 the CLS slot:

* ``cls_attention`` (H, T): column 1 + i is token i's value in its own crop's CLS softmax row; column 0 is the
  base view's CLS attention to itself. Each crop's row sums to 1, so a row sums to about the crop count.
* ``attention_logits`` (T, T): head-mean logits ``q_i . k_j * scale / H`` (the full-width product, equal to the
  mean of the per-head logits) with each token's q and k from its own crop; entries between two tokens of the
  same crop are the model's logits, entries across crops are what the same layer would give were the crops one
  sequence. Row 0 holds, for every token j, the logit of j's own crop's CLS query with j's key; column 0 the
  logit of token i's query with its own crop's CLS key; entry (0, 0) is the base CLS with itself.
* ``keys`` (T, d_head), ``hidden_with_cls`` (T, d_v), ``last_layer_qk`` (2, T, d_v): token rows from their own
  crop, row 0 from the base view's CLS.

Methods that work per crop in their papers (e.g. VisionZip, PruMerge on LLaVA-NeXT) can regroup the tokens
with ``model_inputs["crop_index"]``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from ...kernels.dispatch import KernelGate
from .._hf import quiet_transformers
from ..anyres import AnyresCrops, anyres_fed_rows, check_anyres_model, collate_crops, real_crops
from ..base import ImageTokens, check_kept, is_all_tokens
from ..chat_adapter import ChatAdapter
from ..llava_modules import (
    CLIP_PATCH_START,
    adapter_crop_tokens,
    check_clip_llava,
    llava_inner,
    llava_language_model,
    llava_projector,
    llava_vision_tower,
    patch_features,
)
from ..probes import clip_vision_capture, linear32

LLAVA_NEXT_FALLBACK_PROMPT = "[INST] {image}\n{question} [/INST]"


class LlavaNextAdapter(ChatAdapter):
    """Adapter for LLaVA-NeXT checkpoints (``model_type == "llava_next"``); see the module docstring."""

    family = "llava-next"
    model_class = "LlavaNextForConditionalGeneration"
    FALLBACK_PROMPT = LLAVA_NEXT_FALLBACK_PROMPT
    probe_notes: ClassVar[dict[str, str]] = {
        "cls_attention": "per crop, mapped into packed order; column 0 = the base view's CLS",
        "attention_logits": "each token's q/k from its own crop; cross-crop entries from the same layer's q/k; "
        "row/column 0 = the token's own crop's CLS",
        "keys": "per crop, mapped into packed order; row 0 = the base view's CLS",
        "hidden_with_cls": "per crop, mapped into packed order; row 0 = the base view's CLS",
        "last_layer_qk": "per crop, mapped into packed order; row 0 = the base view's CLS",
        "language_model": "the N tokens without image_newline rows",
    }

    def __init__(self, model: torch.nn.Module, processor: Any, *, name: str, is_demo: bool = False) -> None:
        super().__init__(model, processor, name=name, is_demo=is_demo)
        self._tower_gate = KernelGate("auto")  # the tower's fused kernels that cannot be built here, for this adapter
        check_clip_llava(self, model, processor, name)
        check_anyres_model(model, name)

    # ------------------------------------------------------------------ modules
    _vision_tower = property(llava_vision_tower)
    projector = property(llava_projector)
    num_image_tokens = property(adapter_crop_tokens)
    _language_model = property(llava_language_model)

    # ------------------------------------------------------------------ vision
    collate = collate_crops

    def _anyres(self) -> AnyresCrops:
        """The anyres encoding with CLIP's patch features and the model's packing (its ``"default"`` strategy)."""
        return AnyresCrops(self.model, self.processor, self.name, self._geometry_cache, self._patch_features,
                           self._packed_ids)  # fmt: skip

    def encode_processed(self, processed: Mapping[str, Any], sizes: Sequence[tuple[int, int]]) -> list[ImageTokens]:
        """Base-view + unpadded high-resolution pre-projector tokens per image; the real crops of all images
        in one tower pass."""
        return self._anyres().encode(processed, sizes)

    def batch_features(self, pixel_values: torch.Tensor, reference: ImageTokens) -> torch.Tensor:
        """(B, N, d_v) packed pre-projector features of B images sharing ``reference``'s geometry (same size: same
        crops and packing), ``pixel_values`` (B, 1, crops, 3, 336, 336) their processor outputs; with gradients where
        enabled."""
        return self._anyres().batch_features(pixel_values, reference)

    def _patch_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(crops, 576, d_v): CLIP's patch tokens of ``vision_feature_layer``, its CLS dropped (strategy "default")."""
        return patch_features(self.model, pixel_values, CLIP_PATCH_START, self._tower_gate)

    def _packed_ids(self, ids: torch.Tensor, image_sizes: torch.Tensor) -> torch.Tensor:
        """The model's own ``pack_image_features`` run on per-crop ids (crops, P, 1), no newline rows: their order."""
        with quiet_transformers():
            packed, _ = llava_inner(self.model).pack_image_features([ids], image_sizes, "default", image_newline=None)
        return packed[0]

    # ------------------------------------------------------------------ language model
    def _with_newlines(self, tokens: ImageTokens, rows: torch.Tensor) -> torch.Tensor:
        """All N projected tokens (..., N, d) -> the model's own sequence: an image_newline after every high-res
        row (leading dimensions: a batch of images sharing ``tokens``' geometry)."""
        newline = llava_inner(self.model).image_newline.to(device=rows.device, dtype=rows.dtype)
        grid = tokens.model_inputs.get("hires_grid")
        if grid is None:
            raise ValueError("tokens.model_inputs has no hires_grid; use ImageTokens from encode_image")
        grid_rows, grid_cols = grid
        base = int(tokens.num_tokens - grid_rows * grid_cols)
        lead, width = rows.shape[:-2], rows.shape[-1]
        if grid_rows == 0:  # a single (base) crop: the model appends one newline at the end
            return torch.cat([rows, newline.expand(*lead, 1, width)], dim=-2)
        hires = rows[..., base:, :].reshape(*lead, grid_rows, grid_cols, width)
        hires = torch.cat([hires, newline.expand(*lead, grid_rows, 1, width)], dim=-2)
        return torch.cat([rows[..., :base, :], hires.reshape(*lead, -1, width)], dim=-2)

    def fed_rows(self, tokens: ImageTokens, rows: torch.Tensor, kept: torch.Tensor | None) -> torch.Tensor:
        """The newline rows added when the rows are all N tokens in packed order (see the module docstring)."""
        return anyres_fed_rows(tokens, rows, kept, self._with_newlines)

    def visual_tokens_fed(self, tokens: ImageTokens, rows: int, kept: torch.Tensor | None = None) -> int:
        kept = check_kept(kept, int(rows), tokens.num_tokens)
        if is_all_tokens(kept, int(rows), tokens.num_tokens):
            grid_rows = int(tokens.model_inputs.get("hires_grid", (0, 0))[0])
            return int(rows) + (grid_rows or 1)  # one newline per high-res row (a lone base view: one at the end)
        return int(rows)

    # ------------------------------------------------------------------ probes
    def _vision_probes(self, tokens: ImageTokens, names: set[str]) -> dict[str, Any]:
        inputs = tokens.model_inputs
        for key in ("crop_index", "patch_index", "image_sizes"):
            if key not in inputs:
                raise ValueError(f"tokens.model_inputs has no {key}; use ImageTokens from encode_image")
        crops = real_crops(self.model, inputs["pixel_values"], inputs["image_sizes"], self.name)
        layer = self.model.config.vision_feature_layer
        captured = clip_vision_capture(self._vision_tower, crops, layer, names)
        dev = next(self._vision_tower.parameters()).device
        crop = inputs["crop_index"].to(dev)
        slot = inputs["patch_index"].to(dev) + 1  # row in the crop's [CLS, patches] sequence
        zero = torch.zeros(1, dtype=torch.long, device=dev)
        all_crop, all_slot = torch.cat([zero, crop]), torch.cat([zero, slot])  # row 0 = the base view's CLS
        out: dict[str, Any] = {}
        with torch.no_grad():
            if "hidden_with_cls" in names:
                out["hidden_with_cls"] = torch.cat([h[all_crop, all_slot] for h in captured["hidden"]], dim=-1)
            if "last_layer_qk" in names:
                q, k = captured["last_q"], captured["last_k"]
                out["last_layer_qk"] = torch.stack([q[all_crop, all_slot], k[all_crop, all_slot]]).float()
            attention_names = {"cls_attention", "attention_logits", "keys"} & names
            if attention_names:
                out.update(self._attention_probes(captured, all_crop, all_slot, attention_names))
        return out

    @staticmethod
    def _attention_probes(
        captured: dict[str, Any], all_crop: torch.Tensor, all_slot: torch.Tensor, names: set[str]
    ) -> dict[str, torch.Tensor]:
        attn = captured["attention"]
        x = captured["attn_input"].float()  # (crops, 1 + P, d)
        crops, length, _ = x.shape
        heads, head_dim = int(attn.num_heads), int(attn.head_dim)
        scale = float(getattr(attn, "scale", head_dim**-0.5))
        queries = linear32(attn.q_proj, x)  # (crops, 1 + P, d)
        keys = linear32(attn.k_proj, x)
        out: dict[str, torch.Tensor] = {}
        if "keys" in names:
            out["keys"] = keys.view(crops, length, heads, head_dim).mean(dim=2)[all_crop, all_slot]
        if "cls_attention" in names:
            q_cls = queries[:, 0].view(crops, heads, head_dim)
            per_head = keys.view(crops, length, heads, head_dim)
            logits = torch.einsum("chd,cthd->cht", q_cls, per_head) * scale  # (crops, H, 1 + P)
            softmax = torch.softmax(logits, dim=-1)
            out["cls_attention"] = softmax[all_crop, :, all_slot].transpose(0, 1).contiguous()  # (H, T)
        if "attention_logits" in names:
            factor = scale / heads  # mean over heads of per-head q.k = full-width q.k / H
            q_all, k_all = queries[all_crop, all_slot], keys[all_crop, all_slot]  # (T, d)
            logits = q_all @ k_all.T * factor
            own_cls_q, own_cls_k = queries[all_crop[1:], 0], keys[all_crop[1:], 0]  # (N, d): each token's crop CLS
            logits[0, 1:] = (own_cls_q * k_all[1:]).sum(-1) * factor
            logits[1:, 0] = (q_all[1:] * own_cls_k).sum(-1) * factor
            out["attention_logits"] = logits
        return out
