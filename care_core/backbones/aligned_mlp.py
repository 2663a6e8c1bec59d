"""Gated MLPs whose hidden width breaks cuBLAS's row alignment, run with that width zero-padded on CUDA.

Qwen2.5-VL's vision blocks have a gated MLP (``gate_proj``, ``up_proj``: 1280 -> 3420; ``down_proj``: 3420 -> 1280).
A bf16 row of 3,420 values is 6,840 bytes, not a multiple of 16, and cuBLAS then leaves its Hopper kernels for
older ones: on an H200 each of the three products took 2.8-3.4 ms instead of 1.0 ms at 82,944 rows (16 images of
1008 px), and the MLP 9.6 instead of 3.9 ms with the padding below done on every call (docs/design/backbones.md
§Aligned vision MLP).

Padded to the next aligned width, the maths is the same: the extra gate and up rows (weights and biases zero) give
``act(0) * 0 = 0`` for any finite activation, and the extra down columns multiply those zeros, so every output is the
unpadded sum plus exact zeros (equal in float64; in bf16 the products' kernels round differently, by an ulp).
:func:`aligned_gated_mlps` runs a module's misaligned gated MLPs this way for the length of a ``with`` block, on
CUDA only; the weights are padded per call (a few megabytes a layer), so the model is never changed or copied.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .module_attrs import instance_forwards, optional_tensor_attr, submodule, tensor_attr

#: bytes a matrix row must be a multiple of for cuBLAS's fastest (Hopper TMA) kernels
ROW_ALIGNMENT_BYTES = 16
#: the parts of a gated MLP: ``down(act(gate(x)) * up(x))``
GATED_PARTS = ("gate_proj", "up_proj", "down_proj")


def _is_gated_mlp(module: nn.Module) -> bool:
    return all(isinstance(getattr(module, name, None), nn.Linear) for name in GATED_PARTS) and callable(
        getattr(module, "act_fn", None)
    )


def alignment_padding(mlp: nn.Module) -> int:
    """How many hidden units bring a gated MLP's hidden width to a multiple of :data:`ROW_ALIGNMENT_BYTES` bytes of its
    weights' type (0: aligned already)."""
    weight = tensor_attr(submodule(mlp, "gate_proj"), "weight")
    per_row = max(1, ROW_ALIGNMENT_BYTES // weight.element_size())
    return (-int(weight.shape[0])) % per_row


def padded_gated_mlp(mlp: nn.Module, hidden: torch.Tensor, padding: int) -> torch.Tensor:
    """``mlp(hidden)`` (``down(act(gate(x)) * up(x))``) with the hidden width grown by ``padding`` zero units: the same
    sums plus exact zeros (see the module's docstring)."""
    gate, up, down = (submodule(mlp, name) for name in GATED_PARTS)

    def grown(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        weight, bias = tensor_attr(linear, "weight"), optional_tensor_attr(linear, "bias")
        return F.pad(weight, (0, 0, 0, padding)), None if bias is None else F.pad(bias, (0, padding))

    act: Any = mlp.act_fn
    wide = act(F.linear(hidden, *grown(gate))) * F.linear(hidden, *grown(up))
    return F.linear(wide, F.pad(tensor_attr(down, "weight"), (0, padding)), optional_tensor_attr(down, "bias"))


#: a module's misaligned gated MLPs with their paddings (:func:`misaligned_gated_mlps`), per weight type; kept by the
#: module's owner (an adapter), so the module is searched once and not on every call
MisalignedMlps = dict[torch.dtype, tuple[tuple[nn.Module, int], ...]]


def misaligned_gated_mlps(module: nn.Module) -> tuple[tuple[nn.Module, int], ...]:
    """(MLP, padding) for every gated MLP in ``module`` whose hidden width is misaligned (:func:`alignment_padding`)."""
    gated = (mlp for mlp in module.modules() if _is_gated_mlp(mlp))
    return tuple((mlp, padding) for mlp in gated if (padding := alignment_padding(mlp)))


@contextlib.contextmanager
def aligned_gated_mlps(module: nn.Module, device: torch.device, found: MisalignedMlps | None = None) -> Iterator[int]:
    """Inside the block, every gated MLP in ``module`` whose hidden width is misaligned (:func:`alignment_padding`)
    runs :func:`padded_gated_mlp`, where ``device`` (the one ``module`` runs on) is CUDA; elsewhere nothing changes.
    ``found``: the owner's record of the search (filled on first use per weight type). Yields how many MLPs it set.
    Each one's own ``forward`` is back on exit. Not thread-safe: the setting lives on the (shared) modules while the
    block runs."""
    if device.type != "cuda":
        yield 0
        return
    found = {} if found is None else found
    dtype = next(module.parameters()).dtype
    if dtype not in found:
        found[dtype] = misaligned_gated_mlps(module)
    padded = ((mlp, functools.partial(padded_gated_mlp, mlp, padding=padding)) for mlp, padding in found[dtype])
    with instance_forwards(padded) as count:
        yield count
