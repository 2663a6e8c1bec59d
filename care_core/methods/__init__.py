"""Token-reduction methods behind one contract (base.py), one module each, and their registry."""

from care_core.methods.base import (
    BACKBONE_FAMILIES,
    PROBES,
    Method,
    MethodInputs,
    MethodResult,
    canonical_family,
    selection_result,
)
from care_core.methods.registry import (
    build_method,
    canonical_name,
    create_method,
    method_class,
    method_names,
    methods_for_backbone,
    register,
    score_label,
)

__all__ = [
    "BACKBONE_FAMILIES",
    "PROBES",
    "Method",
    "MethodInputs",
    "MethodResult",
    "build_method",
    "canonical_family",
    "canonical_name",
    "create_method",
    "method_class",
    "method_names",
    "methods_for_backbone",
    "register",
    "score_label",
    "selection_result",
]
