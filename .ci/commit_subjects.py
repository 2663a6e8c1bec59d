"""CI's commit-subject check: every commit after the rule's base has a subject of at most 72 characters.

CI runs in a fresh clone of the submitted main, which keeps no record of what landed before, so the commits it lands
are taken as every commit after a fixed base: the newest commit on main when the rule came in. Whatever landed since
passed this check, so re-checking it costs nothing and never fails; the older long subjects (8a5c4c1, a790f51 and
those before them) are not checked. A subject is what `git log --oneline` shows (git's %s: the first paragraph of the
message, its lines joined), counted in characters.

Usage: python .ci/commit_subjects.py [--base COMMIT] [--repo DIR]; exit 0 when all fit, 1 naming those that do not,
2 when the check cannot run (no git, no repository, a base that is not an ancestor of HEAD).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

MAX_SUBJECT_CHARS = 72
# main's HEAD when the rule came in; the commits after it are the ones CI lands or has landed
SUBJECTS_BASE = "df62ccaaf6edd359f4671e19521f2f9f98ee5d93"


class CheckError(Exception):
    """The check cannot run: the message says why, in one line."""


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    try:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, check=False)
    except FileNotFoundError as error:
        raise CheckError("git is not installed") from error


def subjects_after(repo: Path, base: str) -> list[tuple[str, str]]:
    """(short hash, subject) of every commit reachable from HEAD and not from `base`, newest first."""
    if _git(repo, "rev-parse", "--is-inside-work-tree").returncode != 0:
        raise CheckError(f"{repo} is not a git repository")
    if _git(repo, "merge-base", "--is-ancestor", base, "HEAD").returncode != 0:
        raise CheckError(f"base commit {base[:12]} is not an ancestor of HEAD (a shallow clone or rewritten history?)")
    # NUL-separated: a subject never holds NUL, and the bytes are decoded whole so that characters are counted
    log = _git(repo, "log", "-z", "--format=%h %s", f"{base}..HEAD")
    if log.returncode != 0:
        raise CheckError(f"git log failed: {log.stderr.decode(errors='replace').strip()}")
    entries = [entry for entry in log.stdout.decode("utf-8", errors="replace").split("\0") if entry]
    return [(entry.partition(" ")[0], entry.partition(" ")[2]) for entry in entries]


def too_long(commits: list[tuple[str, str]], max_chars: int = MAX_SUBJECT_CHARS) -> list[tuple[str, str]]:
    """The commits whose subject is over `max_chars` characters."""
    return [(sha, subject) for sha, subject in commits if len(subject) > max_chars]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=SUBJECTS_BASE, help="check the commits after this one")
    parser.add_argument("--repo", type=Path, default=Path.cwd(), help="the repository (default: here)")
    options = parser.parse_args(argv)
    try:
        commits = subjects_after(options.repo, options.base)
    except CheckError as error:
        print(f"commit subjects: {error}", file=sys.stderr)
        return 2
    long_subjects = too_long(commits)
    for sha, subject in long_subjects:
        print(f"{sha}: subject has {len(subject)} characters (at most {MAX_SUBJECT_CHARS}): {subject}", file=sys.stderr)
    if long_subjects:
        print("commit subjects: keep the subject short and put the rest in the body", file=sys.stderr)
        return 1
    print(f"commit subjects: {len(commits)} commit(s) after {options.base[:12]}, each subject <= {MAX_SUBJECT_CHARS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
