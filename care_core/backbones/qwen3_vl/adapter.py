"""Qwen3-VL (`Qwen3VLForConditionalGeneration`, transformers 5.21-5.24) seen through :class:`VLMAdapter`.

Visual tokens (docs/design/backbones.md §Qwen3-VL): one per merged 2x2 group of 16-pixel patches, in the raster order of
the merged grid (the order the language model receives them). ``features`` row i is the concatenation of the
group's four pre-merger patch vectors (4 * d_v; patches (0,0), (0,1), (1,0), (1,1)) from the vision tower's last
hidden state, which is already in that order (the tower has no window attention, nothing to undo). The projector
(:class:`Qwen3VLMergerProjector`) is the model's main merger (LayerNorm per patch, then the MLP on the group):
``projector(features)`` equals the tower's ``pooler_output``.

DeepStack. The tower also merges the hidden states of blocks ``deepstack_visual_indexes`` with one merger each
(LayerNorm over the whole group, then an MLP) and the language model adds those rows to the image rows' hidden
states after its first layers. The deepstack mergers work per group, so their outputs per token are kept in
``model_inputs["deepstack"]`` ((levels, N, d_t)) and every level is reduced with the main rows: row r of the K rows
gets token ``kept[r]``'s deepstack rows at every level, the same K rows in the same order; a row tied to no token
(``kept`` -1) gets zero deepstack rows (nothing is added to it). Calibrated or merged rows keep the deepstack rows
of the token whose index they carry (the anchor's own). That rule is :meth:`Qwen3VLAdapter.fed_deepstack`, for one
image or a batch; ``scripts/train_demo`` feeds a batch through it and :meth:`Qwen3VLAdapter.deepstack_outputs` (the
rows and deepstack rows of :meth:`Qwen3VLAdapter.batch_tokens`, one tower pass with gradients).

Geometry and positions as Qwen2.5-VL, from the parts both families compose (:mod:`care_core.backbones.qwen_vl`, the
merged grid; :mod:`care_core.backbones.mrope`, the positions): the processor resizes to
multiples of 32 px, each token is a 32x32 block mapped linearly back to the original image; the kept rows get the
(t, h, w) multimodal-rope positions of their tokens from ``get_rope_index`` of the unreduced prompt, with
``mm_token_type_ids`` passed (Qwen3-VL refuses to run without it when an image grid is given). The static CUDA-graph
decoder takes those positions and, per level, the K deepstack rows at the image placeholders (``_loop_prompt``, straight
from the K rows and ``kept``: no transformers container is built for it), which it adds after the first decoder layers
in the prefill, as the model does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from ...norm_first import NormFirstMLP
from .. import mrope, qwen_vl
from .._hf import quiet_transformers
from ..base import ImageTokens
from ..chat_adapter import ChatAdapter, PromptParts
from ..module_attrs import float_attr, int_attr, optional_tensor_attr, submodule, tensor_attr
from ..packed_attention import tower_attention
from ..static_generation import StaticPrompt
from ..vision_rotary import fast_vision_rotary, modeling_module


class Qwen3VLMergerProjector(nn.Module):
    """The Qwen3-VL main merger as a per-token projector: (n, unit * d_v) -> (n, d_out).

    Each input row is one merged token's ``unit`` (= merge_size**2, i.e. 4) patch vectors concatenated; each patch is
    layer-normalised with the merger's ``norm`` and the group fed to ``linear_fc1`` -> GELU -> ``linear_fc2``, the
    model's own operations. Every step runs in the input's dtype, so a float64 copy (``copy.deepcopy(p).double()``)
    computes in float64 throughout (what finite differences need).
    """

    def __init__(self, merger: nn.Module) -> None:
        super().__init__()
        self.merger = merger
        self.patch_dim = int(tensor_attr(submodule(merger, "norm"), "weight").shape[0])
        self.in_features = int_attr(merger, "hidden_size")
        self.unit = self.in_features // self.patch_dim

    @property
    def out_features(self) -> int:
        return int_attr(submodule(self.merger, "linear_fc2"), "out_features")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected rows of {self.in_features} (= {self.unit} x {self.patch_dim}) features")
        lead = x.shape[:-1]
        first, act, second = (submodule(self.merger, name) for name in ("linear_fc1", "act_fn", "linear_fc2"))
        norm = submodule(self.merger, "norm")
        gamma, beta = tensor_attr(norm, "weight"), optional_tensor_attr(norm, "bias")
        h = F.layer_norm(x.reshape(-1, self.patch_dim), (self.patch_dim,), gamma, beta, float_attr(norm, "eps"))
        out = second(act(first(h.reshape(-1, self.in_features))))
        return out.reshape(*lead, out.shape[-1])

    def norm_first_mlp(self) -> NormFirstMLP | None:
        """This forward for PRCA's fast jvp path (:mod:`care_core.norm_first`): LayerNorm per patch with the
        merger's ``norm`` (weight, bias, eps), in the input's dtype, then ``linear_fc1`` -> ``act_fn`` ->
        ``linear_fc2``; None for a subclass that computes something else or fc layers that are not Linear."""
        first, act, second = (submodule(self.merger, name) for name in ("linear_fc1", "act_fn", "linear_fc2"))
        if type(self).forward is not Qwen3VLMergerProjector.forward or not (
            isinstance(first, nn.Linear) and isinstance(second, nn.Linear)
        ):
            return None
        norm = submodule(self.merger, "norm")
        return NormFirstMLP("layer", tensor_attr(norm, "weight"), optional_tensor_attr(norm, "bias"),
                            float_attr(norm, "eps"), self.unit, first, act, second)  # fmt: skip


class Qwen3VLAdapter(ChatAdapter):
    """Adapter for Qwen3-VL checkpoints (``model_type == "qwen3_vl"``); see the module docstring."""

    family = "qwen3-vl"
    FALLBACK_PROMPT = qwen_vl.QWEN_FALLBACK_PROMPT
    model_class = "Qwen3VLForConditionalGeneration"
    image_only_processor = "care_core.backbones.qwen_processor:CareQwen3VLProcessor"
    probe_notes: ClassVar[dict[str, str]] = {
        "language_model": "all N merged tokens with their multimodal-rope positions and every deepstack level",
    }
    #: on CUDA, run the tower's per-image sdpa calls as one call per segment length
    #: (:mod:`care_core.backbones.packed_attention`; the same maths); False keeps transformers' loop
    pack_vision_attention: bool = True
    max_aspect_ratio: ClassVar[float | None] = qwen_vl.QWEN_MAX_ASPECT_RATIO  # smart_resize refuses beyond it
    static_inputs: ClassVar[frozenset[str]] = mrope.MROPE_STATIC_INPUTS  # the static loop takes the positions too
    row_positions = staticmethod(mrope.row_positions)

    def __init__(self, model: torch.nn.Module, processor: Any, *, name: str, is_demo: bool = False) -> None:
        super().__init__(model, processor, name=name, is_demo=is_demo)
        qwen_vl.check_qwen_parts(self, model, processor, name)
        self._projector = Qwen3VLMergerProjector(self._inner.visual.merger)
        #: (question, image grid thw) -> the full prompt's rope positions (CPU), :meth:`rope_positions`
        self._rope_cache: mrope.RopeCache = {}

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

    @property
    def deepstack_levels(self) -> int:
        """How many deepstack levels the language model receives (``len(deepstack_visual_indexes)``)."""
        return len(self.model.config.vision_config.deepstack_visual_indexes)

    # ------------------------------------------------------------------ vision
    collate = qwen_vl.collate_patches

    def _tower(self, pixel_values: torch.Tensor, thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed patches through the tower once: (sum N, unit * d_v) merged-token features (the tower's last
        hidden state, already in raster order of each merged grid) and (levels, sum N, d_t) deepstack rows;
        gradients where enabled."""
        visual = self._inner.visual
        vparam = next(visual.parameters())
        # one image (frame) is one segment per block: nothing to pack, and switching the setting costs ~ms
        pack = self.pack_vision_attention and int(thw[:, 0].sum()) > 1
        with (
            quiet_transformers(),
            tower_attention(self.model, vparam.device, pack=pack),
            fast_vision_rotary(modeling_module(visual), vparam.device),
        ):
            out = visual(pixel_values.to(device=vparam.device, dtype=vparam.dtype), grid_thw=thw.to(vparam.device))
        unit = qwen_vl.merge_unit(self.model)
        hidden = out.last_hidden_state  # processor order: each 2x2 group is 4 consecutive rows
        return hidden.reshape(-1, unit * hidden.shape[-1]), torch.stack(list(out.deepstack_features))

    def encode_processed(self, processed: Mapping[str, Any], sizes: Sequence[tuple[int, int]]) -> list[ImageTokens]:
        """Merged-token pre-projector features (N, 4 d_v) and deepstack rows (levels, N, d_t) per image, with their
        geometry: the packed patches of all images through the tower once (attention stays within each image)."""
        pixel_values, thw = processed["pixel_values"], processed["image_grid_thw"]
        qwen_vl.check_packed_patches(pixel_values, thw, len(sizes))
        with torch.no_grad():
            features, deepstack = self._tower(pixel_values, thw)
        unit = qwen_vl.merge_unit(self.model)
        counts = [int(n) // unit for n in thw.prod(-1).tolist()]
        per_image, per_deepstack = features.split(counts), deepstack.split(counts, dim=1)
        pixels = pixel_values.split([n * unit for n in counts])
        vc, result = self.model.config.vision_config, []
        for i, size in enumerate(sizes):
            tokens = qwen_vl.merged_grid_tokens(per_image[i], pixels[i], thw[i : i + 1], size, vc,
                                                self._geometry_cache)  # fmt: skip
            tokens.model_inputs["deepstack"] = per_deepstack[i]
            result.append(tokens)
        return result

    def batch_tokens(self, pixel_values: torch.Tensor, reference: ImageTokens) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, N, unit * d_v) pre-projector features and (levels, B, N, d_t) deepstack rows of B images sharing
        ``reference``'s geometry (same grid_thw), ``pixel_values`` (B, patches, C * T * P * P) their processor
        outputs: one tower pass, with gradients where enabled (what ``scripts/train_demo`` trains through)."""
        batch = int(pixel_values.shape[0])
        thw = reference.model_inputs["image_grid_thw"].expand(batch, -1)
        features, deepstack = self._tower(pixel_values.flatten(0, 1), thw)
        n = reference.num_tokens
        return features.view(batch, n, -1), deepstack.view(deepstack.shape[0], batch, n, -1)

    def batch_features(self, pixel_values: torch.Tensor, reference: ImageTokens) -> torch.Tensor:
        """(B, N, unit * d_v): :meth:`batch_tokens`' features (training also feeds its deepstack rows)."""
        return self.batch_tokens(pixel_values, reference)[0]

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
        """K placeholders, each with the mrope position of its token (``kept``; -1: the last image token's), for an
        image whose tokens carry their deepstack rows (checked here; each decoder's form gathers the K rows')."""
        parts = mrope.mrope_prompt_parts(self, self._rope_cache, question, tokens, projected, kept)
        self._token_deepstack(tokens)
        return parts

    _model_inputs = mrope.mrope_model_inputs  # the deepstack rows come with the K rows (_encoder_outputs)

    def _token_deepstack(self, tokens: ImageTokens) -> torch.Tensor:
        """Every token's deepstack rows (levels, N, d_t) from ``tokens.model_inputs``; ValueError where they are
        missing or do not cover every token."""
        deepstack = tokens.model_inputs.get("deepstack")
        if deepstack is None or deepstack.shape[:2] != (self.deepstack_levels, tokens.num_tokens):
            raise ValueError("tokens.model_inputs has no deepstack rows for every token; use ImageTokens from "
                             "encode_image")  # fmt: skip
        return deepstack

    @staticmethod
    def fed_deepstack(deepstack: torch.Tensor, kept: torch.Tensor | None, k: int) -> torch.Tensor:
        """(levels, ..., K, d_t) deepstack rows of K fed rows from every token's (levels, ..., N, d_t): row r gets
        token ``kept[..., r]``'s (zeros for a -1 row, tied to no token); tokens 0..K-1 when ``kept`` is None."""
        if kept is None:
            return deepstack[..., :k, :]
        select = kept.to(deepstack.device, non_blocking=True)  # a blocking copy would wait for the queued GPU work
        # clamped: a device kept's range is read after its prompt is queued (check_kept), and a gather must not fail
        index = select.clamp(0, deepstack.shape[-2] - 1)
        if index.dim() == 1:  # one image's rows: one gather along the tokens (the inference path)
            levels = deepstack.index_select(-2, index)
        else:
            index = index.unsqueeze(-1).expand(*select.shape, deepstack.shape[-1])
            levels = torch.gather(deepstack, -2, index.expand(deepstack.shape[0], *index.shape))
        return levels * (select >= 0).unsqueeze(-1)  # x * 1 or x * 0 (bool promoted): the rows, or zeros

    @staticmethod
    def deepstack_outputs(rows: torch.Tensor, levels: torch.Tensor) -> dict[str, Any]:
        """``{"image": BaseModelOutputWithDeepstackFeatures}`` for rows (..., K, d_t) and their deepstack rows
        (levels, ..., K, d_t): every image's rows in one list entry, in order (the placeholders' order)."""
        from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

        width = rows.shape[-1]
        return {"image": BaseModelOutputWithDeepstackFeatures(
            pooler_output=[rows.reshape(-1, width)],  # type: ignore[arg-type]
            deepstack_features=[[level.reshape(-1, width)] for level in levels],  # type: ignore[misc]
        )}  # fmt: skip

    def _fed_levels(self, rows: torch.Tensor, deepstack: torch.Tensor, kept: torch.Tensor | None) -> torch.Tensor:
        """(levels, K, d_t): the deepstack rows of the K ``rows`` from every token's (:meth:`fed_deepstack`), in the
        rows' dtype and device."""
        return self.fed_deepstack(deepstack.to(device=rows.device, dtype=rows.dtype), kept, int(rows.shape[0]))

    def _encoder_outputs(self, rows: torch.Tensor, tokens: ImageTokens, kept: torch.Tensor | None) -> dict[str, Any]:
        """The K main rows and, per deepstack level, the same K rows (:meth:`fed_deepstack`)."""
        return self.deepstack_outputs(rows, self._fed_levels(rows, self._token_deepstack(tokens), kept))

    def _loop_prompt(self, parts: PromptParts) -> StaticPrompt:
        """The static loop's prompt from the parts: ChatAdapter's, with every DeepStack level's K rows
        (:meth:`fed_deepstack`) over the placeholders' run and zeros elsewhere."""
        prompt = super()._loop_prompt(parts)
        every = parts.tokens.model_inputs["deepstack"]  # checked when the parts were made (_prompt_parts)
        levels = self._fed_levels(parts.rows, every, parts.kept)  # (levels, K, d_t)
        after = prompt.length - parts.start - int(levels.shape[1])
        return replace(prompt, deepstack=F.pad(levels, (0, 0, parts.start, after)))  # zero rows around the run
