"""Errors the library raises for bad user input; the CLI turns each into one line and exit code 2.

A message names the library's parameters, never a command-line flag: ``{keep}`` in a message stands for the
parameter ``keep``. ``str(error)`` shows the bare names (``keep must be …``); the CLI renders the same message
with its own flags (``--keep must be …``) through :meth:`CareError.render`.
"""

from __future__ import annotations

import re
from collections.abc import Callable

_PARAMETER = re.compile(r"\{([a-z_][a-z0-9_]*)\}")


def one_line(text: object) -> str:
    """``str(text)`` on one line: every run of whitespace (newlines included) becomes one space."""
    return " ".join(str(text).split())


def failure_line(exc: BaseException) -> str:
    """What went wrong, on one line: a CareError's own message; any other error's type and message."""
    return one_line(exc if isinstance(exc, CareError) else f"{type(exc).__name__}: {exc}")


class CareError(ValueError):
    """Base class: a problem with what the user asked for (not a bug).

    ``parameter``: the parameter the message is about, or None. With one, the message is the rest of the
    sentence ("must be in (0, 1], got 2") and the parameter's name is put in front of it. Other parameters
    may be named inside the message as ``{name}``.
    """

    def __init__(self, message: str, parameter: str | None = None) -> None:
        self.parameter = parameter
        self.detail = message
        self.template = message if parameter is None else "{" + parameter + "} " + message
        super().__init__(self.render())

    @property
    def parameters(self) -> list[str]:
        """Every parameter the message names, in order."""
        return _PARAMETER.findall(self.template)

    def render(self, name_of: Callable[[str], str] = str) -> str:
        """The message with each named parameter spelled by ``name_of`` (the CLI passes its flag lookup)."""
        return _PARAMETER.sub(lambda match: name_of(match.group(1)), self.template)


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
        super().__init__(message, parameter=field)
        self.field = field


class GenerationError(CareError):
    """A generation option cannot be honoured here (e.g. CUDA graphs asked for without a CUDA device)."""


class CareWarning(UserWarning):
    """A one-line warning about what the user gave that is served anyway; the CLI prints it as ``warning: …``."""


class LargeImageWarning(CareWarning):
    """An image above Pillow's decompression-bomb warning size, within the limit: it is decoded (slowly, in much
    memory)."""
