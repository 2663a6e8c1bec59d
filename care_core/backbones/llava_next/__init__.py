"""The LLaVA-NeXT family's record: its facts, demos, ``care flops`` specs and lmms-eval id (torch-free).

Sources of the ``care flops`` numbers: LLaVA-NeXT-7B/13B ``llava-hf/llava-v1.6-vicuna-{7,13}b-hf``: the language
models and CLIP tower of LLaVA-1.5 (``care_core.backbones.common_specs``), ``image_grid_pinpoints``
[[336,672],[672,336],[672,672],[1008,336],[336,1008]] (height, width).

Its ``care flops`` config reader is here too (:func:`spec_from_config`); the adapter is ``adapter.py``, the demo
builders ``demo.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from fractions import Fraction
from pathlib import Path
from typing import Any

from care_core.architecture import BackboneSpec, BackboneSpecError
from care_core.backbones.common_specs import CLIP_L336, VICUNA_7B, VICUNA_13B, llava_projector
from care_core.backbones.families import OPTIONAL_WEIGHTS, BackboneFamily, DemoBackbone, FullSizeModel
from care_core.backbones.llava_1_5 import llava_config, llava_parts
from care_core.flops.tokens import visual_tokens

_DEMO = "care_core.backbones.llava_next.demo"
_NEXT_GEOMETRY = "LLaVA-NeXT geometry (CLIP-336/14, anyres pinpoints, 2880 tokens at 672x672)"

PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))
#: the paper's N (a 672×672 image) and its budgets (K) there
PAPER_TOKENS, PAPER_BUDGETS = 2880, (640, 320, 160)
NOTE = "LLaVA-NeXT at 672×672: 576 base + 2304 unpadded high-res tokens, no newline rows (paper's N)"
LLAVA_NEXT_7B = BackboneSpec(
    "llava-next-7b", "LLaVA-NeXT-7B", "llava-next", VICUNA_7B, llava_projector(4096), CLIP_L336,
    PAPER_TOKENS, NOTE, (672, 672), PINPOINTS, paper_budgets=PAPER_BUDGETS, paper_key="LLaVA-NeXT-7B",
    source="llava-hf/llava-v1.6-vicuna-7b-hf config.json",
    aliases=("llava-1.6", "llava-v1.6-vicuna-7b", "llava-1.6-7b",
             "llava-hf/llava-v1.6-vicuna-7b-hf", "liuhaotian/llava-v1.6-vicuna-7b"),
)  # fmt: skip
LLAVA_NEXT_13B = BackboneSpec(
    "llava-next-13b", "LLaVA-NeXT-13B", "llava-next", VICUNA_13B, llava_projector(5120), CLIP_L336,
    PAPER_TOKENS, NOTE, (672, 672), PINPOINTS, paper_budgets=PAPER_BUDGETS,
    source="llava-hf/llava-v1.6-vicuna-13b-hf config.json",
    aliases=("llava-v1.6-vicuna-13b", "llava-1.6-13b", "llava-hf/llava-v1.6-vicuna-13b-hf",
             "liuhaotian/llava-v1.6-vicuna-13b"),
)  # fmt: skip

FAMILY = BackboneFamily(
    name="llava-next", rank=20, display="LLaVA-NeXT", model_types=("llava_next",),
    adapter="care_core.backbones.llava_next.adapter:LlavaNextAdapter",
    has_cls_token=True, single_grid=False, crops=True,
    flops_spec="llava-next-7b", lmms_eval_model="care_llava",
    demos=(
        DemoBackbone("tiny-llava-next", 1, "llava-next", f"{_DEMO}:build_tiny_llava_next",
                     f"{_NEXT_GEOMETRY}, " + OPTIONAL_WEIGHTS,
                     weights="tiny-llava-next.safetensors", trained_builder=f"{_DEMO}:build_trained_tiny_llava_next"),
        DemoBackbone("tiny-llava-next-random", 1, "llava-next", f"{_DEMO}:build_tiny_llava_next",
                     f"{_NEXT_GEOMETRY}, tiny random weights; demo only"),
    ),
    flops_specs=(LLAVA_NEXT_7B, LLAVA_NEXT_13B),
    flops_config="care_core.backbones.llava_next:spec_from_config",
    lmms_eval_aliases=("care_llava_next",),
    full_size=FullSizeModel(image_side_px=672, builder=f"{_DEMO}:build_full_size"),
)  # fmt: skip


def pinpoints(config: Any, path: Path) -> tuple[tuple[int, int], ...]:
    raw_pinpoints = [tuple(int(v) for v in p) for p in config.image_grid_pinpoints]
    if not raw_pinpoints or any(len(p) != 2 or min(p) < 1 for p in raw_pinpoints):
        raise BackboneSpecError(f"{path}: image_grid_pinpoints must be a list of [height, width] pairs")
    return tuple((p[0], p[1]) for p in raw_pinpoints)


def with_default_image(spec: BackboneSpec, display: str) -> BackboneSpec:
    """An anyres spec's default image (672×672, else 768×768 where a pinpoint, else the largest pinpoint), its N and
    budgets at LLaVA-NeXT's paper fractions (640, 320, 160 of 2880)."""
    pins = spec.grid_pinpoints
    default_image = next((p for p in ((672, 672), (768, 768)) if p in pins), None)
    default_image = default_image or max(pins, key=lambda p: p[0] * p[1])
    n = visual_tokens(spec, *default_image).tokens
    budgets = tuple(max(1, int(Fraction(k, PAPER_TOKENS) * n)) for k in PAPER_BUDGETS)
    note = f"{display} at {default_image[0]}×{default_image[1]}: base + unpadded high-res, no newline rows"
    return replace(spec, default_tokens=n, default_tokens_note=note, default_image=default_image,
                   paper_budgets=budgets)  # fmt: skip


def spec_from_config(raw: Mapping[str, Any], path: Path, family: BackboneFamily) -> BackboneSpec:
    """The CLIP tower on a base view + anyres crops at the config's pinpoints."""
    config, lm = llava_config(raw, path)
    vision, projector = llava_parts(config, lm, path)
    spec = BackboneSpec(f"config:{path}", f"{family.display} (config)", family.name, lm, projector, vision, 0, "",
                        None, pinpoints(config, path), source=str(path))  # fmt: skip
    return with_default_image(spec, family.display)
