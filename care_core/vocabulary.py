"""The words every layer shares, defined once at the bottom: this module imports nothing of care's.

Probe kinds (what a method may read beyond features, projector and positions; what an adapter computes),
family traits (what a family's visual tokens offer; what a method requires), the default question and the
batch sizes that batched decoding pads to. docs/design.md §Layers.
"""

from __future__ import annotations

from typing import Literal, get_args

#: Named inputs a method may need, beyond features, projector and positions; the backbone adapters compute them.
PROBES: dict[str, str] = {
    "cls_attention": "(H, 1+N) softmax attention of the CLS query over [CLS, patches] at the feature layer",
    "attention_logits": "(1+N, 1+N) head-mean pre-softmax attention logits at the feature layer",
    "keys": "(1+N, d_head) head-mean attention keys at the feature layer (row 0 = CLS)",
    "hidden_with_cls": "(1+N, d_v) feature-layer hidden states including the CLS row",
    "last_layer_qk": "(2, 1+N, d_v) q_proj / k_proj outputs of the vision tower's last layer",
    "question": "(T, d_t) input embeddings of the question's non-special tokens",
    "language_model": "a handle that runs the language model's first layers on the full sequence",
}

#: What a family's visual tokens may offer a method beyond features, projector and positions.
Trait = Literal["cls_token", "single_grid", "lm_attention_maps"]
TRAITS: tuple[Trait, ...] = get_args(Trait)
#: What a method that requires the trait needs, in words (for "cannot run" messages).
TRAIT_NEEDS: dict[Trait, str] = {
    "cls_token": "the vision tower's CLS token",
    "single_grid": "the visual tokens to form one raster grid",
    "lm_attention_maps": "softmax attention (an attention map) in every language-model decoder layer",
}

#: The question used where one is needed (a question-reading method, ``generate``, the language-model probe) and
#: none is given.
DEFAULT_QUESTION = "Describe the image."

#: Batched decoding pads a batch up to one of these sizes; larger batches go in chunks of the largest.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
