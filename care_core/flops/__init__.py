"""Analytic FLOPs of visual-token reduction (paper Supp. B), per-layer token schedules and backbone specs.

Pure Python on exact integers, no torch (the FlopCounterMode cross-check lives in `tests/flops/_counter.py`). The
names below are imported on first use, so that the CLI can read one module (a choice list, the spec names) cheaply.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from care_core._lazy import lazy_exports

if TYPE_CHECKING:
    from care_core.flops.formulas import (
        equivalent_tokens,
        layer_flops,
        prefill_flops,
        projector_flops,
        residual_terms,
        score_terms,
        to_unit,
    )
    from care_core.flops.methods import MethodCost, cost_model_names, method_cost
    from care_core.flops.report import FlopsOptions, flops_report
    from care_core.flops.specs import KNOWN_BACKBONES, BackboneSpec, BackboneSpecError, from_config, resolve_backbone
    from care_core.flops.tokens import parse_image_size, visual_tokens

_HOMES = {
    "equivalent_tokens": "formulas",
    "layer_flops": "formulas",
    "prefill_flops": "formulas",
    "projector_flops": "formulas",
    "residual_terms": "formulas",
    "score_terms": "formulas",
    "to_unit": "formulas",
    "MethodCost": "methods",
    "cost_model_names": "methods",
    "method_cost": "methods",
    "FlopsOptions": "report",
    "flops_report": "report",
    "KNOWN_BACKBONES": "specs",
    "BackboneSpec": "specs",
    "BackboneSpecError": "specs",
    "from_config": "specs",
    "resolve_backbone": "specs",
    "parse_image_size": "tokens",
    "visual_tokens": "tokens",
}

__all__ = [
    "KNOWN_BACKBONES",
    "BackboneSpec",
    "BackboneSpecError",
    "FlopsOptions",
    "MethodCost",
    "cost_model_names",
    "equivalent_tokens",
    "flops_report",
    "from_config",
    "layer_flops",
    "method_cost",
    "parse_image_size",
    "prefill_flops",
    "projector_flops",
    "residual_terms",
    "resolve_backbone",
    "score_terms",
    "to_unit",
    "visual_tokens",
]

__getattr__ = lazy_exports(__name__, _HOMES)
