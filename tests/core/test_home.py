"""care_core.home: the caches care's commands cause go under CARE_HOME, unless the user placed them."""

from __future__ import annotations

from pathlib import Path

import pytest

from care_core.home import LIBRARY_CACHES, cache_environment

#: every variable that places one of the caches (unset by the fixture: the user placed none)
PLACING = [name for cache in LIBRARY_CACHES for name in (cache.variable, *cache.also_decided_by)]


@pytest.fixture
def unplaced(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """CARE_HOME in tmp and none of the libraries' own cache variables set."""
    for name in PLACING:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CARE_HOME", str(tmp_path / "care"))
    return tmp_path / "care"


def test_every_library_cache_goes_under_care_home(unplaced: Path) -> None:
    assert cache_environment() == {
        "HF_DATASETS_CACHE": str(unplaced / "huggingface" / "datasets"),
        "MPLCONFIGDIR": str(unplaced / "matplotlib"),
        "TRITON_CACHE_DIR": str(unplaced / "triton"),
        "TORCHINDUCTOR_CACHE_DIR": str(unplaced / "torchinductor"),
        "CUDA_CACHE_PATH": str(unplaced / "nvidia-compute"),
    }


@pytest.mark.parametrize(
    ("variable", "leaves"),
    [
        ("HF_DATASETS_CACHE", "HF_DATASETS_CACHE"),
        ("HF_HOME", "HF_DATASETS_CACHE"),
        ("LMMS_EVAL_DATASETS_CACHE", "HF_DATASETS_CACHE"),
        ("MPLCONFIGDIR", "MPLCONFIGDIR"),
        ("TRITON_CACHE_DIR", "TRITON_CACHE_DIR"),
        ("TRITON_HOME", "TRITON_CACHE_DIR"),
        ("TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"),
        ("CUDA_CACHE_PATH", "CUDA_CACHE_PATH"),
    ],
)
def test_a_cache_the_user_placed_stays_theirs(
    unplaced: Path, monkeypatch: pytest.MonkeyPatch, variable: str, leaves: str
) -> None:
    monkeypatch.setenv(variable, "/somewhere/of/theirs")
    environment = cache_environment()
    assert leaves not in environment
    assert len(environment) == len(LIBRARY_CACHES) - 1  # the others still go under CARE_HOME
