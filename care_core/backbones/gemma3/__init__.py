"""The Gemma 3 family's record: its facts, demos, ``care flops`` specs and lmms-eval id (torch-free).

Sources of the ``care flops`` numbers. The hub files (``google/gemma-3-4b-it``, ``google/gemma-3-12b-it``
``config.json``) could not be read here; every number is checked against the script that wrote them,
transformers' ``models/gemma3/convert_gemma3_weights.py`` (huggingface/transformers, commit 0d7e95d9):
- vision (``_VISION_CONFIG``, both sizes): SigLIP at 896 px, hidden 1152, intermediate 4304, 27 layers, 16 heads,
  patch 14 (64x64 patches, no CLS, ``vision_use_head`` False); ``mm_tokens_per_image`` 256 (its processor's
  ``image_seq_length``); projector RMSNorm(1152) (gamma = 1 + w) then one linear map 1152 -> hidden, no bias;
- text (``_VARIANTS``; ``gemma3_text``, GeGLU MLP): vocab 262144 + the 64 image rows the script appends = 262208;
  head_dim 256; ``sliding_window`` 1024; 4B: L=34, H=2560, I=2560*8/2=10240, 8 heads, 4 KV heads; 12B: L=48,
  H=30*128=3840, I=15360, 16 heads, 8 KV heads. The 4B config.json leaves heads, KV heads, head_dim and vocab to
  Gemma3TextConfig's defaults (8, 4, 256, 262208 in transformers 5.24), which are these numbers.
Not checked: nothing the specs use.

Its ``care flops`` config reader is here too (:func:`spec_from_config`); the adapter is ``adapter.py``, the demo
and full-size builders ``demo.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from care_core.architecture import BackboneSpec, LanguageModelSpec, ProjectorSpec, VisionSpec
from care_core.backbones.config_reading import positive
from care_core.backbones.families import OPTIONAL_WEIGHTS, BackboneFamily, DemoBackbone, FullSizeModel
from care_core.backbones.llava_1_5 import llava_config

_DEMO = "care_core.backbones.gemma3.demo"
_GEMMA3_GEOMETRY = "Gemma 3 geometry (SigLIP-896/14, no CLS, pooled 4x4 to 256 tokens, pan-and-scan off)"

#: the image tokens per image (``mm_tokens_per_image``), whatever the image size (pan-and-scan off)
TOKENS_PER_IMAGE = 256
#: K at about 1/3, 2/9 and 1/9 of N = 256 (LLaVA-1.5's paper fractions of 576); not paper budgets
BUDGETS = (85, 56, 28)
NOTE = "Gemma 3: 256 pooled tokens of one 896×896 view (squashed, not cropped), whatever the image size"
SIGLIP_SO400M_896 = VisionSpec(kind="siglip", layers=27, hidden=1152, intermediate=4304, heads=16, patch_size=14,
                               image_size=896, feature_tokens=TOKENS_PER_IMAGE)  # fmt: skip
GEMMA3_4B_LM = LanguageModelSpec(layers=34, hidden=2560, intermediate=10240, heads=8, kv_heads=4, vocab=262208,
                                 head_dim=256)  # fmt: skip
GEMMA3_12B_LM = LanguageModelSpec(layers=48, hidden=3840, intermediate=15360, heads=16, kv_heads=8, vocab=262208,
                                  head_dim=256)  # fmt: skip


def gemma3_projector(hidden: int, vision_hidden: int = 1152) -> ProjectorSpec:
    """RMSNorm then one linear map per pooled token (the norm costs nothing in this count)."""
    return ProjectorSpec(kind="gemma3 rmsnorm+linear", token_dim=vision_hidden, linears=((vision_hidden, hidden),))


GEMMA3_4B = BackboneSpec(
    "gemma3-4b", "Gemma-3-4B", "gemma3", GEMMA3_4B_LM, gemma3_projector(2560), SIGLIP_SO400M_896, TOKENS_PER_IMAGE,
    NOTE, (896, 896), paper_budgets=BUDGETS,
    source="google/gemma-3-4b-it, as transformers' convert_gemma3_weights.py writes its config.json",
    aliases=("gemma-3-4b", "gemma-3-4b-it", "google/gemma-3-4b-it"),
)  # fmt: skip
GEMMA3_12B = BackboneSpec(
    "gemma3-12b", "Gemma-3-12B", "gemma3", GEMMA3_12B_LM, gemma3_projector(3840), SIGLIP_SO400M_896,
    TOKENS_PER_IMAGE, NOTE, (896, 896), paper_budgets=BUDGETS,
    source="google/gemma-3-12b-it, as transformers' convert_gemma3_weights.py writes its config.json",
    aliases=("gemma-3-12b", "gemma-3-12b-it", "google/gemma-3-12b-it"),
)  # fmt: skip

FAMILY = BackboneFamily(
    name="gemma3", rank=70, display="Gemma 3", model_types=("gemma3",),
    adapter="care_core.backbones.gemma3.adapter:Gemma3Adapter", has_cls_token=False, single_grid=True, crops=False,
    flops_spec="gemma3-12b", lmms_eval_model="care_gemma3",
    demos=(
        DemoBackbone("tiny-gemma3", 1, "gemma3", f"{_DEMO}:build_tiny_gemma3",
                     f"{_GEMMA3_GEOMETRY}, " + OPTIONAL_WEIGHTS, weights="tiny-gemma3.safetensors",
                     trained_builder=f"{_DEMO}:build_trained_tiny_gemma3"),
        DemoBackbone("tiny-gemma3-random", 1, "gemma3", f"{_DEMO}:build_tiny_gemma3",
                     f"{_GEMMA3_GEOMETRY}, tiny random weights; demo only"),
    ),
    flops_specs=(GEMMA3_4B, GEMMA3_12B),
    flops_config="care_core.backbones.gemma3:spec_from_config",
    full_size=FullSizeModel(image_side_px=896, builder=f"{_DEMO}:build_full_size"),
)  # fmt: skip


def spec_from_config(raw: Mapping[str, Any], path: Path, family: BackboneFamily) -> BackboneSpec:
    """One squashed view of the SigLIP tower, pooled to ``mm_tokens_per_image`` tokens, RMSNorm + linear."""
    config, lm = llava_config(raw, path)  # Gemma 3 states its sizes as the llava-hf configs do
    vc = config.vision_config
    tokens = positive(config.mm_tokens_per_image, "mm_tokens_per_image", path)
    image = positive(vc.image_size, "image_size", path)
    v_hidden = positive(vc.hidden_size, "vision hidden_size", path)
    vision = VisionSpec(kind="siglip", layers=positive(vc.num_hidden_layers, "vision num_hidden_layers", path),
                        hidden=v_hidden, intermediate=positive(vc.intermediate_size, "vision intermediate", path),
                        heads=positive(vc.num_attention_heads, "vision heads", path),
                        patch_size=positive(vc.patch_size, "patch_size", path), image_size=image,
                        feature_tokens=tokens)  # fmt: skip
    return BackboneSpec(f"config:{path}", f"{family.display} (config)", family.name, lm,
                        gemma3_projector(lm.hidden, v_hidden), vision, tokens,
                        f"one {image}×{image} view pooled to {tokens} tokens", (image, image),
                        source=str(path))  # fmt: skip
