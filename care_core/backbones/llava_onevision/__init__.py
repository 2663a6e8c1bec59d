"""The LLaVA-OneVision family's record: its facts, demos, ``care flops`` specs and lmms-eval id (torch-free).

Sources of the ``care flops`` numbers: LLaVA-OneVision-7B ``llava-hf/llava-onevision-qwen2-7b-ov-hf`` (no hub file was
checked: the numbers are transformers' ``LlavaOnevisionConfig`` defaults and the published Qwen2-7B / SigLIP-so400m
dims): SigLIP-so400m 384/14 (hidden 1152, intermediate 4304, 16 heads, 729 patches, no CLS) with **26** layers, the
class default (so400m has 27; the conversion keeps 26 because the original LLaVA-OneVision reads the penultimate
layer, which transformers reads as layer -1); strategy "full"; ``vision_aspect_ratio`` "anyres_max_9"; 36 pinpoints
384..2304 in steps of 384. Qwen2-7B: L=28, H=3584, I=18944, 28 heads, 4 KV heads, vocab 152064 (unconfirmed for the
hf checkpoint, whose tokenizer adds <image>/<video>). Projector ``LlavaOnevisionMultiModalProjector``:
Linear(1152, 3584) -> GELU -> Linear(3584, 3584).

Its ``care flops`` config reader is here too (:func:`spec_from_config`); the adapter is ``adapter.py``, the demo
builders ``demo.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from care_core.architecture import BackboneSpec, LanguageModelSpec, VisionSpec
from care_core.backbones.common_specs import llava_projector
from care_core.backbones.families import OPTIONAL_WEIGHTS, BackboneFamily, DemoBackbone, FullSizeModel
from care_core.backbones.geometry import anyres_max_crops
from care_core.backbones.llava_1_5 import llava_config, llava_parts
from care_core.backbones.llava_next import pinpoints, with_default_image

_DEMO = "care_core.backbones.llava_onevision.demo"
_ONEVISION_GEOMETRY = "LLaVA-OneVision geometry (SigLIP-384/14, no CLS, anyres_max_9 pinpoints, 3645 tokens at 768x768)"

QWEN2_7B = LanguageModelSpec(layers=28, hidden=3584, intermediate=18944, heads=28, kv_heads=4, vocab=152064)
SIGLIP_SO400M_384 = VisionSpec(kind="siglip", layers=26, hidden=1152, intermediate=4304, heads=16, patch_size=14,
                               image_size=384, feature_tokens=729)  # fmt: skip
PINPOINTS = tuple((h, w) for h in range(384, 2305, 384) for w in range(384, 2305, 384))
MAX_CROPS = 9
NOTE = "LLaVA-OneVision at 768×768: 729 base + 2916 unpadded high-res tokens, no newline rows, no pooling (ratio ≤ 1.1)"
#: LLaVA-NeXT's paper fractions (640, 320, 160 of 2880) at OneVision's 3645: the paper has no OneVision rows
BUDGETS = (810, 405, 202)
LLAVA_ONEVISION_7B = BackboneSpec(
    "llava-onevision-7b", "LLaVA-OneVision-7B", "llava-onevision", QWEN2_7B, llava_projector(3584, 1152),
    SIGLIP_SO400M_384, 3645, NOTE, (768, 768), PINPOINTS, max_crops=MAX_CROPS, paper_budgets=BUDGETS,
    source="transformers LlavaOnevisionConfig defaults + Qwen2-7B dims (llava-onevision-qwen2-7b-ov-hf, "
           "hub file not checked)",
    aliases=("llava-onevision-qwen2-7b-ov-hf", "llava-hf/llava-onevision-qwen2-7b-ov-hf", "llava-ov-7b",
             "lmms-lab/llava-onevision-qwen2-7b-ov"),
)  # fmt: skip

FAMILY = BackboneFamily(
    name="llava-onevision", rank=60, display="LLaVA-OneVision", model_types=("llava_onevision",),
    adapter="care_core.backbones.llava_onevision.adapter:LlavaOnevisionAdapter", has_cls_token=False, single_grid=False,
    crops=True, flops_spec="llava-onevision-7b", lmms_eval_model="care_llava",
    demos=(
        DemoBackbone("tiny-llava-onevision", 1, "llava-onevision", f"{_DEMO}:build_tiny_llava_onevision",
                     f"{_ONEVISION_GEOMETRY}, " + OPTIONAL_WEIGHTS, weights="tiny-llava-onevision.safetensors",
                     trained_builder=f"{_DEMO}:build_trained_tiny_llava_onevision"),
        DemoBackbone("tiny-llava-onevision-random", 1, "llava-onevision", f"{_DEMO}:build_tiny_llava_onevision",
                     f"{_ONEVISION_GEOMETRY}, tiny random weights; demo only"),
    ),
    flops_specs=(LLAVA_ONEVISION_7B,),
    flops_config="care_core.backbones.llava_onevision:spec_from_config",
    lmms_eval_aliases=("care_llava_onevision",),
    full_size=FullSizeModel(image_side_px=768, builder=f"{_DEMO}:build_full_size"),
)  # fmt: skip


def spec_from_config(raw: Mapping[str, Any], path: Path, family: BackboneFamily) -> BackboneSpec:
    """The SigLIP tower (no CLS, so strategy "full" keeps exactly the patches) on anyres crops, pooled beyond the
    config's ``anyres_max_<crops>``."""
    config, lm = llava_config(raw, path)
    vision, projector = llava_parts(config, lm, path, kind="siglip", cls_token=False)
    pins = pinpoints(config, path)
    max_crops = anyres_max_crops(str(getattr(config, "vision_aspect_ratio", "anyres_max_9")))
    spec = BackboneSpec(f"config:{path}", f"{family.display} (config)", family.name, lm, projector, vision, 0, "",
                        None, pins, max_crops=max_crops, source=str(path))  # fmt: skip
    return with_default_image(spec, family.display)
