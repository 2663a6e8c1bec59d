"""InternVL3 ``-hf`` checkpoints (`InternVLForConditionalGeneration`, transformers 5.21+) as a :class:`VLMAdapter`.

Visual tokens (docs/design/backbones.md §InternVL3): the pixel-shuffled tokens of every 448 px tile, tiles in the
processor's row-major order and the thumbnail last (present only when there is more than one tile), 256 per tile in the
row-major 16x16 order of each tile: exactly the rows the model hands its language model. ``features`` row i is the
shuffled token itself, i.e. its four pre-shuffle InternViT patch vectors (layer ``vision_feature_layer``, CLS
dropped) concatenated in the model's own ``pixel_shuffle`` order: patches (2r, 2c), (2r, 2c+1), (2r+1, 2c),
(2r+1, 2c+1) of the 32x32 patch grid (4 d_v channels). The projector is the model's
``InternVLMultiModalProjector`` (LayerNorm(4 d_v) -> Linear -> GELU -> Linear) applied per token, so
``projector(features)`` equals the model's projected tokens bit for bit; it works in float64 (finite differences).

Geometry. The processor (``GotOcr2ImageProcessor`` with ``crop_to_patches=True``) picks (cols, rows) tiles with
``get_optimal_tiled_canvas``, resizes the whole image to (rows * 448, cols * 448) -- the aspect ratio is not kept --
and cuts it row-major; the thumbnail is the whole image squashed to 448x448. Each token is a 28x28 block of its tile;
``boxes`` map it back linearly into original pixels (tiles through the canvas resize, the thumbnail through its own)
and ``positions`` are the box centres / (H, W) as (row, col): tiles and thumbnail overlap in space, like LLaVA-NeXT's
base view and tiles. ``views`` is 0 on thumbnail tokens and 1 on tile tokens (``care visualize --view base|high``);
a one-tile image (no thumbnail) has a single view (``views`` None, ``grid`` (16, 16)). ``model_inputs`` holds the
image's ``pixel_values`` (tiles, 3, 448, 448), ``num_patches``, ``tile_grid`` (rows, cols), ``tile_index`` (N,)
and ``image_size``.

Language model. The processor writes ``<img>`` + ``<IMG_CONTEXT>`` x N + ``</img>`` for an image (no separator
between tiles, no newlines); the reduced prompt keeps ``<img>`` and ``</img>`` and puts K placeholders between
them, the K rows fed in the order given. The Qwen2 language model has 1-D positions following the attention mask.
``mm_encoder_outputs["image"].pooler_output`` is ONE tensor (K, d_t) (InternVL's forward calls ``.to`` on it).

Probes. InternViT has a CLS token, but its attention is over the 1024 pre-shuffle patches of a tile, four per visual
token, and once per tile: no CLS probe is defined on the shuffled tokens, so ``cls_attention``,
``attention_logits``, ``keys``, ``hidden_with_cls`` and ``last_layer_qk`` are not offered (the CLS methods refuse
with a one-line reason); ``question`` and ``language_model`` are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from ...errors import ModelLoadError
from .._hf import quiet_transformers
from ..base import ImageTokens
from ..chat_adapter import ChatAdapter
from ..geometry import clip_boxes, grid_crop_boxes
from ..module_attrs import model_config

INTERNVL_FALLBACK_PROMPT = "<|im_start|>user\n{image}\n{question}<|im_end|>\n<|im_start|>assistant\n"
NO_CLS_PROBES = (
    "InternViT's CLS attends to the pre-shuffle patches, four per InternVL visual token, once per tile: "
    "no CLS probe is defined on the pixel-shuffled tokens"
)
#: the family's view codes (``ImageTokens.views``), as LLaVA-NeXT's: 0 = the whole image at low resolution
THUMBNAIL_VIEW, TILE_VIEW = 0, 1


def image_mm_outputs(rows: torch.Tensor) -> dict[str, Any]:
    """``{"image": BaseModelOutputWithPooling(pooler_output=rows)}``: InternVL takes ONE tensor of all rows."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    return {"image": BaseModelOutputWithPooling(pooler_output=rows)}


def _side(value: Any) -> int:
    """A config's image/patch size (an int or a (h, w) pair, square in InternVL) as one int."""
    if isinstance(value, (list, tuple)):
        if len(set(int(v) for v in value)) != 1:
            raise ModelLoadError(f"non-square InternViT size {value!r} is not supported")
        return int(value[0])
    return int(value)


class InternVLAdapter(ChatAdapter):
    """Adapter for InternVL3 ``-hf`` checkpoints (``model_type == "internvl"``); see the module docstring."""

    family = "internvl3"
    model_class = "InternVLForConditionalGeneration"
    image_only_processor = "care_core.backbones.internvl3.processor:CareInternVLProcessor"
    FALLBACK_PROMPT = INTERNVL_FALLBACK_PROMPT
    dropin_refusal = (
        "InternVLProcessor's outputs keep neither the image sizes nor the tiles per image, which the token "
        "positions need; reduce through care's own pipeline (ReductionPipeline, care reduce, care eval)"
    )
    probe_notes: ClassVar[dict[str, str]] = {
        "language_model": "all N shuffled tokens between <img> and </img>",
    }

    def __init__(self, model: torch.nn.Module, processor: Any, *, name: str, is_demo: bool = False) -> None:
        super().__init__(model, processor, name=name, is_demo=is_demo)
        self._check_processor(processor, name)
        cfg = model_config(model)
        strategy = getattr(cfg, "vision_feature_select_strategy", "default")
        if strategy != "default":
            raise ModelLoadError(
                f"{name}: vision_feature_select_strategy {strategy!r} is not supported (only 'default')"
            )
        if not isinstance(cfg.vision_feature_layer, int):
            raise ModelLoadError(f"{name}: several vision_feature_layer values are not supported")
        vc = cfg.vision_config
        self.tile = _side(vc.image_size)
        self.patch = _side(vc.patch_size)
        self.shuffle = round(1 / float(cfg.downsample_ratio))  # 2: a 2x2 block of patches per token
        side = self.tile // self.patch // self.shuffle
        self.tokens_per_tile = side * side
        seq = getattr(processor, "image_seq_length", self.tokens_per_tile)
        if int(seq) != self.tokens_per_tile:
            raise ModelLoadError(f"{name}: the processor writes {seq} placeholders per tile, the model gives "
                                 f"{self.tokens_per_tile}")  # fmt: skip
        size = getattr(processor.image_processor, "size", None)
        size_hw = (size.get("height"), size.get("width")) if isinstance(size, dict) else (
            getattr(size, "height", None), getattr(size, "width", None))  # fmt: skip
        if size_hw != (self.tile, self.tile):
            raise ModelLoadError(f"{name}: the image processor's tile size {size!r} is not the model's "
                                 f"{self.tile}x{self.tile}")  # fmt: skip
        self._set_image_token(getattr(cfg, "image_token_id", None))
        tok = self.tokenizer
        self.start_image = str(getattr(tok, "start_image_token", None) or "<img>")
        self.end_image = str(getattr(tok, "end_image_token", None) or "</img>")

    # ------------------------------------------------------------------ modules
    @property
    def _inner(self) -> Any:
        return self.model.model

    @property
    def _language_model(self) -> torch.nn.Module:
        return self._inner.language_model

    @property
    def projector(self) -> torch.nn.Module:
        """The model's own LayerNorm + MLP projector (per token; the PRCA scorer takes its generic jvp path)."""
        return self._inner.multi_modal_projector

    @property
    def capabilities(self) -> frozenset[str]:
        return frozenset({"question", "language_model"})

    def why_probe_missing(self, probe: str) -> str:
        return NO_CLS_PROBES

    # ------------------------------------------------------------------ vision
    def process_image(self, image: Any) -> dict[str, Any]:
        """The image processor's tiles for one image, ``crop_to_patches`` on as ``InternVLProcessor`` forces it."""
        from ...images import to_rgb

        out = self.processor.image_processor(images=to_rgb(image), crop_to_patches=True, return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "num_patches": torch.as_tensor(out["num_patches"]).view(-1)}

    def collate(self, parts: list[dict[str, Any]]) -> dict[str, Any]:
        """Tiles stacked image after image (flat over the batch, as the processor stacks them)."""
        counts = [torch.as_tensor(part["num_patches"]).view(-1) for part in parts]
        # joined on the model's device; pinned by the prefetcher, each copy is queued
        pixels = torch.cat([part["pixel_values"].to(self.device, non_blocking=True) for part in parts])
        return {"pixel_values": pixels, "num_patches": torch.cat(counts)}

    def encode_processed(self, processed: Mapping[str, Any], sizes: Sequence[tuple[int, int]]) -> list[ImageTokens]:
        """Pixel-shuffled pre-projector tokens per image, the tiles of all images in one tower pass."""
        pixel_values = processed["pixel_values"]
        if processed.get("num_patches") is None:  # InternVLProcessor pops it: only one image is then unambiguous
            if len(sizes) != 1:
                raise ValueError("encoding several images needs the image processor's num_patches (tiles per image)")
            processed = {**processed, "num_patches": torch.tensor([pixel_values.shape[0]])}
        counts = [int(c) for c in torch.as_tensor(processed["num_patches"]).view(-1).tolist()]
        if pixel_values.dim() != 4 or len(counts) != len(sizes) or sum(counts) != pixel_values.shape[0]:
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)} and num_patches {counts} do not hold the "
                             f"tiles of {len(sizes)} images")  # fmt: skip
        with torch.no_grad():
            shuffled = self._shuffled(pixel_values)  # (tiles, 256, 4 d_v)
        per_image = shuffled.split(counts)
        pixels = pixel_values.split(counts)
        return [self._tokens(per_image[i], pixels[i], sizes[i]) for i in range(len(sizes))]

    def _shuffled(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(tiles, tokens per tile, 4 d_v): what ``get_image_features`` hands its projector, through the model's
        own ``pixel_shuffle``; gradients where enabled (training)."""
        vt = self._inner.vision_tower
        vparam = next(vt.parameters())
        layer = int(self.model.config.vision_feature_layer)
        with quiet_transformers():
            out = vt(pixel_values=pixel_values.to(device=vparam.device, dtype=vparam.dtype),
                     output_hidden_states=layer != -1, return_dict=True)  # fmt: skip
            hidden = out.last_hidden_state if layer == -1 else out.hidden_states[layer]
            patches = hidden[:, 1:]  # strategy "default": the CLS row dropped
            side = self.tile // self.patch
            grid = patches.reshape(patches.shape[0], side, side, -1)
            shuffled = self._inner.pixel_shuffle(grid, scale_factor=self.model.config.downsample_ratio)
        return shuffled.reshape(shuffled.shape[0], -1, shuffled.shape[-1])

    def batch_features(self, pixel_values: torch.Tensor, reference: ImageTokens) -> torch.Tensor:
        """(B, N, 4 d_v) pixel-shuffled pre-projector features of B images sharing ``reference``'s geometry (same
        tiles), ``pixel_values`` (B, tiles, 3, 448, 448) their processor outputs; with gradients where enabled."""
        batch, tiles = int(pixel_values.shape[0]), int(pixel_values.shape[1])
        if tiles * self.tokens_per_tile != reference.num_tokens:
            raise ValueError(f"{tiles} tiles per image do not give the reference's {reference.num_tokens} tokens")
        shuffled = self._shuffled(pixel_values.flatten(0, 1))  # (B * tiles, 256, 4 d_v), tiles in order
        return shuffled.view(batch, reference.num_tokens, -1)

    def tile_grid(self, height: int, width: int) -> tuple[int, int]:
        """(rows, cols) of tiles the processor cuts an image of ``height`` x ``width`` into."""
        from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas

        ip = self.processor.image_processor
        low, high = int(getattr(ip, "min_patches", 1)), int(getattr(ip, "max_patches", 12))
        if high <= 1:
            return 1, 1
        cols, rows = get_optimal_tiled_canvas((height, width), (self.tile, self.tile), low, high)
        return int(rows), int(cols)

    def _tokens(self, shuffled: torch.Tensor, pixel_values: torch.Tensor, size: tuple[int, int]) -> ImageTokens:
        """One image's tokens (tiles, 256, 4 d_v) and their geometry (see the module docstring)."""
        height, width = size
        rows, cols = self.tile_grid(height, width)
        tiles = rows * cols
        expected = tiles + (1 if tiles > 1 else 0)
        if shuffled.shape[0] != expected:
            raise ModelLoadError(f"{self.name}: the image processor gave {shuffled.shape[0]} tiles for a "
                                 f"{height}x{width} image, the tile rule {expected}; do its min/max_patches and "
                                 "size match the model?")  # fmt: skip
        per = self.tokens_per_tile
        side = int(per**0.5)
        block = self.tile // side  # 28 px: the 2x2 patches of one shuffled token
        local = grid_crop_boxes(side, side, block)  # (256, 4) in tile pixels
        boxes = []
        for k in range(tiles):
            r, c = divmod(k, cols)  # crop_image_to_patches: row-major
            b = local.clone()
            b[:, 0::2] = (b[:, 0::2] + c * self.tile) * (width / (cols * self.tile))
            b[:, 1::2] = (b[:, 1::2] + r * self.tile) * (height / (rows * self.tile))
            boxes.append(b)
        if tiles > 1:  # the thumbnail: the whole image at tile x tile
            b = local.clone()
            b[:, 0::2] *= width / self.tile
            b[:, 1::2] *= height / self.tile
            boxes.append(b)
        box = clip_boxes(torch.cat(boxes), height, width)
        centre = torch.stack([(box[:, 1] + box[:, 3]) / 2 / height, (box[:, 0] + box[:, 2]) / 2 / width], dim=1)
        tile_index = torch.arange(expected).repeat_interleave(per)
        views = None if tiles == 1 else torch.where(tile_index < tiles, TILE_VIEW, THUMBNAIL_VIEW).long()
        return ImageTokens(
            features=shuffled.reshape(-1, shuffled.shape[-1]),
            positions=centre.to(device=shuffled.device, dtype=torch.float32),
            boxes=box.to(torch.float32),
            image_size=(height, width),
            seen_box=(0.0, 0.0, float(width), float(height)),
            grid=(side, side) if tiles == 1 else None,
            model_inputs={"pixel_values": pixel_values, "num_patches": torch.tensor([expected]),
                          "tile_grid": (rows, cols), "tile_index": tile_index, "image_size": (height, width)},
            views=views,
        )  # fmt: skip

    # ------------------------------------------------------------------ language model
    def _image_text(self, k: int) -> str:
        """``<img>`` + ``k`` placeholders + ``</img>``, as the processor expands the image for N tokens."""
        return self.start_image + self.image_token * k + self.end_image

    def _encoder_outputs(self, rows: torch.Tensor, tokens: ImageTokens, kept: torch.Tensor | None) -> dict[str, Any]:
        """InternVL takes ONE tensor of all K rows (:func:`image_mm_outputs`); K placeholders in one ``<img>`` span,
        the rows fed in the order given (ChatAdapter's ``_lm_inputs``)."""
        return image_mm_outputs(rows)
