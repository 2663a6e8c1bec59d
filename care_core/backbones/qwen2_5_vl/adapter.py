"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`, transformers 5.24) seen through :class:`VLMAdapter`.

Visual tokens (docs/design/backbones.md §Qwen2.5-VL): one per merged 2x2 group of 14-pixel patches, in the raster
order of the merged grid
(the order the language model receives them). ``features`` row i is the concatenation of the group's four
raw pre-merger patch vectors (4 * d_v; patches (0,0), (0,1), (1,0), (1,1) of the 2x2 block), taken from the
vision tower's last hidden state with the window-attention permutation undone. The projector
(:class:`QwenMergerProjector`) applies the model's merger (``ln_q`` per patch, then the MLP on the
concatenated group) to such rows: ``projector(features)`` equals the tower's merged output.

Geometry. The processor ``smart_resize``-s the image to (14 * gh, 14 * gw) pixels (multiples of 28 within the
pixel budget), no crop or pad; the merged grid is (gh / 2, gw / 2) = ``grid``, each token a 28x28 block of the
resized image, mapped linearly back to original pixels (``boxes``); ``positions`` are the block centres
((row + 0.5) / rows, (col + 0.5) / cols), the whole image's frame. ``model_inputs`` holds ``pixel_values``,
``image_grid_thw`` and ``image_size``.

Language model. Qwen2.5-VL uses multimodal rope: image tokens carry (t, h, w) positions. The prompt is
tokenised with N image placeholders and ``mm_token_type_ids`` (1 on image tokens; always passed: without it the
model silently falls back to 1-D positions) and the model's ``get_rope_index`` gives the full sequence's
positions; the reduced sequence keeps K placeholders, each row with the position of the token it belongs to
(``kept``; -1 rows: the last image token's position), the text keeping its original positions. The model gets
these as explicit ``position_ids`` (4 rows: a 1-D text row, then t, h, w), so K = N reproduces the standard path.
The full prompt's positions are worked out on the host once per (question, image grid) (``rope_positions``), and the
reduced prompt is put together on the host too (no read-back from the device). The static CUDA-graph decoder takes
the (t, h, w) rows with the embeddings (``_static_prompt``; :mod:`care_core.backbones.static_generation`).

Probes. The Qwen vision tower has no CLS token and mostly windowed attention: ``cls_attention``,
``attention_logits``, ``keys``, ``hidden_with_cls`` and ``last_layer_qk`` (all defined with a CLS row) are not
offered; methods needing them refuse with a one-line MethodError. ``question`` and ``language_model`` (with the
mrope positions above) are.

Tower attention. On CUDA the tower's per-window and per-image sdpa calls run as one call per segment length
(:mod:`care_core.backbones.packed_attention`, the same maths; docs/design/backbones.md §Packed vision attention).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, ClassVar

import torch
from torch import nn

from ..._memo import remember
from ...errors import ModelLoadError
from ...norm_first import NormFirstMLP
from .._hf import quiet_transformers
from ..base import ImageTokens, check_kept
from ..chat_adapter import ChatAdapter
from ..geometry import CropGeometry, grid_image_tokens
from ..module_attrs import float_attr, int_attr, model_config, submodule, tensor_attr, typed_attr
from ..packed_attention import tower_attention
from ..static_generation import StaticPrompt

#: (question, image grid) pairs whose full-prompt rope positions an adapter keeps: each holds 3 x L positions (L up to
#: ~16k at the largest images, ~400 KB), so fewer than the prompt ids' PROMPT_CACHE_SIZE (about 100 MB at most)
ROPE_CACHE_SIZE = 256

QWEN25VL_FALLBACK_PROMPT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\n<|vision_start|>{image}<|vision_end|>{question}<|im_end|>\n<|im_start|>assistant\n"
)


class QwenMergerProjector(nn.Module):
    """The Qwen2.5-VL merger as a per-token projector: (n, unit * d_v) -> (n, d_out).

    Each input row is one merged token's ``unit`` (= merge_size**2, i.e. 4) patch vectors concatenated; they are
    RMS-normalised per patch with the merger's ``ln_q`` and fed to its MLP, exactly as the model does. The
    normalisation is computed in float32 for float32 / half inputs (the model's own arithmetic, bit for bit) and
    in float64 for float64 inputs (the model's norm would round to float32, which spoils finite differences).
    """

    def __init__(self, merger: nn.Module) -> None:
        super().__init__()
        self.merger = merger
        self.patch_dim = int(tensor_attr(submodule(merger, "ln_q"), "weight").shape[0])
        self.in_features = int_attr(merger, "hidden_size")
        self.unit = self.in_features // self.patch_dim

    @property
    def out_features(self) -> int:
        return int_attr(typed_attr(self.merger, "mlp", nn.Sequential)[-1], "out_features")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected rows of {self.in_features} (= {self.unit} x {self.patch_dim}) features")
        lead = x.shape[:-1]
        ln = submodule(self.merger, "ln_q")
        dtype = x.dtype
        h = x.reshape(-1, self.patch_dim).to(torch.promote_types(dtype, torch.float32))
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + float_attr(ln, "variance_epsilon"))
        h = tensor_attr(ln, "weight") * h.to(dtype)
        out = submodule(self.merger, "mlp")(h.reshape(-1, self.in_features))
        return out.reshape(*lead, out.shape[-1])

    def norm_first_mlp(self) -> NormFirstMLP | None:
        """This forward for PRCA's fast jvp path (:mod:`care_core.norm_first`): RMSNorm per patch with ``ln_q``'s
        weight and epsilon, statistics in at least float32, then the merger's MLP; None for a subclass that
        computes something else or an MLP that is not Linear -> act -> Linear."""
        mlp = submodule(self.merger, "mlp")
        if type(self).forward is not QwenMergerProjector.forward or not (
            isinstance(mlp, nn.Sequential) and len(mlp) == 3
        ):
            return None
        ln = submodule(self.merger, "ln_q")
        first, act, second = mlp
        if not (isinstance(first, nn.Linear) and isinstance(second, nn.Linear)):
            return None
        return NormFirstMLP("rms", tensor_attr(ln, "weight"), None, float_attr(ln, "variance_epsilon"), self.unit,
                            first, act, second, upcast=True)  # fmt: skip


class Qwen2_5_VLAdapter(ChatAdapter):
    """Adapter for Qwen2.5-VL checkpoints (``model_type == "qwen2_5_vl"``); see the module docstring."""

    family = "qwen2.5-vl"
    FALLBACK_PROMPT = QWEN25VL_FALLBACK_PROMPT
    model_class = "Qwen2_5_VLForConditionalGeneration"
    image_only_processor = "care_core.backbones.qwen_processor:CareQwen2_5_VLProcessor"
    probe_notes: ClassVar[dict[str, str]] = {
        "language_model": "all N merged tokens with their multimodal-rope positions",
    }
    #: on CUDA, run the tower's per-window / per-image sdpa calls as one call per segment length
    #: (:mod:`care_core.backbones.packed_attention`; the same maths); False keeps transformers' loop
    pack_vision_attention: bool = True
    #: transformers' ``smart_resize`` (``models/qwen2_vl/image_processing*_qwen2_vl.py``, the image processor of both
    #: Qwen families) raises for a long side over 200 times the short one; it has no constant to read, so the limit is
    #: written here once and :meth:`check_image` refuses such an image before the processor runs
    max_aspect_ratio: ClassVar[float | None] = 200.0
    #: the static loop also takes the prompt's positions (``mm_token_type_ids`` only matters without them)
    static_inputs: ClassVar[frozenset[str]] = ChatAdapter.static_inputs | {"position_ids", "mm_token_type_ids"}

    def __init__(self, model: torch.nn.Module, processor: Any, *, name: str, is_demo: bool = False) -> None:
        super().__init__(model, processor, name=name, is_demo=is_demo)
        self._check_processor(processor, name)
        cfg = model_config(model)
        vc = cfg.vision_config
        ip = processor.image_processor
        for attr, want in (("patch_size", vc.patch_size), ("merge_size", vc.spatial_merge_size)):
            got = getattr(ip, attr, want)
            if int(got) != int(want):
                raise ModelLoadError(f"{name}: image processor {attr} {got} does not match the model's {want}")
        self._set_image_token(getattr(cfg, "image_token_id", None))
        self._projector = self._merger_projector()
        #: (question, image grid thw) -> the full prompt's rope positions (CPU), :meth:`rope_positions`
        self._rope_cache: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def _merger_projector(self) -> nn.Module:
        """The merger as a per-token projector (:class:`QwenMergerProjector`)."""
        return QwenMergerProjector(self._inner.visual.merger)

    # ------------------------------------------------------------------ modules
    @property
    def _inner(self) -> Any:
        return self.model.model

    @property
    def _language_model(self) -> torch.nn.Module:
        return self._inner.language_model

    @property
    def projector(self) -> torch.nn.Module:
        return self._projector

    @property
    def capabilities(self) -> frozenset[str]:
        return frozenset({"question", "language_model"})

    def why_probe_missing(self, probe: str) -> str:
        return f"{self.display} has no CLS token"

    @property
    def display(self) -> str:
        """The family's display name (e.g. "Qwen2.5-VL"), from its registry record."""
        from ..families import backbone_family

        return backbone_family(self.family).display

    # ------------------------------------------------------------------ vision
    def collate(self, parts: list[dict[str, Any]]) -> dict[str, Any]:
        """Patch rows packed image after image, as the processor packs a list of images (on the model's device)."""
        return {"pixel_values": torch.cat([part["pixel_values"].to(self.device) for part in parts]),
                "image_grid_thw": torch.cat([part["image_grid_thw"] for part in parts])}  # fmt: skip

    def encode_processed(self, processed: Mapping[str, Any], sizes: Sequence[tuple[int, int]]) -> list[ImageTokens]:
        """Merged-token pre-projector features (N, 4 d_v) per image and their geometry: the packed patches of all
        images through the tower once, as the model packs them (attention stays within each image)."""
        pixel_values, thw = processed["pixel_values"], processed["image_grid_thw"]
        if thw.dim() != 2 or thw.shape[0] != len(sizes) or int(thw.prod(-1).sum()) != pixel_values.shape[0]:
            raise ValueError(f"image_grid_thw {tuple(thw.shape)} and pixel_values {tuple(pixel_values.shape)} do not "
                             f"hold the patches of {len(sizes)} images")  # fmt: skip
        with torch.no_grad():
            features = self._merged_features(pixel_values, thw)  # (sum N, unit * d_v)
        unit = self.model.config.vision_config.spatial_merge_size**2
        patches = [int(n) for n in thw.prod(-1).tolist()]
        per_image = features.split([n // unit for n in patches])
        pixels = pixel_values.split(patches)
        return [self._tokens(per_image[i], pixels[i], thw[i : i + 1], sizes[i]) for i in range(len(sizes))]

    def _merged_features(self, pixel_values: torch.Tensor, thw: torch.Tensor) -> torch.Tensor:
        """(sum N, unit * d_v): each merged token's four pre-merger patch vectors from the tower's last hidden state,
        the window permutation undone (raster order of each image's merged grid); gradients where enabled."""
        from transformers.vision_utils import get_vision_window_index

        visual = self._inner.visual
        vparam = next(visual.parameters())
        vc = self.model.config.vision_config
        grid_thw = thw.to(vparam.device)
        with quiet_transformers(), tower_attention(self.model, vparam.device, pack=self.pack_vision_attention):
            out = visual(pixel_values.to(device=vparam.device, dtype=vparam.dtype), grid_thw=grid_thw)
            window, _ = get_vision_window_index(
                grid_thw, spatial_merge_size=vc.spatial_merge_size, window_size=vc.window_size, patch_size=vc.patch_size
            )
        unit = vc.spatial_merge_size**2
        hidden = out.last_hidden_state
        groups = hidden.view(-1, unit, hidden.shape[-1])[torch.argsort(window.to(hidden.device))]
        return groups.reshape(groups.shape[0], -1)

    def batch_features(self, pixel_values: torch.Tensor, reference: ImageTokens) -> torch.Tensor:
        """(B, N, unit * d_v) pre-projector features of B images sharing ``reference``'s geometry (same grid_thw),
        ``pixel_values`` (B, patches, C * T * P * P) their processor outputs; with gradients where enabled."""
        batch = int(pixel_values.shape[0])
        thw = reference.model_inputs["image_grid_thw"].expand(batch, -1)
        features = self._merged_features(pixel_values.flatten(0, 1), thw)
        return features.view(batch, reference.num_tokens, -1)

    def _tokens(
        self, features: torch.Tensor, pixel_values: torch.Tensor, thw: torch.Tensor, size: tuple[int, int]
    ) -> ImageTokens:
        """One image's merged tokens and their geometry (see the module docstring)."""
        vc = self.model.config.vision_config
        height, width = size
        t, gh, gw = (int(v) for v in thw[0].tolist())
        merge = int(vc.spatial_merge_size)
        rows, cols = gh // merge, gw // merge
        if t != 1 or rows * cols != features.shape[0]:
            raise RuntimeError(f"vision tower gave {features.shape[0]} merged tokens for grid_thw {thw[0].tolist()}")
        block = int(vc.patch_size) * merge
        geom = CropGeometry(height, width, rows * block, cols * block, 0, 0, rows * block, cols * block)
        model_inputs = {"pixel_values": pixel_values, "image_grid_thw": thw, "image_size": (height, width)}
        return grid_image_tokens(features, geom, rows, cols, block, model_inputs, cache=self._geometry_cache)

    # ------------------------------------------------------------------ language model
    def full_positions(self, question: str, tokens: ImageTokens) -> dict[str, torch.Tensor]:
        """The prompt with all N image placeholders: ``input_ids``, ``attention_mask``, ``mm_token_type_ids``
        (1 on image tokens, as the processor makes them) and ``positions`` (3, 1, L), the model's own
        ``get_rope_index`` of that sequence (:meth:`rope_positions`)."""
        positions, _ = self.rope_positions(question, tokens)
        enc = self._encode_prompt(question, tokens.num_tokens)
        ids = enc["input_ids"]
        types = (ids == self.image_token_id).to(torch.long)
        return {**enc, "mm_token_type_ids": types, "positions": positions[:, None].to(ids.device)}

    def rope_positions(self, question: str, tokens: ImageTokens) -> tuple[torch.Tensor, int]:
        """(3, L) multimodal-rope positions (CPU) of the prompt with all N image placeholders, the model's own
        ``get_rope_index`` of it, and the first placeholder's place (the N placeholders are one run from there).

        Worked out on the host and kept per (question, image grid): ``get_rope_index`` walks the whole prompt in
        Python (and on a GPU reads it back), once per call otherwise."""
        thw = tokens.model_inputs.get("image_grid_thw")
        if thw is None:
            raise ValueError("tokens.model_inputs has no image_grid_thw; use ImageTokens from encode_image")
        thw = thw.cpu()  # the processor's output: on the host already
        key = (question, tuple(int(v) for v in thw.reshape(-1).tolist()))
        _, at = self._prompt_ids(question)
        cached = self._rope_cache.get(key)
        if cached is None:
            ids = self._prompt_ids_with(question, tokens.num_tokens)
            types = (ids == self.image_token_id).to(torch.long)
            positions, _ = self._inner.get_rope_index(
                ids, types, image_grid_thw=thw, attention_mask=torch.ones_like(ids)
            )
            cached = remember(self._rope_cache, key, positions[:, 0], ROPE_CACHE_SIZE)
        return cached, at

    @staticmethod
    def row_positions(image_positions: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        """(3, ..., K) multimodal-rope positions of K rows from the full prompt's image positions (3, N): row r has
        token ``kept[..., r]``'s; a row tied to no token (-1) the last image token's (the bottom-right merged patch)."""
        n = int(image_positions.shape[1])
        kept = kept.to(image_positions.device)
        select = torch.where(kept < 0, torch.full_like(kept, n - 1), kept)
        return image_positions[:, select]

    def _lm_inputs(
        self,
        question: str,
        tokens: ImageTokens,
        projected: torch.Tensor,
        kept: torch.Tensor | None,
        *,
        probe: bool = False,
    ) -> dict[str, Any]:
        """K placeholders, each with the mrope position of its token (``kept``; -1: the last image token's). The
        positions are put together on the host (no read-back from the device) and moved with the ids."""
        rows = self._check_projected(projected)
        k, n = int(rows.shape[0]), tokens.num_tokens
        kept = check_kept(kept, k, n)
        full, start = self.rope_positions(question, tokens)
        image = self.row_positions(full[:, start : start + n], torch.arange(k) if kept is None else kept)
        positions = torch.cat([full[:, :start], image, full[:, start + n :]], dim=1)  # (3, L_K)
        text_row = torch.arange(positions.shape[1], dtype=positions.dtype)
        position_ids = torch.cat([text_row[None], positions])[:, None]  # (4, 1, L_K): text row, then t, h, w
        enc = self._encode_prompt(question, k)
        return {
            **enc,
            "mm_token_type_ids": (enc["input_ids"] == self.image_token_id).to(torch.long),
            "position_ids": position_ids.to(self.device, non_blocking=True),  # a fresh host tensor: no wait
            "mm_encoder_outputs": self._encoder_outputs(rows, tokens, kept),
        }

    def _static_prompt(self, inputs: dict[str, Any]) -> StaticPrompt:
        """The embeddings and the (t, h, w) rows of the prompt's ``position_ids`` (its text row is 0..L-1, the
        static loop's cache index)."""
        return replace(super()._static_prompt(inputs), positions=inputs["position_ids"][1:, 0])
