"""Test-wide setup: an isolated CARE_HOME (never the user's cache) and the in-process `care` runner."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from care_cli.app import main


def pytest_configure(config: pytest.Config) -> None:
    """Under xdist, each worker's torch (and every process it starts) gets its share of the cores, not all of them:
    two workers of two threads each on 2 cores spin-wait on each other, and a test that takes 14 s so takes 66 s
    (measured: two tiny Qwen3-VL training runs side by side). An OMP_NUM_THREADS already set is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 0:
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))


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


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread for a module's tiny models, restored afterwards: they gain nothing from threads, and on a
    busy 2-core box the threads' spin-waits cost 4-5x the work itself (a 170x64 linear: 8 ms with 2 threads vs 0.1
    ms with 1). Modules ask for it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch  # here, not at the top: the CLI tests that need no torch keep this module light

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@dataclass
class Run:
    """Exit code and captured output of one in-process `care` call (through `main`, as the console script)."""

    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


@pytest.fixture
def care(capsys: pytest.CaptureFixture[str]) -> Callable[..., Run]:
    def run(*args: object) -> Run:
        capsys.readouterr()
        code = main([str(a) for a in args])
        captured = capsys.readouterr()
        return Run(code, captured.out, captured.err)

    return run


@pytest.fixture
def batch_size_parses(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every value ``care_core.batch_sizes.parse_batch_size`` is called with during the test, under each name a module
    holds it by (the batching module's own, the CLI commands', lmms-eval's entry)."""
    from care_cli.commands import csr, eval
    from care_core import batch_sizes
    from care_core.integrations import settings

    parsed: list[object] = []
    parse = batch_sizes.parse_batch_size

    def counted(value: object, **kwargs: Any) -> Any:
        parsed.append(value)
        return parse(value, **kwargs)

    monkeypatch.setattr(batch_sizes, "parse_batch_size", counted)
    for owner in (csr, eval, settings):
        monkeypatch.setattr(owner, "parse_batch_size", counted, raising=False)
    return parsed
