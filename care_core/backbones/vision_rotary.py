"""The Qwen vision towers' rotary embedding by care's one-pass kernel on CUDA, for the length of a ``with`` block.

transformers' Qwen2.5-VL, Qwen3-VL and Qwen3.5 vision attention modules call their modeling module's
``apply_rotary_pos_emb_vision`` (:data:`ROTARY_FUNCTION`), which makes float32 copies of the queries and keys and
runs several elementwise passes over them: about a fifth of Qwen2.5-VL-7B's tower time on an H200. The kernel
(:mod:`care_core.kernels.vision_rotary`) gives the same bits in one pass (docs/design/backbones.md §Vision rotary).

:func:`fast_vision_rotary` sets that module function to a :class:`FastRotary`, which runs the kernel where it applies
(:func:`~care_core.kernels.dispatch.rotate_vision`) and transformers' own function everywhere else (CPU
tensors, gradients wanted, other shapes, or a kernel that cannot be built here), while any block is open; the last
block to close puts transformers' function back. The function is the modeling module's, shared by every model of
that family in the process: another thread running one meanwhile gets the same bits, only sooner.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from types import ModuleType

import torch
from torch import nn

from ..kernels.dispatch import KernelGate, rotate_vision, why_not_fused

#: the modeling-module function the Qwen vision attention modules call for their rotary embedding
ROTARY_FUNCTION = "apply_rotary_pos_emb_vision"
#: the kernel's name in a :class:`~care_core.kernels.dispatch.KernelGate` (its warning, ``failed``)
ROTARY_KERNEL = "vision rotary"
_PATCHING = threading.Lock()  # guards installing and removing the stand-in (blocks may open in several threads)

Rotary = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class FastRotary:
    """transformers' rotary function's stand-in while blocks are open: the kernel where it applies, else ``original``.

    ``users``: the blocks open on it. ``gate``: its "auto" kernel gate; a kernel that cannot be built here is named in
    ``gate.failed`` with the reason (one warning), and ``original`` runs until the stand-in is removed."""

    def __init__(self, original: Rotary) -> None:
        self.original = original
        self.users = 0
        self.gate = KernelGate("auto")

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate.fused_or(
            ROTARY_KERNEL, lambda: rotate_vision(q, k, cos, sin), lambda: self.original(q, k, cos, sin)
        )


def modeling_module(module: nn.Module) -> ModuleType | None:
    """The Python module that defines ``module``'s class (a tower's modeling file), if it is loaded."""
    return sys.modules.get(type(module).__module__)


@contextlib.contextmanager
def fast_vision_rotary(modeling: ModuleType | None, device: torch.device) -> Iterator[bool]:
    """Inside the block, ``modeling``'s :data:`ROTARY_FUNCTION` is a :class:`FastRotary` where the tower runs on a
    ``device`` the fused kernels may run on (:func:`~care_core.kernels.dispatch.why_not_fused`); elsewhere, or where
    there is no such module function, nothing changes. Yields whether the stand-in is set."""
    if modeling is None or why_not_fused(device) is not None or not callable(getattr(modeling, ROTARY_FUNCTION, None)):
        yield False
        return
    with _PATCHING:
        current = getattr(modeling, ROTARY_FUNCTION)
        stand_in = current if isinstance(current, FastRotary) else FastRotary(current)
        setattr(modeling, ROTARY_FUNCTION, stand_in)
        stand_in.users += 1
    try:
        yield True
    finally:
        with _PATCHING:
            stand_in.users -= 1
            if stand_in.users == 0 and getattr(modeling, ROTARY_FUNCTION, None) is stand_in:
                setattr(modeling, ROTARY_FUNCTION, stand_in.original)
