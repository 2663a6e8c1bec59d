"""User errors: one line on stderr, exit code 2, never a traceback."""

from __future__ import annotations

from care_core.errors import CareError


class UserError(CareError):
    """A problem with a file, path or option the user gave."""


def one_line(message: object) -> str:
    """A message (or a path) on one line: runs of whitespace, newlines included, become one space."""
    return " ".join(str(message).split())
