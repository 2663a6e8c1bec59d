"""CI's commit-subject check (.ci/commit_subjects.py) on throwaway repositories built here."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_check() -> ModuleType:
    # .ci is no package (its name has a dot), so the script is loaded from its path
    spec = importlib.util.spec_from_file_location("commit_subjects", ROOT / ".ci" / "commit_subjects.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check = _load_check()


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


def _commit(repo: Path, message: str) -> str:
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@example.invalid", "-c", "commit.gpgsign=false", "commit",
         "-q", "--allow-empty", "-m", message)  # fmt: skip
    return _git(repo, "rev-parse", "HEAD")


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty repository, with the user's and the system's git configuration out of the way."""
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "no-global-config"))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    path = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(path)], check=True)
    return path


def test_a_subject_over_72_characters_after_the_base_fails_naming_the_commit(
    repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = _commit(repo, "base")
    _commit(repo, "fine")
    long_commit = _commit(repo, "x" * 73)
    assert check.main(["--repo", str(repo), "--base", base]) == 1
    err = capsys.readouterr().err
    assert long_commit[:7] in err and "73 characters" in err


def test_long_subjects_up_to_the_base_are_not_checked(repo: Path) -> None:
    _commit(repo, "an old subject " + "y" * 200)
    base = _commit(repo, "z" * 80)  # the base itself landed before the rule
    _commit(repo, "a" * 72)  # exactly the limit
    assert check.main(["--repo", str(repo), "--base", base]) == 0


def test_no_commit_after_the_base_passes(repo: Path) -> None:
    base = _commit(repo, "w" * 90)
    assert check.main(["--repo", str(repo), "--base", base]) == 0


def test_subject_is_the_first_paragraph_as_oneline_shows_it(repo: Path) -> None:
    """Two lines with no blank line between them are one subject for git, 40 + 1 + 40 characters here."""
    base = _commit(repo, "base")
    _commit(repo, "a" * 40 + "\n" + "b" * 40 + "\n\nthe body may be as long as it likes " + "c" * 200)
    assert [len(subject) for _, subject in check.subjects_after(repo, base)] == [81]
    assert check.main(["--repo", str(repo), "--base", base]) == 1


def test_a_long_body_under_a_short_subject_passes(repo: Path) -> None:
    base = _commit(repo, "base")
    _commit(repo, "short subject\n\n" + "the story " * 50)
    assert check.main(["--repo", str(repo), "--base", base]) == 0


def test_subjects_are_counted_in_characters_not_bytes(repo: Path) -> None:
    base = _commit(repo, "base")
    _commit(repo, "é" * 72)  # 144 bytes in UTF-8
    assert check.main(["--repo", str(repo), "--base", base]) == 0


def test_merge_commits_are_checked_too(repo: Path) -> None:
    base = _commit(repo, "base")
    _git(repo, "checkout", "-q", "-b", "side")
    _commit(repo, "on the side")
    _git(repo, "checkout", "-q", "-")
    _commit(repo, "on main")
    _git(
        repo,
        "-c",
        "user.name=t",
        "-c",
        "user.email=t@example.invalid",
        "merge",
        "-q",
        "--no-ff",
        "-m",
        "m" * 73,
        "side",
    )
    assert [len(subject) for _, subject in check.too_long(check.subjects_after(repo, base))] == [73]


def test_a_base_that_is_not_an_ancestor_exits_2_in_one_line(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _commit(repo, "only")
    assert check.main(["--repo", str(repo), "--base", "0" * 40]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not an ancestor" in err


def test_a_folder_that_is_no_repository_exits_2_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # no repository above tmp_path either
    assert check.main(["--repo", str(tmp_path), "--base", "0" * 40]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a git repository" in err


def test_the_base_is_on_this_history_after_its_last_long_subjects() -> None:
    """The two newest long subjects on main (8a5c4c1, a790f51) lie at or before the base, which HEAD descends from."""
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    for old in ("8a5c4c1", "a790f51"):
        _git(ROOT, "merge-base", "--is-ancestor", old, check.SUBJECTS_BASE)
    _git(ROOT, "merge-base", "--is-ancestor", check.SUBJECTS_BASE, "HEAD")
