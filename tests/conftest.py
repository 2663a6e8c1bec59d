"""Test-wide setup: every test run builds demo backbones in its own CARE_HOME, never the user's cache."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def isolated_care_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    home = tmp_path_factory.mktemp("care_home")
    saved = os.environ.get("CARE_HOME")
    os.environ["CARE_HOME"] = str(home)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    yield home
    if saved is None:
        os.environ.pop("CARE_HOME", None)
    else:
        os.environ["CARE_HOME"] = saved
