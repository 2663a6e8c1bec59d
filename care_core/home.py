"""Where care keeps its files: ``CARE_HOME``, and the caches of the libraries care's commands drive.

``CARE_HOME`` (default: the platform's user cache folder, e.g. ``~/.cache/care``) holds the built demos and, for the
commands, the caches other libraries would write under the user's home: :data:`LIBRARY_CACHES` lists them. A cache
whose variable the user has set (or a variable that decides it, such as ``HF_HOME``) stays where the user put it.

This module imports neither torch nor transformers (every command reads it before its arguments are checked).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LIBRARY_CACHES", "LibraryCache", "cache_environment", "care_home"]


def care_home() -> Path:
    """Where care keeps its files (built demos, the commands' library caches): ``$CARE_HOME`` or the user cache
    folder."""
    env = os.environ.get("CARE_HOME")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("care"))


@dataclass(frozen=True)
class LibraryCache:
    """A cache another library writes when care's commands drive it, and how the user places it themselves."""

    variable: str  # the library's variable the commands set, under CARE_HOME
    folder: str  # its folder under CARE_HOME
    also_decided_by: tuple[str, ...]  # other variables of that library that place it (any of them set: left alone)
    written_by: str  # what writes it (for the docs and the reader)


LIBRARY_CACHES: tuple[LibraryCache, ...] = (
    LibraryCache("HF_DATASETS_CACHE", "huggingface/datasets", ("HF_HOME", "LMMS_EVAL_DATASETS_CACHE"),
                 "datasets, through lmms-eval: care eval's prepared task data"),
    LibraryCache("MPLCONFIGDIR", "matplotlib", (), "matplotlib's font list: care visualize, care csr --plot"),
    LibraryCache("TRITON_CACHE_DIR", "triton", ("TRITON_HOME",), "Triton: the fused kernels compiled on CUDA"),
    LibraryCache("TORCHINDUCTOR_CACHE_DIR", "torchinductor", (),
                 "torch.compile: the static loop's compiled decoder layers on CUDA"),
    LibraryCache("CUDA_CACHE_PATH", "nvidia-compute", (),
                 "the CUDA driver: kernels it compiles from PTX on their first use (by default in ~/.nv)"),
)  # fmt: skip


def cache_environment() -> dict[str, str]:
    """The variables a command sets (for itself and the processes it starts) so that every cache of
    :data:`LIBRARY_CACHES` is under :func:`care_home`: each one where neither it nor a variable that also decides it
    is set."""
    home = care_home()
    return {cache.variable: str(home / cache.folder) for cache in LIBRARY_CACHES
            if not any(os.environ.get(name) for name in (cache.variable, *cache.also_decided_by))}  # fmt: skip
