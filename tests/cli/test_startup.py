"""Start-up stays light: no torch or transformers for help, version, methods, flops, or a user's mistake."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import EXAMPLES

PROBE = (
    "import sys\n"
    "from care_cli.app import main\n"
    "code = main(sys.argv[1:])\n"
    "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
    "print('HEAVY=' + ','.join(heavy), file=sys.stderr)\n"
    "raise SystemExit(code)\n"
)


def heavy_imports(*args: str) -> tuple[int, list[str]]:
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=120)
    line = [x for x in proc.stderr.splitlines() if x.startswith("HEAVY=")][-1]
    return proc.returncode, [m for m in line.removeprefix("HEAVY=").split(",") if m]


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["--help"], 0),
        (["--version"], 0),
        (["methods"], 0),
        (["methods", "--json"], 0),
        (["flops", "--backbone", "llava-next"], 0),
        (["flops", "--backbone", "qwen2.5-vl", "--method", "all", "--keep", "160", "--json"], 0),
        (["reduce", "--help"], 0),
        (["reduce", str(EXAMPLES / "no-such.jpg"), "--keep", "8"], 2),
        (["reduce", str(EXAMPLES / "astronaut.jpg"), "--ratio", "2"], 2),
        (["reduce", str(EXAMPLES / "astronaut.jpg"), "--keep", "8", "--theta-c", "2"], 2),
        (["csr", str(EXAMPLES / "astronaut.jpg"), "-q", "x", "--keep", "8", "--method", "carre"], 2),
        (["visualize", str(EXAMPLES / "astronaut.jpg"), "--keep", "8"], 2),
        (["reduce", str(EXAMPLES / "astronaut.jpg"), "--keep", "8", "--keep", "9"], 2),
        (["eval", "--tasks", str(EXAMPLES / "tasks" / "nope"), "--keep", "8"], 2),  # before lmms-eval (torch)
    ],
)
def test_no_heavy_import(args: list[str], code: int) -> None:
    returned, heavy = heavy_imports(*args)
    assert returned == code
    assert heavy == [], f"care {' '.join(args)} imported {heavy}"
