"""Write a wheel that holds only care's entry points, for a source checkout used through ``PYTHONPATH``.

    python -m scripts.entry_point_wheel OUT_DIR

lmms-eval finds the ``care`` model through the entry point group ``lmms_eval.models``, which exists only where
care-vtr is installed. A machine that runs the checkout from ``PYTHONPATH`` (wheels installed with
``pip install --no-deps --target``) installs this wheel beside the others: it registers the entry points of
``pyproject.toml`` and holds no code, so the checkout's modules are the ones loaded. Needs Python 3.11+ (tomllib).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import zipfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
NAME = "care_vtr_entry_points"


def wheel_files(project: dict) -> dict[str, str]:
    """The wheel's members (path → text): METADATA, WHEEL, entry_points.txt and the RECORD of them."""
    info = f"{NAME}-{project['version']}.dist-info"
    groups = project["entry-points"]
    entry_points = "".join(
        f"[{group}]\n" + "".join(f"{key} = {value}\n" for key, value in points.items()) + "\n"
        for group, points in groups.items()
    )
    files = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {project['version']}\n"
        f"Summary: the entry points of {project['name']} only, for a source checkout on PYTHONPATH\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: scripts.entry_point_wheel\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
        f"{info}/entry_points.txt": entry_points,
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    return files


def write_wheel(out_dir: Path, pyproject: Path = ROOT / "pyproject.toml") -> Path:
    """Write the entry-point wheel of ``pyproject`` into ``out_dir``; return its path."""
    project = tomllib.loads(pyproject.read_text())["project"]
    out_dir.mkdir(parents=True, exist_ok=True)
    wheel = out_dir / f"{NAME}-{project['version']}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for path, text in wheel_files(project).items():
            archive.writestr(path, text)
    return wheel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="folder for the wheel (created if missing)")
    print(write_wheel(parser.parse_args().out_dir))


if __name__ == "__main__":
    main()
