"""Integrations with evaluation frameworks.

* :mod:`care_core.integrations.settings`: what one evaluation runs (model, method, budget, hyperparameters),
  parsed from ``model_args``-style key/values; no third-party imports.
* :mod:`care_core.integrations.lmms_eval`: lmms-eval model classes (entry point group ``lmms_eval.models``)
  and the in-process evaluation helpers ``care eval`` uses. The only module that imports ``lmms_eval``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

#: What to install when lmms-eval is missing (one line, for error messages).
EVAL_EXTRA_HINT = "pip install 'care-vtr[eval]'"


def lmms_eval_missing() -> str | None:
    """None when lmms-eval can be imported; otherwise a one-line error saying what to install."""
    if importlib.util.find_spec("lmms_eval") is None:
        return f"care eval needs lmms-eval, which is not installed: {EVAL_EXTRA_HINT}"
    return None


def broken_torchvision() -> str | None:
    """A one-line error when torchvision is installed but cannot be imported (it then breaks transformers).

    lmms-eval depends on torchvision; beside a CPU-only torch the registry's torchvision wheel fails at import
    (``operator torchvision::nms does not exist``). Nothing of care needs torchvision.
    """
    if importlib.util.find_spec("torchvision") is None:
        return None
    try:
        import torchvision  # noqa: F401
    except Exception as exc:
        from care_core.errors import one_line

        detail = one_line(exc)[:160]
        return (
            f"torchvision is installed but cannot be imported ({type(exc).__name__}: {detail}); it does not match "
            "your torch build. Install the torchvision built for your torch, or remove it: pip uninstall torchvision"
        )
    return None


def missing_task_path(spec: str) -> str | None:
    """The problem with a ``--tasks`` entry written as a path (a .yaml/.yml suffix, a ``/``, a leading ``.``) that
    does not exist; None for an existing path or a task name. Checked before lmms-eval is imported (seconds)."""
    path = Path(spec).expanduser()
    looks_like_path = path.suffix.lower() in (".yaml", ".yml") or "/" in spec or spec.startswith(".")
    if looks_like_path and not path.exists():
        return f"{spec}: no such task folder or YAML file"
    return None
