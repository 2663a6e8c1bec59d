"""CLI test helpers: the example photos (the `care` fixture lives in tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def photo() -> Path:
    return EXAMPLES / "astronaut.jpg"
