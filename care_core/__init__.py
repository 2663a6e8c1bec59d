"""care_core: the library under the ``care`` command, in layers (docs/design.md §Layers).

The equations (budget, scoring, anchors, calibration, care, csr) are pure tensor functions: tensors in, dataclasses
out, no I/O. Above them sit the methods, the backbone adapters (which load checkpoints), and what runs them: the
pipeline, data-set runs (which start processes and append results to files), figures, the drop-in and the lmms-eval
plugin. The public names are imported on first use, so that importing the package (and its metadata,
the method registry, the flops model) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "CaReConfig": "care_core.config",
    "resolve_budget": "care_core.budget",
    "Budget": "care_core.budget",
    "Reduction": "care_core.care",
    "care_reduce": "care_core.care",
    "care_reduce_batch": "care_core.care_batch",
    "csr_score": "care_core.csr",
    "reduce_visual_tokens": "care_core.dropin",
    "VisualTokenReduction": "care_core.dropin",
}

if TYPE_CHECKING:
    from care_core.budget import Budget, resolve_budget
    from care_core.care import Reduction, care_reduce
    from care_core.care_batch import care_reduce_batch
    from care_core.config import CaReConfig
    from care_core.csr import csr_score
    from care_core.dropin import VisualTokenReduction, reduce_visual_tokens


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'care_core' has no attribute {name!r}")


__all__ = [
    "Budget",
    "CaReConfig",
    "Reduction",
    "VisualTokenReduction",
    "__version__",
    "care_reduce",
    "care_reduce_batch",
    "csr_score",
    "reduce_visual_tokens",
    "resolve_budget",
]
