"""Errors the library raises for bad user input; the CLI turns each into one line and exit code 2."""

from __future__ import annotations


class CareError(ValueError):
    """Base class: a problem with what the user asked for (not a bug)."""


class BudgetError(CareError):
    """The token budget (ratio or keep) is invalid."""


class ModelLoadError(CareError):
    """A model name, folder or cache entry cannot be loaded."""


class QuestionError(CareError):
    """A question yields no usable (non-special) tokens."""


class MethodError(CareError):
    """A method name is unknown or a method cannot run on the given inputs."""


class ImageError(CareError):
    """An image file is missing, unreadable, corrupt or too large."""


class ConfigError(CareError):
    """A hyperparameter is outside its meaningful range; ``field`` names it (a CaReConfig field)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field} {message}")
        self.field = field
        self.detail = message


class GenerationError(CareError):
    """A generation option cannot be honoured here (e.g. CUDA graphs asked for without a CUDA device)."""
