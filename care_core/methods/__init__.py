"""Token-reduction methods behind one contract (base.py), one module each, and their registry."""

from care_core.methods.base import (
    Method,
    MethodInputs,
    MethodResult,
    backbone_family,
    selection_result,
)
from care_core.methods.registry import (
    build_method,
    canonical_name,
    method_class,
    method_names,
    methods_for_backbone,
    register,
    score_label,
)

__all__ = [
    "Method",
    "MethodInputs",
    "MethodResult",
    "backbone_family",
    "build_method",
    "canonical_name",
    "method_class",
    "method_names",
    "methods_for_backbone",
    "register",
    "score_label",
    "selection_result",
]
