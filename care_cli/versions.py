"""Package versions written beside every output."""

from __future__ import annotations

import platform
from importlib import metadata


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("care-vtr", "torch", "transformers", "safetensors", "numpy", "pillow"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out
