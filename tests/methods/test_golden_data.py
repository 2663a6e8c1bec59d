"""The golden files live in the repository: the folder holds exactly the files the tests name, a missing one fails
the test that needs it, and scripts/check_golden.py checks the folder when given no file."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import GOLDEN_DIR, GOLDEN_FILES, check_golden_script, golden_path


def test_folder_holds_exactly_the_named_files() -> None:
    named = sorted(name for names in GOLDEN_FILES.values() for name in names)
    assert sorted(p.name for p in GOLDEN_DIR.glob("*.npz")) == named
    assert (GOLDEN_DIR / "README.md").is_file()
    readme = (GOLDEN_DIR / "README.md").read_text(encoding="utf-8")
    assert all(name in readme for name in named), "every golden file is described in the folder's README"


def test_every_prefix_has_a_checker() -> None:
    prefixes = check_golden_script().PREFIXES
    for names in GOLDEN_FILES.values():
        for name in names:
            assert any(name.startswith(prefix) for prefix in prefixes), name


def test_a_missing_golden_file_fails_rather_than_skips() -> None:
    with pytest.raises(pytest.fail.Exception, match="golden file missing"):
        golden_path("visionzip_does_not_exist.npz")


def test_check_golden_defaults_to_the_repository_folder() -> None:
    script = check_golden_script()
    assert script.DEFAULT_DIR == GOLDEN_DIR
    assert [p.name for p in script.default_files()] == sorted(p.name for p in GOLDEN_DIR.glob("*.npz"))


def test_check_golden_without_files_fails_on_an_empty_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    script = check_golden_script()
    monkeypatch.setattr(script, "DEFAULT_DIR", tmp_path)
    assert script.main([]) == 1
    assert capsys.readouterr().out.startswith("FAIL no golden files")


def test_check_golden_reports_a_missing_named_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert check_golden_script().main([str(tmp_path / "tome_missing.npz")]) == 1
    assert "FAIL" in capsys.readouterr().out
