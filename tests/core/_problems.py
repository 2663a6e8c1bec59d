"""Shared, seeded problem generators for the core-vs-reference tests (no care_core imports)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageDraw
from torch import nn


@dataclass
class Problem:
    V: np.ndarray  # (N, d_v) float64
    P: np.ndarray  # (N, 2) float64 in [0, 1]^2
    W1: np.ndarray  # (d_h, d_v)
    b1: np.ndarray  # (d_h,)
    W2: np.ndarray  # (d_t, d_h)
    b2: np.ndarray  # (d_t,)

    @property
    def N(self) -> int:
        return self.V.shape[0]

    @property
    def d_v(self) -> int:
        return self.V.shape[1]

    def projector(self, dtype=torch.float64) -> nn.Module:
        """The same MLP as torch.nn: Linear -> GELU (exact erf) -> Linear."""
        d_h, d_v = self.W1.shape
        d_t = self.W2.shape[0]
        mod = nn.Sequential(nn.Linear(d_v, d_h), nn.GELU(), nn.Linear(d_h, d_t)).to(dtype)
        with torch.no_grad():
            mod[0].weight.copy_(torch.from_numpy(self.W1))
            mod[0].bias.copy_(torch.from_numpy(self.b1))
            mod[2].weight.copy_(torch.from_numpy(self.W2))
            mod[2].bias.copy_(torch.from_numpy(self.b2))
        mod.eval()
        for p in mod.parameters():
            p.requires_grad_(False)
        return mod

    def features(self, dtype=torch.float64) -> torch.Tensor:
        return torch.from_numpy(self.V.copy()).to(dtype)

    def positions(self, dtype=torch.float64) -> torch.Tensor:
        return torch.from_numpy(self.P.copy()).to(dtype)

    def weights(self):
        return self.W1, self.b1, self.W2, self.b2


def make_problem(
    seed: int,
    N: int,
    d_v: int,
    clustered: bool,
    *,
    noise: float = 0.15,
    d_h: int | None = None,
    d_t: int | None = None,
) -> Problem:
    """Random features (Gaussian blobs around 2-6 centres, or i.i.d. N(0, 1)), uniform
    positions in [0, 1]^2, and a GELU MLP whose pre-activations are O(1) (entries of V are
    O(1), W1 ~ N(0, 1/d_v), b1 ~ N(0, 0.25)), so GELU is far from its linear regime."""
    rng = np.random.default_rng(seed)
    if clustered:
        k = int(rng.integers(2, 7))
        centres = rng.normal(size=(k, d_v))
        labels = rng.integers(0, k, size=N)
        V = centres[labels] + noise * rng.normal(size=(N, d_v))
    else:
        V = rng.normal(size=(N, d_v))
    P = rng.uniform(size=(N, 2))
    d_h = d_h or 2 * d_v
    d_t = d_t or d_v + 8
    W1 = rng.normal(size=(d_h, d_v)) / math.sqrt(d_v)
    b1 = 0.5 * rng.normal(size=d_h)
    W2 = rng.normal(size=(d_t, d_h)) / math.sqrt(d_h)
    b2 = 0.1 * rng.normal(size=d_t)
    return Problem(V, P, W1, b1, W2, b2)


def random_directions(seed: int, m: int, d_v: int) -> np.ndarray:
    """Explicit unit directions (independent of the default recipe)."""
    rng = np.random.default_rng(10_000 + seed)
    U = rng.normal(size=(m, d_v))
    return U / np.linalg.norm(U, axis=1, keepdims=True)


def recipe_directions(m: int, d_v: int, seed: int) -> torch.Tensor:
    """The default-direction recipe of docs/design/care.md §Directions, written out here for the comparison test."""
    g = torch.randn(m, d_v, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return g / g.norm(dim=1, keepdim=True)


def to_np(t) -> np.ndarray:
    return t.detach().cpu().numpy()


def scene_image(size: tuple[int, int]) -> Image.Image:
    """A colour gradient with a red disc and a blue box (CaRe accepts calibration signals on it; on noise it may
    accept none)."""
    w, h = size
    ramp_x, ramp_y = torch.linspace(0, 255, w).expand(h, w), torch.linspace(0, 255, h)[:, None].expand(h, w)
    pixels = torch.stack([ramp_x, ramp_y, torch.full((h, w), 128.0)], dim=-1).to(torch.uint8)
    image = Image.fromarray(pixels.numpy())
    draw = ImageDraw.Draw(image)
    draw.ellipse((w // 5, h // 5, w // 2, h // 2), fill=(230, 20, 20))
    draw.rectangle((w // 2, h // 2, 4 * w // 5, 9 * h // 10), fill=(20, 20, 230))
    return image
