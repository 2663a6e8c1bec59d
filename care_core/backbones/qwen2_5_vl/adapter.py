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
the (t, h, w) rows with the embeddings (``_loop_prompt``; :mod:`care_core.backbones.static_generation`).

Probes. The Qwen vision tower has no CLS token and mostly windowed attention: ``cls_attention``,
``attention_logits``, ``keys``, ``hidden_with_cls`` and ``last_layer_qk`` (all defined with a CLS row) are not
offered; methods needing them refuse with a one-line MethodError. ``question`` and ``language_model`` (with the
mrope positions above) are.

Tower attention. On CUDA the tower's per-window and per-image sdpa calls run as one call per segment length
(:mod:`care_core.backbones.packed_attention`, the same maths; docs/design/backbones.md §Packed vision attention).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from ...norm_first import NormFirstMLP
from .. import mrope, qwen_vl
from .._hf import quiet_transformers
from ..aligned_mlp import MisalignedMlps, aligned_gated_mlps
from ..base import ImageTokens
from ..chat_adapter import ChatAdapter, PromptParts
from ..module_attrs import float_attr, int_attr, submodule, tensor_attr, typed_attr
from ..packed_attention import tower_attention
from ..vision_rotary import fast_vision_rotary, modeling_module


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
    FALLBACK_PROMPT = qwen_vl.QWEN_FALLBACK_PROMPT
    model_class = "Qwen2_5_VLForConditionalGeneration"
    image_only_processor = "care_core.backbones.qwen_processor:CareQwen2_5_VLProcessor"
    probe_notes: ClassVar[dict[str, str]] = {
        "language_model": "all N merged tokens with their multimodal-rope positions",
    }
    #: on CUDA, run the tower's per-window / per-image sdpa calls as one call per segment length
    #: (:mod:`care_core.backbones.packed_attention`; the same maths); False keeps transformers' loop
    pack_vision_attention: bool = True
    max_aspect_ratio: ClassVar[float | None] = qwen_vl.QWEN_MAX_ASPECT_RATIO  # smart_resize refuses beyond it
    static_inputs: ClassVar[frozenset[str]] = mrope.MROPE_STATIC_INPUTS  # the static loop takes the positions too
    row_positions = staticmethod(mrope.row_positions)

    def __init__(self, model: torch.nn.Module, processor: Any, *, name: str, is_demo: bool = False) -> None:
        super().__init__(model, processor, name=name, is_demo=is_demo)
        qwen_vl.check_qwen_parts(self, model, processor, name)
        self._projector = QwenMergerProjector(self._inner.visual.merger)
        #: (question, image grid thw) -> the full prompt's rope positions (CPU), :meth:`rope_positions`
        self._rope_cache: mrope.RopeCache = {}
        self._misaligned_mlps: MisalignedMlps = {}  # the tower's, searched once per weight type

    # ------------------------------------------------------------------ modules
    _inner = property(qwen_vl.inner_model)
    _language_model = property(qwen_vl.inner_language_model)

    @property
    def projector(self) -> torch.nn.Module:
        return self._projector

    @property
    def capabilities(self) -> frozenset[str]:
        return frozenset({"question", "language_model"})

    def why_probe_missing(self, probe: str) -> str:
        return f"{self.display} has no CLS token"

    # ------------------------------------------------------------------ vision
    collate = qwen_vl.collate_patches

    def encode_processed(self, processed: Mapping[str, Any], sizes: Sequence[tuple[int, int]]) -> list[ImageTokens]:
        """Merged-token pre-projector features (N, 4 d_v) per image and their geometry: the packed patches of all
        images through the tower once, as the model packs them (attention stays within each image)."""
        pixel_values, thw = processed["pixel_values"], processed["image_grid_thw"]
        qwen_vl.check_packed_patches(pixel_values, thw, len(sizes))
        with torch.no_grad():
            features = self._merged_features(pixel_values, thw)  # (sum N, unit * d_v)
        vc = self.model.config.vision_config
        unit = qwen_vl.merge_unit(self.model)
        patches = [int(n) for n in thw.prod(-1).tolist()]
        per_image = features.split([n // unit for n in patches])
        pixels = pixel_values.split(patches)
        cache = self._geometry_cache
        return [qwen_vl.merged_grid_tokens(per_image[i], pixels[i], thw[i : i + 1], sizes[i], vc, cache)
                for i in range(len(sizes))]  # fmt: skip

    def _merged_features(self, pixel_values: torch.Tensor, thw: torch.Tensor) -> torch.Tensor:
        """(sum N, unit * d_v): each merged token's four pre-merger patch vectors from the tower's last hidden state,
        the window permutation undone (raster order of each image's merged grid); gradients where enabled."""
        from transformers.vision_utils import get_vision_window_index

        visual = self._inner.visual
        vparam = next(visual.parameters())
        vc = self.model.config.vision_config
        grid_thw = thw.to(vparam.device)
        with (
            quiet_transformers(),
            tower_attention(self.model, vparam.device, pack=self.pack_vision_attention),
            # the blocks' 3420-wide MLPs (docs/design/backbones.md)
            aligned_gated_mlps(visual, vparam.device, self._misaligned_mlps),
            fast_vision_rotary(modeling_module(visual), vparam.device),
        ):
            out = visual(pixel_values.to(device=vparam.device, dtype=vparam.dtype), grid_thw=grid_thw)
            window, _ = get_vision_window_index(
                grid_thw, spatial_merge_size=vc.spatial_merge_size, window_size=vc.window_size, patch_size=vc.patch_size
            )
        unit = qwen_vl.merge_unit(self.model)
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

    # ------------------------------------------------------------------ language model
    def full_positions(self, question: str, tokens: ImageTokens) -> dict[str, torch.Tensor]:
        """The prompt with all N image placeholders and its rope ``positions``
        (:func:`~care_core.backbones.mrope.full_positions`)."""
        return mrope.full_positions(self, self._rope_cache, question, tokens)

    def rope_positions(self, question: str, tokens: ImageTokens) -> tuple[torch.Tensor, int]:
        """(3, L) rope positions of the prompt with all N placeholders, kept per (question, image grid), and the first
        placeholder's place (:func:`~care_core.backbones.mrope.rope_positions`)."""
        return mrope.rope_positions(self, self._rope_cache, question, tokens)

    def _prompt_parts(
        self,
        question: str,
        tokens: ImageTokens,
        projected: torch.Tensor,
        kept: torch.Tensor | None,
        *,
        probe: bool = False,
    ) -> PromptParts:
        """K placeholders, each with the mrope position of its token (``kept``; -1: the last image token's)."""
        return mrope.mrope_prompt_parts(self, self._rope_cache, question, tokens, projected, kept)

    _model_inputs = mrope.mrope_model_inputs  # mm_token_type_ids and position_ids too
