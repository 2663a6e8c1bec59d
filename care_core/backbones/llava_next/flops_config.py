"""``care flops`` from a LLaVA-NeXT ``config.json`` (model_type ``llava_next``), and the anyres default image the
LLaVA-OneVision reader shares. Torch-free (transformers fills the config's defaults)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from fractions import Fraction
from pathlib import Path
from typing import Any

from care_core.architecture import BackboneSpec, BackboneSpecError
from care_core.backbones.families import BackboneFamily
from care_core.backbones.llava_1_5.flops_config import llava_config, llava_parts
from care_core.flops.tokens import visual_tokens

from .record import PAPER_BUDGETS, PAPER_TOKENS


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
