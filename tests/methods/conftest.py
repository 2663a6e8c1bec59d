"""Random method inputs with every probe synthesised, shared by the registry-driven tests; golden-file paths."""

from __future__ import annotations

import functools
import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from care_core.methods import MethodInputs


@dataclass
class FakeLanguageModel:
    """Random but valid softmax attentions over [prefix, N image tokens, text tokens]."""

    num_image: int
    prefix: int = 5
    text: int = 9
    heads: int = 4
    layers: int = 4
    d_t: int = 24
    seed: int = 0

    def __post_init__(self) -> None:
        g = torch.Generator().manual_seed(self.seed)
        length = self.prefix + self.num_image + self.text
        causal = torch.ones(length, length).tril().bool()
        self._attn = []
        for _ in range(self.layers):
            logits = torch.randn(self.heads, length, length, generator=g) * 2
            self._attn.append(torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1))
        self._embeds = torch.randn(length, self.d_t, generator=g)

    def attentions(self, upto_layer: int) -> list[torch.Tensor]:
        return self._attn[: upto_layer + 1]

    @property
    def image_span(self) -> tuple[int, int]:
        return self.prefix, self.prefix + self.num_image

    @property
    def text_span(self) -> tuple[int, int]:
        end = self.prefix + self.num_image
        return end, end + self.text

    def input_embeddings(self) -> torch.Tensor:
        return self._embeds


def make_inputs(
    n: int = 144, d_v: int = 16, seed: int = 0, *, duplicates: bool = False, zeros: bool = False
) -> MethodInputs:
    """N = rows x cols tokens on a grid, with every probe of care_core.vocabulary.PROBES."""
    g = torch.Generator().manual_seed(seed)
    side = round(n**0.5)
    grid = (side, n // side) if side * (n // side) == n else None
    features = torch.randn(n, d_v, generator=g)
    if duplicates:
        features[n // 2 :] = features[: n - n // 2]
    if zeros:
        features[:: max(1, n // 7)] = 0
    projector = torch.nn.Sequential(torch.nn.Linear(d_v, 32), torch.nn.GELU(), torch.nn.Linear(32, 24))
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        projector = torch.nn.Sequential(torch.nn.Linear(d_v, 32), torch.nn.GELU(), torch.nn.Linear(32, 24))
    if grid is not None:
        rows, cols = grid
        r = (torch.arange(n) // cols + 0.5) / rows
        c = (torch.arange(n) % cols + 0.5) / cols
        positions = torch.stack([r, c], dim=1)
    else:
        positions = torch.rand(n, 2, generator=g)
    heads, d_head = 4, 8
    cls = torch.randn(1, d_v, generator=g)
    logits = torch.randn(1 + n, 1 + n, generator=g) * 2
    probes = {
        "cls_attention": torch.softmax(torch.randn(heads, 1 + n, generator=g) * 3, dim=-1),
        "attention_logits": logits,
        "keys": torch.randn(1 + n, d_head, generator=g),
        "hidden_with_cls": torch.cat([cls, features]),
        "last_layer_qk": torch.randn(2, 1 + n, d_v, generator=g),
        "question": torch.randn(6, 24, generator=g),
        "language_model": FakeLanguageModel(num_image=n, seed=seed),
    }
    return MethodInputs(features, projector, positions, grid=grid, probes=probes, seed=seed)


@pytest.fixture
def inputs() -> MethodInputs:
    return make_inputs()


# ----------------------------------------------------------------------------- golden files
# Outputs of the peer methods' official code, stored in the repository (tests/data/golden/README.md says what each
# array is). Tests name their files explicitly: a missing file is a failure, never a skip or an empty
# parametrisation.
GOLDEN_DIR = Path(__file__).resolve().parents[1] / "data" / "golden"
SCRIPTS_DIR = Path(__file__).resolve().parents[2] / "scripts"
GOLDEN_FILES: dict[str, tuple[str, ...]] = {
    "visionzip": ("visionzip_n64_d32.npz", "visionzip_e2e_tinyclip.npz"),
    "divprune": ("divprune_n64_d32.npz", "divprune_dup_n16_d32.npz"),
    "tome": ("tome_single_n577_d256.npz", "tome_chain_n64_d32.npz", "tome_chain_n576_d1024.npz"),
    "prumerge": ("prumerge_n576_d256.npz",),
    "ficoco_v": ("ficoco_v_n577_d256.npz",),
    "sparsevlm": ("sparsevlm_select_n576.npz", "sparsevlm_cluster_n83_d1024.npz"),
    "zooprune": ("zooprune_sads_n64_d32.npz", "zooprune_sads_constimp_n64_d32.npz"),
}


def golden_path(name: str) -> Path:
    """tests/data/golden/<name>, failing the test (not skipping it) when the file is absent."""
    path = GOLDEN_DIR / name
    if not path.is_file():
        pytest.fail(f"golden file missing: {path} (tests/data/golden/README.md lists them)", pytrace=False)
    return path


def load_golden(name: str) -> dict[str, np.ndarray]:
    with np.load(golden_path(name)) as npz:
        return {key: npz[key] for key in npz.files}


@functools.lru_cache(maxsize=1)
def check_golden_script() -> ModuleType:
    """scripts/check_golden.py as a module (it imports scripts.golden_checks from the repository root)."""
    spec = importlib.util.spec_from_file_location("check_golden", SCRIPTS_DIR / "check_golden.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def golden_checker(module: str) -> ModuleType:
    """One checker of scripts/golden_checks (e.g. "visionzip"), for tests that call its functions directly."""
    check_golden_script()
    return importlib.import_module(f"scripts.golden_checks.{module}")


def assert_golden_passes(name: str) -> None:
    """Every case of one golden file passes our port (the same check as scripts/check_golden.py)."""
    results = check_golden_script().check_file(golden_path(name))
    failed = [r for r in results if not r.passed]
    assert results, f"{name}: the checker produced no cases"
    assert not failed, f"{name}: " + "; ".join(f"{r.case}: {r.max_diff:.3g} {r.note}" for r in failed)
