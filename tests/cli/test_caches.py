"""Nothing care's commands run writes outside CARE_HOME, the output paths given and the temp folder: a fresh HOME,
XDG folders and working directory stay as they were."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import EXAMPLES

ROOT = EXAMPLES.parent
# variables that place a library's files: unset, so that every library falls back to HOME / XDG (or CARE_HOME)
PLACING_PREFIXES = ("HF_", "HUGGINGFACE_", "XDG_", "TRITON_", "LMMS_", "MPL", "MATPLOTLIB", "TORCH", "CARE_",
                    "CUDA_CACHE")  # fmt: skip
COMMANDS = (
    "from care_cli.app import main\n"
    "import sys\n"
    "out = sys.argv[1]\n"
    "for args in (['reduce', 'examples/shapes.png', '--keep', '8', '--out', out + '/r.safetensors'],\n"
    "             ['visualize', 'examples/shapes.png', '--keep', '8', '--out', out + '/v.png'],\n"
    "             ['eval', '--model', 'tiny-llava', '--method', 'random', '--keep', '8', '--limit', '2',\n"
    "              '--tasks', 'examples/tasks/care_shapes_examples', '--output-dir', out + '/eval']):\n"
    "    assert main(args) == 0, args\n"
)


def _paths(root: Path) -> set[Path]:
    return set(root.rglob("*"))


def test_reduce_visualize_and_eval_write_nothing_outside_care_home_the_outputs_and_temp(tmp_path: Path) -> None:
    pytest.importorskip("lmms_eval")
    home, xdg, work, care_home, temp, out = (tmp_path / name for name in ("home", "xdg", "work", "care", "tmp", "out"))
    folders = {"XDG_CACHE_HOME": xdg / "cache", "XDG_CONFIG_HOME": xdg / "config", "XDG_DATA_HOME": xdg / "data",
               "XDG_STATE_HOME": xdg / "state"}  # fmt: skip
    for folder in (home, work, temp, out, *folders.values()):
        folder.mkdir(parents=True)
    (work / "examples").symlink_to(EXAMPLES)  # relative paths, as in the README, from a working directory of its own
    env = {k: v for k, v in os.environ.items() if not k.startswith(PLACING_PREFIXES) and k not in ("HOME", "TMPDIR")}
    env.update({name: str(path) for name, path in folders.items()})
    env.update(HOME=str(home), CARE_HOME=str(care_home), TMPDIR=str(temp), PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    watched = (home, xdg, work)
    before = {root: _paths(root) for root in watched}
    proc = subprocess.run([sys.executable, "-c", COMMANDS, str(out)], cwd=work, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    for root in watched:
        assert sorted(_paths(root) - before[root]) == [], f"written outside CARE_HOME, the outputs and temp: {root}"
    assert (care_home / "huggingface" / "datasets").is_dir()  # care eval's task data, prepared under CARE_HOME
    assert (care_home / "matplotlib").is_dir()  # matplotlib's font list (care visualize)
    assert {p.name for p in out.iterdir()} == {"r.safetensors", "v.png", "eval"}
