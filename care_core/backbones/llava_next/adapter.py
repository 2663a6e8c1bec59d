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

import numpy as np
import torch

from ..._memo import remember
from ...errors import ModelLoadError
from .._hf import quiet_transformers
from ..base import ImageTokens, check_kept, is_all_tokens
from ..geometry import GEOMETRY_CACHE_SIZE, clip_boxes, crop_geometry, grid_crop_boxes
from ..llava_1_5.adapter import LlavaAdapter, _inner
from ..probes import _linear32, clip_vision_capture

LLAVA_NEXT_FALLBACK_PROMPT = "[INST] {image}\n{question} [/INST]"


def _size_hw(size: Any, key_h: str = "height", key_w: str = "width") -> tuple[int, int] | None:
    h = size.get(key_h) if isinstance(size, dict) else getattr(size, key_h, None)
    w = size.get(key_w) if isinstance(size, dict) else getattr(size, key_w, None)
    return (int(h), int(w)) if h and w else None


def _shortest_edge(size: Any) -> int | None:
    value = size.get("shortest_edge") if isinstance(size, dict) else getattr(size, "shortest_edge", None)
    return int(value) if value else None


class LlavaNextAdapter(LlavaAdapter):
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
        if not isinstance(getattr(model.config, "image_grid_pinpoints", None), list):
            raise ModelLoadError(f"{name}: the model config has no image_grid_pinpoints")
        if not hasattr(_inner(model), "image_newline"):
            raise ModelLoadError(f"{name}: the model has no image_newline parameter")

    # ------------------------------------------------------------------ vision
    def collate(self, parts: list[dict[str, Any]]) -> dict[str, Any]:
        """Crops zero-padded to the most any image has, as the processor pads a list of images; the pixels on the
        model's device (padded and joined there: on the CPU that is copies of the batch while the GPU waits)."""
        most = max(int(part["pixel_values"].shape[1]) for part in parts)
        pad = [(0, 0, 0, 0, 0, 0, 0, most - int(part["pixel_values"].shape[1])) for part in parts]
        pixel_values = [torch.nn.functional.pad(part["pixel_values"].to(self.device), by)
                        for part, by in zip(parts, pad, strict=True)]  # fmt: skip
        return {"pixel_values": torch.cat(pixel_values), "image_sizes": torch.cat([p["image_sizes"] for p in parts])}

    def encode_processed(self, processed: Mapping[str, Any], sizes: Sequence[tuple[int, int]]) -> list[ImageTokens]:
        """Base-view + unpadded high-resolution pre-projector tokens per image; the real crops of all images
        in one tower pass."""
        pixel_values, image_sizes = processed["pixel_values"], processed["image_sizes"]
        if pixel_values.dim() != 5 or pixel_values.shape[0] != len(sizes) or image_sizes.shape[0] != len(sizes):
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)} and image_sizes {tuple(image_sizes.shape)} "
                             f"do not hold the crops of {len(sizes)} images")  # fmt: skip
        crops = [self._crops(pixel_values[i : i + 1], image_sizes[i : i + 1]) for i in range(len(sizes))]
        with torch.no_grad():
            per_crop = self._patch_features(torch.cat(crops))  # (crops, P, d_v)
        per_image = per_crop.split([int(c.shape[0]) for c in crops])
        return [self._tokens(per_image[i], pixel_values[i : i + 1, : crops[i].shape[0]], image_sizes[i : i + 1],
                             sizes[i]) for i in range(len(sizes))]  # fmt: skip

    def batch_features(self, pixel_values: torch.Tensor, reference: ImageTokens) -> torch.Tensor:
        """(B, N, d_v) packed pre-projector features of B images sharing ``reference``'s geometry (same size: same
        crops and packing), ``pixel_values`` (B, 1, crops, 3, 336, 336) their processor outputs; with gradients where
        enabled."""
        pixel_values = pixel_values.flatten(0, 1)
        batch, crops = int(pixel_values.shape[0]), int(pixel_values.shape[1])
        per_crop = self._patch_features(pixel_values.flatten(0, 1))
        per_crop = per_crop.view(batch, crops, *per_crop.shape[1:])
        dev = per_crop.device
        return per_crop[:, reference.model_inputs["crop_index"].to(dev), reference.model_inputs["patch_index"].to(dev)]

    def _tokens(
        self, per_crop: torch.Tensor, pixel_values: torch.Tensor, image_sizes: torch.Tensor, size: tuple[int, int]
    ) -> ImageTokens:
        """One image's packed tokens from its crops' features (crops, 576, d_v), and their geometry."""
        height, width = size
        crop_index, patch_index, hires_grid, boxes, positions = self._geometry(image_sizes, per_crop.shape[0], size)
        dev = per_crop.device
        features = per_crop[crop_index.to(dev), patch_index.to(dev)]
        positions = positions.to(device=dev)
        return ImageTokens(
            features=features,
            positions=positions,
            boxes=boxes,
            image_size=(height, width),
            seen_box=(0.0, 0.0, float(width), float(height)),
            grid=None,
            model_inputs={
                "pixel_values": pixel_values,
                "image_sizes": image_sizes,
                "image_size": (height, width),
                "crop_index": crop_index,
                "patch_index": patch_index,
                "hires_grid": hires_grid,
            },
            views=(crop_index > 0).long(),
        )

    def _geometry(self, image_sizes: torch.Tensor, crops: int, size: tuple[int, int]) -> tuple[Any, ...]:
        """(crop_index, patch_index, hires_grid, boxes, positions) of one image's packed tokens (CPU), which depend
        on its size and crops only: kept per size (:data:`GEOMETRY_CACHE_SIZE`), since a data set repeats a few
        sizes and working them out costs milliseconds of Python per image while the GPU waits."""
        key = (size, tuple(int(v) for v in image_sizes.reshape(-1).tolist()), int(crops))
        kept = self._geometry_cache
        cached = kept.get(key)
        if cached is None:
            height, width = size
            crop_index, patch_index, hires_grid = self._layout(image_sizes, crops)
            boxes_per_crop = self._crop_boxes(height, width, crops)  # (crops, 576, 4), original pixels
            boxes = clip_boxes(boxes_per_crop[crop_index, patch_index], height, width)
            centre_x = (boxes[:, 0] + boxes[:, 2]) / 2 / width
            centre_y = (boxes[:, 1] + boxes[:, 3]) / 2 / height
            positions = torch.stack([centre_y, centre_x], dim=1).to(torch.float32)
            boxes = boxes.to(torch.float32)
            cached = remember(kept, key, (crop_index, patch_index, hires_grid, boxes, positions), GEOMETRY_CACHE_SIZE)
        crop_index, patch_index, hires_grid, boxes, positions = cached
        return crop_index.clone(), patch_index.clone(), hires_grid, boxes.clone(), positions.clone()

    def _crops(self, pixel_values: torch.Tensor, image_sizes: torch.Tensor) -> torch.Tensor:
        """(crops, 3, 336, 336): the real crops of the processor output (base view first)."""
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        cfg = self.model.config
        count = image_size_to_num_patches(image_sizes[0], cfg.image_grid_pinpoints, cfg.vision_config.image_size)
        if pixel_values.dim() != 5 or pixel_values.shape[1] < count:
            raise ModelLoadError(
                f"{self.name}: the image processor gave pixel_values {tuple(pixel_values.shape)} but the model "
                f"expects {count} crops; do the processor's and the model's image_grid_pinpoints agree?"
            )
        return pixel_values[0, :count]

    def _layout(self, image_sizes: torch.Tensor, crops: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
        """(crop_index, patch_index) of every packed token, from the model's own ``pack_image_features``."""
        vc = self.model.config.vision_config
        per = (vc.image_size // vc.patch_size) ** 2
        side = vc.image_size // vc.patch_size
        ids = torch.arange(crops * per, dtype=torch.float64).view(crops, per, 1)
        flat = self._packed_ids(ids, image_sizes)[:, 0].round().long().cpu()
        crop_index, patch_index = flat // per, flat % per
        hires = crop_index > 0
        if not bool(hires.any()):
            return crop_index, patch_index, (0, 0)
        from transformers.models.llava_next.modeling_llava_next import get_anyres_image_grid_shape

        _, crops_w = get_anyres_image_grid_shape(image_sizes[0], self.model.config.image_grid_pinpoints, vc.image_size)
        rows = (crop_index[hires] - 1) // crops_w * side + patch_index[hires] // side
        cols = (crop_index[hires] - 1) % crops_w * side + patch_index[hires] % side
        grid = (int(rows.unique().numel()), int(cols.unique().numel()))
        if grid[0] * grid[1] != int(hires.sum()):
            raise RuntimeError(f"the high-resolution tokens do not form a {grid[0]}x{grid[1]} grid")
        return crop_index, patch_index, grid

    def _packed_ids(self, ids: torch.Tensor, image_sizes: torch.Tensor) -> torch.Tensor:
        """The model's own ``pack_image_features`` run on per-crop ids (crops, P, 1), no newline rows: their order."""
        with quiet_transformers():
            packed, _ = _inner(self.model).pack_image_features([ids], image_sizes, "default", image_newline=None)
        return packed[0]

    def _crop_boxes(self, height: int, width: int, crops: int) -> torch.Tensor:
        """(crops, P, 4) every crop patch's [x0, y0, x1, y1] in original pixels (unclipped), crop 0 = base."""
        from transformers.image_processing_utils import get_patch_output_size, select_best_resolution
        from transformers.image_utils import ChannelDimension

        ip = self.processor.image_processor
        vc = self.model.config.vision_config
        side, patch = vc.image_size // vc.patch_size, vc.patch_size
        tower_hw = (int(vc.image_size), int(vc.image_size))
        local = grid_crop_boxes(side, side, patch)  # (P, 4) in the tower's input pixels
        # LlavaNextImageProcessor: the base view is resized to (size.height, size.width), or a square of
        # size.shortest_edge; canvas tiles are crop_size.height wide (else the base side); every view then
        # goes through the ordinary resize + centre crop to the tower's input (an identity at 336 px)
        base_hw = _size_hw(ip.size)
        if base_hw is None:
            edge = _shortest_edge(ip.size)
            if edge is None:
                raise ModelLoadError(f"{self.name}: cannot interpret the image processor's size {ip.size!r}")
            base_hw = (edge, edge)
        crop_hw = _size_hw(getattr(ip, "crop_size", None) or {})
        tile = crop_hw[0] if crop_hw else base_hw[0]
        base = crop_geometry(base_hw[0], base_hw[1], ip, tower_hw).crop_to_original(local)
        base[:, 0::2] *= width / base_hw[1]
        base[:, 1::2] *= height / base_hw[0]
        out = [base]
        if crops > 1:
            pinpoints = [list(p) for p in ip.image_grid_pinpoints]
            canvas_h, canvas_w = select_best_resolution((height, width), pinpoints)
            dummy = np.empty((1, height, width), dtype=np.uint8)
            new_h, new_w = get_patch_output_size(dummy, (canvas_h, canvas_w), input_data_format=ChannelDimension.FIRST)
            pad_top, pad_left = (canvas_h - new_h) // 2, (canvas_w - new_w) // 2  # _get_padding_size, both backends
            per_tile = crop_geometry(tile, tile, ip, tower_hw).crop_to_original(local)
            tiles_w = canvas_w // tile
            for k in range(1, crops):
                ty, tx = divmod(k - 1, tiles_w)  # divide_to_patches: row-major
                b = per_tile.clone()
                b[:, 0::2] = (b[:, 0::2] + tx * tile - pad_left) * (width / new_w)
                b[:, 1::2] = (b[:, 1::2] + ty * tile - pad_top) * (height / new_h)
                out.append(b)
        return torch.stack(out)

    # ------------------------------------------------------------------ language model
    def _with_newlines(self, tokens: ImageTokens, rows: torch.Tensor) -> torch.Tensor:
        """All N projected tokens (..., N, d) -> the model's own sequence: an image_newline after every high-res
        row (leading dimensions: a batch of images sharing ``tokens``' geometry)."""
        newline = _inner(self.model).image_newline.to(device=rows.device, dtype=rows.dtype)
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
        if is_all_tokens(kept, int(rows.shape[-2]), tokens.num_tokens):
            return self._with_newlines(tokens, rows)
        return rows

    def _lm_inputs(
        self,
        question: str,
        tokens: ImageTokens,
        projected: torch.Tensor,
        kept: torch.Tensor | None,
        *,
        probe: bool = False,
    ) -> dict[str, Any]:
        rows = self._check_projected(projected)
        kept = check_kept(kept, int(rows.shape[0]), tokens.num_tokens)
        if not probe:
            rows = self.fed_rows(tokens, rows, kept)
        enc = self._encode_prompt(question, int(rows.shape[0]))
        return {**enc, "mm_encoder_outputs": self._encoder_outputs(rows, tokens, kept)}

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
        crops = self._crops(inputs["pixel_values"], inputs["image_sizes"])
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
        queries = _linear32(attn.q_proj, x)  # (crops, 1 + P, d)
        keys = _linear32(attn.k_proj, x)
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
