"""The LLaVA towers' encoder (CLIP, SigLIP) run for the features the model reads, with two exact savings.

- **Layers after the deepest one read are not run.** A LLaVA model hands its projector ``hidden_states[l]`` for its
  ``vision_feature_layer`` l (LLaVA-1.5 and LLaVA-NeXT: -2, the input of CLIP-L's 24th and last layer), which no later
  layer touches; transformers runs the whole encoder anyway. :func:`encoder_hidden_states` stops the forward after
  the deepest layer read: a 24th of CLIP-L's time saved, the features unchanged.
- **CLIP's QuickGELU in one pass** on CUDA: :func:`fast_quick_gelus` sets each encoder layer's QuickGELU activation
  to care's kernel (:mod:`care_core.kernels.quick_gelu`, PyTorch's three elementwise kernels bit for bit) for the
  length of a block, and transformers' own where the kernel does not apply (CPU, a gradient wanted, other types) or
  cannot be built (``gate.failed``; one warning).

Both act on the (shared) modules while they run and undo it after, also after an error (:func:`fast_quick_gelus` sets
the activations' ``forward``, :func:`encoder_hidden_states` hooks the layers): not thread-safe, like
:func:`care_core.backbones.aligned_mlp.aligned_gated_mlps`; another thread must not run the same tower meanwhile
(docs/design/backbones.md §Vision encoder).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ..architecture import hidden_state_indices
from ..kernels.dispatch import KernelGate, quick_gelu, why_not_fused
from .module_attrs import instance_forwards
from .probes import (
    FeatureLayer,
    HookScope,
    StopForward,
    clip_encoder_layers,
    first_output,
    run_until_stopped,
)

#: the kernel's name in a :class:`~care_core.kernels.dispatch.KernelGate` (its warning, ``failed``)
QUICK_GELU_KERNEL = "quick GELU"


def encoder_hidden_states(
    tower: nn.Module, pixel_values: torch.Tensor, feature_layer: FeatureLayer, layers: nn.ModuleList | None = None
) -> list[torch.Tensor]:
    """The tower's ``hidden_states[l]`` for the model's ``vision_feature_layer`` (one index or several), its encoder
    stopped once the deepest one is computed: each read from its layer's output by a hook of this call's own, the
    last of which ends the forward. Index 0 (the embeddings) runs the whole tower and reads transformers'
    ``hidden_states``. ``layers``: the tower's encoder layers where the caller has them (else found here). ValueError
    for an index out of range."""
    encoder = clip_encoder_layers(tower) if layers is None else layers
    indices = hidden_state_indices(feature_layer, len(encoder))
    if min(indices) == 0:
        states = tower(pixel_values=pixel_values, output_hidden_states=True, return_dict=True).hidden_states
        return [states[i] for i in indices]
    captured: dict[int, torch.Tensor] = {}
    deepest = max(indices)

    def keeper(index: int) -> Callable[[nn.Module, Any, Any], None]:
        def keep(module: nn.Module, args: Any, output: Any) -> None:
            captured[index] = first_output(output)
            if index == deepest:
                raise StopForward

        return keep

    with HookScope() as hooks:
        for index in set(indices):  # hidden_states[i] is the output of layer i - 1
            hooks.forward_hook(encoder[index - 1], keeper(index))
        if not run_until_stopped(lambda: tower(pixel_values=pixel_values, return_dict=True)):
            raise RuntimeError(f"{type(tower).__name__}'s forward never reached encoder layer {deepest - 1}")
    return [captured[i] for i in indices]


class FastQuickGelu:
    """A QuickGELU activation's ``forward`` while a block is open: the kernel where it applies, else ``original``."""

    def __init__(self, original: Callable[[torch.Tensor], torch.Tensor], gate: KernelGate) -> None:
        self.original = original
        self.gate = gate

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate.fused_or(QUICK_GELU_KERNEL, lambda: quick_gelu(x), lambda: self.original(x))


@contextlib.contextmanager
def fast_quick_gelus(layers: Iterable[nn.Module], device: torch.device, gate: KernelGate) -> Iterator[int]:
    """Inside the block, each of ``layers`` whose MLP's activation is transformers' ``QuickGELUActivation`` runs it as
    a :class:`FastQuickGelu`, where ``device`` (the one the layers run on) may run the fused kernels
    (:func:`~care_core.kernels.dispatch.why_not_fused`); elsewhere nothing changes. ``gate``: the owner's, which
    remembers a kernel that cannot be built. Yields how many activations it set."""
    if why_not_fused(device) is not None:
        yield 0
        return
    from transformers.activations import QuickGELUActivation  # here: this module loads without transformers

    acts = [getattr(getattr(layer, "mlp", None), "activation_fn", None) for layer in layers]
    quick = [act for act in acts if isinstance(act, QuickGELUActivation)]
    with instance_forwards((act, FastQuickGelu(act.forward, gate)) for act in quick) as count:
        yield count
