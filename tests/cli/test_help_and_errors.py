"""Help texts are shown as written (no emoji, no markup eaten); library errors reach the user with the
invoked command's flags, and the library itself never names a flag; outputs are checked before any loading."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from rich.text import Text

from care_cli.app import escape_help

from .conftest import EXAMPLES

CORE = Path(__file__).resolve().parents[2] / "care_core"
COMMANDS = ["", "reduce", "csr", "methods", "flops", "visualize", "eval"]
INVISIBLE = {"\u200b", "\u200c", "\u200d", "\u2060", "\ufeff", "\u00ad"}  # zero-width characters, soft hyphen


@pytest.mark.parametrize(
    "text",
    ["--ratio A:B:STEP gives a range", "[bold]not bold[/bold]", "[default: 3]", "a [b] c [/]", "cuda:N", ":smile: x",
     "HEIGHTxWIDTH (e.g. 672x672)", "a:b:c:d:e", ":B::B:"],
)  # fmt: skip
def test_help_text_is_shown_as_written(text: str) -> None:
    """Character for character: what a user copies from the help is what was written (no emoji, no invisible
    character splitting an emoji code)."""
    assert Text.from_markup(escape_help(text) or "").plain == text


def test_help_paragraphs_are_joined_into_sentences() -> None:
    """Each paragraph on one line, except Typer's ``\\b`` (keep the lines) paragraphs; no markup in these."""
    written = "First line.\n\n    A sentence that\n    goes on.\n\n\bkept\nas lines"
    assert escape_help(written) == "First line.\n\nA sentence that goes on.\n\n\bkept\nas lines"


@pytest.mark.parametrize("command", COMMANDS)
def test_help_has_no_emoji_and_no_markup(care, command: str) -> None:
    run = care(*([command] if command else []), "--help")
    assert run.code == 0, run.err
    emoji = [c for c in run.out if ord(c) >= 0x1F000 or 0x2600 <= ord(c) < 0x2800]
    assert not emoji, emoji
    assert "[/" not in run.out and "[bold" not in run.out


@pytest.mark.parametrize("command", COMMANDS)
def test_help_at_80_columns_cuts_no_word_and_hides_no_character(care, monkeypatch: pytest.MonkeyPatch,
                                                                command: str) -> None:  # fmt: skip
    monkeypatch.setenv("COLUMNS", "80")
    run = care(*([command] if command else []), "--help")
    assert run.code == 0, run.err
    assert "…" not in run.out, run.out
    assert not INVISIBLE & set(run.out)
    if command == "eval":
        assert "examples/tasks/)." in run.out  # the example of a task folder, whole
    if command == "csr":
        assert "START:STOP:STEP" in run.out  # as written, copyable


@pytest.mark.parametrize("command", [c for c in COMMANDS if c])
def test_help_descriptions_break_no_sentence(care, monkeypatch: pytest.MonkeyPatch, command: str) -> None:
    """Wide enough for every paragraph on one line, each paragraph of the description is one line: Typer kept the
    source's line breaks of later paragraphs, breaking sentences where the docstring's lines end."""
    import typer

    from care_cli.app import app

    monkeypatch.setenv("COLUMNS", "400")
    run = care(command, "--help")
    assert run.code == 0, run.err
    lines = [" ".join(line.split()) for line in run.out.splitlines()]
    description = typer.main.get_command(app).commands[command].help  # type: ignore[attr-defined]
    for paragraph in description.split("\n\n"):
        assert " ".join(paragraph.split()) in lines, (paragraph, run.out)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["reduce", EXAMPLES / "astronaut.jpg", "--keep", "2.5"], "--keep takes a whole number, got '2.5'"),
        (["reduce", EXAMPLES / "astronaut.jpg", "--keep", "8", "--engine", "xyz"],
         "--engine must be one of jvp, fd, got 'xyz'"),
        (["reduce", EXAMPLES / "astronaut.jpg", "--keep", "8", "--h", "small"], "--h takes a number, got 'small'"),
        (["csr", EXAMPLES / "astronaut.jpg", "-q", "x", "--keep", "8", "--keep", "1e3"],
         "--keep takes a whole number, got '1e3'"),  # a repeatable option: the value refused
        (["flops", "--convention", "tflops"], "--convention must be one of flops, macs, got 'tflops'"),
        (["eval", "--tasks", "pope", "--keep", "8", "--limit", "ten"], "--limit takes a number, got 'ten'"),
    ],
)  # fmt: skip
def test_values_an_option_refuses_get_one_line_in_our_words(care, args: list[object], message: str) -> None:
    run = care(*args)
    assert run.code == 2 and run.out == "" and run.err.count("\n") == 1, run.err
    assert run.err.startswith(f"error: {message} (see 'care "), run.err


# ------------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    ("args", "flags"),
    [
        (["reduce", EXAMPLES / "astronaut.jpg", "--ratio", "2"], ["--ratio"]),  # budget
        (["csr", EXAMPLES / "astronaut.jpg", "-q", "x", "--keep", "0"], ["--keep"]),  # budget, several
        (["flops", "--keep", "0"], ["--keep"]),  # budget against N
        (["reduce", EXAMPLES / "astronaut.jpg", "--keep", "8", "--theta-c", "2"], ["--theta-c"]),  # config
        (["reduce", EXAMPLES / "astronaut.jpg", "--keep", "8", "--lambda", "-1"], ["--lambda"]),  # field lam
        (["flops", "--text-tokens", "-1"], ["--text-tokens"]),  # flops options
        (["flops", "--tokens", "0"], ["--tokens"]),
        (["flops", "--tokens", "5", "--image-size", "10x10"], ["--tokens", "--image-size"]),
        (["flops", "--image-size", "10"], ["--image-size"]),  # image size
        (["flops", "--backbone", " "], ["--backbone"]),  # backbone
        (["eval", "--tasks", "pope", "--keep", "0"], ["--keep"]),  # model arguments of an eval setting
        (["reduce", EXAMPLES / "astronaut.jpg", "--keep", "8", "--generate", "--max-new-tokens", "0"],
         ["--max-new-tokens"]),  # generation
    ],
)  # fmt: skip
def test_library_errors_name_the_flags(care, args: list[object], flags: list[str]) -> None:
    run = care(*args)
    assert run.code == 2 and run.err.startswith("error: ") and run.err.count("\n") == 1, run.err
    for flag in flags:
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", run.err), run.err


def _error_texts(tree: ast.AST) -> list[tuple[int, str]]:
    """The string pieces of every ``SomethingError(...)`` call: the messages the library raises or returns."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name.endswith("Error"):
                for arg in [*node.args, *(k.value for k in node.keywords)]:
                    for piece in ast.walk(arg):
                        if isinstance(piece, ast.Constant) and isinstance(piece.value, str):
                            found.append((node.lineno, piece.value))
    return found


def test_library_error_messages_name_no_flag() -> None:
    flag = re.compile(r"(?<![\w-])--[a-zA-Z]")
    other_program = re.compile(r"'(?!care\b)[a-z][\w.-]* --[\w -]*'")  # another program's command, quoted
    offenders = []
    for path in sorted(CORE.rglob("*.py")):
        for line, text in _error_texts(ast.parse(path.read_text(), str(path))):
            if flag.search(other_program.sub("", text)):
                offenders.append(f"{path.relative_to(CORE.parent)}:{line}: {text}")
    assert not offenders, "\n".join(offenders)


# ------------------------------------------------------------------------------------------------ outputs first
@pytest.mark.parametrize(
    "args",
    [
        ["reduce", EXAMPLES / "astronaut.jpg", "--keep", "8", "--out", "{dir}/x.safetensors"],
        ["visualize", EXAMPLES / "astronaut.jpg", "--keep", "8", "--out", "{dir}/x.png"],
        ["csr", EXAMPLES / "astronaut.jpg", "-q", "x", "--keep", "8", "--csv", "{dir}/x.csv"],
    ],
)
def test_unwritable_output_folder_is_refused_before_loading(care, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            args: list[object]) -> None:  # fmt: skip
    from care_core.pipeline import ReductionPipeline

    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access

    def access(path: object, mode: int, *rest: object, **kw: object) -> bool:  # root may write anywhere: simulate
        if Path(str(path)).resolve() == locked.resolve() and mode & os.W_OK:
            return False
        return real_access(path, mode, *rest, **kw)  # type: ignore[arg-type]

    def no_loading(*_: object, **__: object) -> None:
        raise AssertionError("a model was loaded before the output was checked")

    monkeypatch.setattr(os, "access", access)
    monkeypatch.setattr(ReductionPipeline, "from_pretrained", no_loading)
    run = care(*[str(a).replace("{dir}", str(locked)) for a in args])
    assert run.code == 2 and "not writable" in run.err and run.err.count("\n") == 1, run.err


PAIR = [EXAMPLES / "astronaut.jpg", "-q", "x", "--keep", "8"]
#: one command per output location of every command that writes files ({dir}: where the output goes)
OUTPUTS = [
    ["reduce", EXAMPLES / "astronaut.jpg", "--keep", "8", "--out", "{dir}/x.safetensors"],
    ["visualize", EXAMPLES / "astronaut.jpg", "--keep", "8", "--out", "{dir}/x.png"],
    ["csr", *PAIR, "--csv", "{dir}/x.csv"],
    ["csr", *PAIR, "--plot", "{dir}/x.png"],
    ["csr", *PAIR, "--output-dir", "{dir}/run"],
    ["csr", "--data", EXAMPLES / "csr_pairs.jsonl", "--keep", "8", "--output-dir", "{dir}/run"],
    ["csr", "--data", EXAMPLES / "csr_pairs.jsonl", "--keep", "8", "--output-dir", "{dir}"],
]


@pytest.mark.parametrize("args", OUTPUTS)
def test_an_output_below_a_regular_file_is_refused_before_loading(
    care, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[object]
) -> None:
    """A path whose folder is a regular file cannot be written, also by root (no permission bits involved)."""
    from care_core.pipeline import ReductionPipeline

    def no_loading(*_: object, **__: object) -> None:
        raise AssertionError("a model was loaded before the output was checked")

    monkeypatch.setattr(ReductionPipeline, "from_pretrained", no_loading)
    regular = tmp_path / "notes.txt"
    regular.write_text("a regular file")
    run = care(*[str(a).replace("{dir}", str(regular)) for a in args])
    assert run.code == 2 and run.err.count("\n") == 1 and run.err.startswith("error: "), run.err
    assert str(regular) in run.err and ("is a file" in run.err or "is not a folder" in run.err), run.err
    assert regular.read_text() == "a regular file"


@pytest.fixture(scope="module")
def read_only_mount(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder that commands run through :func:`on_read_only_mount` see as an empty read-only file system (a tmpfs
    mounted read-only in a private mount namespace: nothing outside the command sees it). Skipped where this machine
    allows no such mount (no unshare, no user namespaces, no mount permission)."""
    if shutil.which("unshare") is None:
        pytest.skip("no read-only mount here: the unshare command is missing")
    folder = tmp_path_factory.mktemp("read_only")
    probe = on_read_only_mount(folder, ["sh", "-c", 'touch "$0/probe" 2>/dev/null && exit 98 || exit 0', folder])
    if probe.returncode != 0:
        reason = " ".join(probe.stderr.split()) or f"exit code {probe.returncode}"
        pytest.skip(f"no read-only mount here: unshare --mount --map-root-user, then mount -o ro, failed ({reason})")
    return folder


def on_read_only_mount(folder: Path, command: list[object]) -> subprocess.CompletedProcess[str]:
    """``command`` run with a read-only tmpfs mounted over ``folder`` (in a mount namespace of its own)."""
    script = 'mount -t tmpfs -o ro tmpfs "$0" && exec "$@"'
    return subprocess.run(["unshare", "--mount", "--map-root-user", "sh", "-c", script, str(folder),
                           *map(str, command)], capture_output=True, text=True, timeout=120)  # fmt: skip


@pytest.mark.parametrize("args", OUTPUTS)
def test_an_output_on_a_read_only_file_system_is_refused_before_loading(read_only_mount: Path,
                                                                        args: list[object]) -> None:  # fmt: skip
    command = [sys.executable, "-m", "care_cli", *[str(a).replace("{dir}", str(read_only_mount)) for a in args]]
    run = on_read_only_mount(read_only_mount, command)
    assert run.returncode == 2 and run.stdout == "", run.stderr
    assert run.stderr.count("\n") == 1 and "is not writable (read-only file system)" in run.stderr, run.stderr


def test_the_app_replaces_no_attribute_of_typer() -> None:
    """Help types come from an option subclass; typer's own classes keep their own methods."""
    import typer.core

    from care_cli.app import CareOption

    assert typer.core.TyperOption.display_type_rich.__module__ == "typer.core"
    assert CareOption.display_type_rich.__module__ == "care_cli.app"
