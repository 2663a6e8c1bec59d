"""care_core: the CaRe algorithm as pure tensor code (no I/O). Public API fixed by SPEC.md."""

from care_core.care import Reduction, care_reduce
from care_core.config import CaReConfig, resolve_budget
from care_core.csr import csr_score

__all__ = ["CaReConfig", "Reduction", "care_reduce", "csr_score", "resolve_budget"]
__version__ = "0.1.0"
