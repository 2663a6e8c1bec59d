"""Token-reduction methods behind one contract (base.py), one module each, and their registry."""

from care_core.methods.base import PROBES, Method, MethodInputs, MethodResult, selection_result
from care_core.methods.registry import canonical_name, create_method, method_class, method_names, register

__all__ = [
    "PROBES",
    "Method",
    "MethodInputs",
    "MethodResult",
    "canonical_name",
    "create_method",
    "method_class",
    "method_names",
    "register",
    "selection_result",
]
