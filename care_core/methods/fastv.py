"""FastV (Chen et al., "An Image is Worth 1/2 Tokens After Layer 2: Plug-and-Play Inference Acceleration for Large
Vision-Language Models", ECCV 2024).

Official code: pkunlp-icler/FastV @ d165972, ``LlamaModel.forward`` of the patched transformers
(``fast_v_inplace``, ``fast_v_agg_layer`` = K, ``fast_v_attention_rank`` = R'). The LLM runs layers 0..K-1 on all
tokens; before layer K it takes layer K-1's softmax attention, averages it over heads, takes the row of the **last**
sequence token restricted to the image span, keeps the top R' image tokens (all non-image tokens stay), sorts the
kept positions and runs layers >= K on them only (the in-place variant keeps the original position ids).

Our contract reduces the visual tokens *before* the LLM: the same score (layer K-1, head mean, last-token row, image
columns) is computed on the full prompt, the top ``keep`` image tokens are kept in ascending order, and the selection
is fed to the LLM from layer 0. So layers 0..K-1 see only the kept tokens here, unlike the official run, where they
see all of them; position ids are whatever the caller assigns. Ties in the score go to the lowest index (a stable
descending sort; ``torch.topk`` has no documented tie order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from care_core._lazy import torch
from care_core.errors import MethodError
from care_core.methods.base import Category, Method, MethodInputs, MethodResult, selection_result
from care_core.methods.lazy_precision import compute_dtype
from care_core.methods.registry import register
from care_core.vocabulary import Trait


def fastv_scores(attention: torch.Tensor, image_span: tuple[int, int]) -> torch.Tensor:
    """(N,) head-mean attention of the last sequence token onto the image span, from one (H, L, L) layer."""
    start, end = image_span
    return attention.mean(dim=0)[-1, start:end]


def top_tokens(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """Indices of the `keep` largest scores, ascending; ties to the lowest index."""
    order = torch.sort(scores, descending=True, stable=True).indices
    return order[:keep].sort().values


@register
@dataclass(frozen=True)
class FastV(Method):
    """FastV (Chen et al., ECCV 2024): keep the image tokens the last token attends to most at LLM layer K-1.

    Keeps exactly ``keep`` tokens in ascending order. ``agg_layer`` is the paper's K (pruning before layer K, from
    the attention of layer K-1; paper and scripts: K = 2). Official FastV prunes inside the LLM; here the selection
    is handed to the LLM from layer 0 (module docstring).
    """

    name: ClassVar[str] = "fastv"
    category: ClassVar[Category] = "selection"
    needs: ClassVar[frozenset[str]] = frozenset({"language_model"})
    requires: ClassVar[frozenset[Trait]] = frozenset({"lm_attention_maps"})  # reads an early layer's attention
    paper: ClassVar[str] = "Chen et al., An Image is Worth 1/2 Tokens After Layer 2 (FastV), ECCV 2024"
    rank: ClassVar[int] = 12
    cost_model: ClassVar[str | None] = "fastv"

    agg_layer: int = 2  # K: the attention of layer K-1 scores the image tokens

    def attention_layers(self) -> int:
        return self.agg_layer  # layers 0..K-1

    def reduce(self, inputs: MethodInputs, keep: int) -> MethodResult:
        if self.agg_layer < 1:
            raise MethodError(f"fastv: agg_layer (K) must be >= 1, got {self.agg_layer}")
        lm = inputs.probe("language_model", self.name)
        n = inputs.num_tokens
        start, end = lm.image_span
        if end - start != n:
            raise MethodError(f"fastv: the image span holds {end - start} tokens, the features {n}")
        layer = self.agg_layer - 1
        attentions = lm.attentions(layer)
        if len(attentions) <= layer:
            raise MethodError(f"fastv: the language model has no layer {layer}")
        attention = attentions[layer]
        with torch.no_grad():
            scores = fastv_scores(attention.to(compute_dtype(attention.dtype)), (start, end))
        scores = scores.to(inputs.features.device)
        kept = top_tokens(scores, keep)
        return selection_result(inputs.features, kept, scores, layer=layer)
