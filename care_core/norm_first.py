"""Norm-first projectors, M(v) = W2 act(W1 concat_b norm(v_b) + b1) + b2, and their exact directional derivative.

A token row v is ``blocks`` equal blocks v_b of p features (the Qwen mergers: 4 patches, each normalised on its own;
InternVL3: one block, the whole row). The norm of a block is LayerNorm, y = g x̂ + β with x̂ = (x - mean x) / s,
s = sqrt(var x + eps), or RMSNorm, y = g x̂ with x̂ = x / s, s = sqrt(mean x² + eps). Its derivative along t is exact
with eps included:

    J t = (g / s) ⊙ (t̃ - x̂ ⟨x̂, t̃⟩ / p),   t̃ = t - mean(t) (LayerNorm), t̃ = t (RMSNorm).

So the first layer's tangent, W1 J(v_i) u_j = Σ_b (1 / s_ib) [W1_b (g ⊙ t̃_jb) - (⟨x̂_ib, t̃_jb⟩ / p) W1_b (g ⊙ x̂_ib)],
needs W1 once per direction (shared by every token), the forward's per-block products once per token and one
(N, m) inner product per block: :func:`first_layer_tangents`. PRCA's jvp engine (paper Eq. 1, ``||J_M(v_i) u_j||``)
then applies act' and the second layer (``care_core.scoring``).

:class:`NormFirstMLP` describes such a projector. Projector modules may describe themselves through a method
``norm_first_mlp()`` (the Qwen mergers in ``care_core.backbones`` do: the core never imports the backbones);
:func:`describe` also reads transformers' InternVL projector and ``nn.Sequential(norm, Linear, act, Linear)`` with
``nn.LayerNorm`` or ``nn.RMSNorm`` by structure. A description must reproduce the module's forward exactly.

A norm-then-linear projector, M(v) = W norm(v) + b (Gemma 3's: RMSNorm, then one map), is the same first layer with
nothing after it: its exact tangent W J(v_i) u_j is :func:`first_layer_tangents` itself, whose norm is PRCA's
response. :class:`NormLinear` describes one (a module's own ``norm_linear()``, or ``nn.Sequential(norm, Linear)``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

NormKind = Literal["layer", "rms"]
#: the method a projector module may implement to describe itself (returns a NormFirstMLP or None)
DESCRIBE_METHOD = "norm_first_mlp"
#: the method a norm-then-linear projector module may implement to describe itself (returns a NormLinear or None)
DESCRIBE_LINEAR_METHOD = "norm_linear"
# transformers' LayerNorm + MLP projector classes whose forward is layer_norm -> linear_1 -> act -> linear_2
_LAYER_NORM_PROJECTORS = ("InternVLMultiModalProjector",)


@dataclass(frozen=True)
class NormFirstMLP:
    """M(v) = second(act(first(concat_b [gamma ⊙ x̂_b + beta]))): what the fast jvp path needs of the projector.

    ``gamma``: the effective scale (p,) the module multiplies by (e.g. ``1 + w`` where its forward does that), None
    for none; ``beta``: the shift (p,) or None; ``eps``: None for the input dtype's machine epsilon (``nn.RMSNorm``'s
    default); ``blocks``: blocks per row, each normalised on its own; ``upcast``: the module computes the statistics
    in at least float32 and casts x̂ back to the input dtype (Qwen2.5-VL's RMSNorm), else in the input dtype.
    """

    kind: NormKind
    gamma: torch.Tensor | None
    beta: torch.Tensor | None
    eps: float | None
    blocks: int
    first: nn.Linear
    act: Callable[[torch.Tensor], torch.Tensor]
    second: nn.Linear
    upcast: bool = False

    @property
    def width(self) -> int:
        """p: the features of one block (the norm's width)."""
        return self.first.in_features // self.blocks

    def consistent(self) -> bool:
        """Whether the shapes fit: W1 takes ``blocks`` blocks of p, gamma and beta have p entries."""
        p = self.width
        fits = self.blocks >= 1 and p * self.blocks == self.first.in_features
        fits = fits and self.second.in_features == self.first.out_features
        return fits and all(t is None or tuple(t.shape) == (p,) for t in (self.gamma, self.beta))


@dataclass(frozen=True)
class NormLinear:
    """M(v) = W (gamma ⊙ x̂ + beta) + b over the whole row (one block): a norm then one linear map, nothing after it.

    ``weight`` (d_out, d_in), in ``nn.Linear``'s layout (a transposed view of a (d_in, d_out) matmul weight will do);
    ``bias`` (d_out,) or None; ``kind``, ``gamma``, ``beta``, ``eps``, ``upcast``: as for :class:`NormFirstMLP`.
    """

    kind: NormKind
    gamma: torch.Tensor | None
    beta: torch.Tensor | None
    eps: float | None
    weight: torch.Tensor
    bias: torch.Tensor | None = None
    upcast: bool = False

    @property
    def blocks(self) -> int:
        """1: the norm runs over the whole row (what the first-layer helpers read)."""
        return 1

    @property
    def width(self) -> int:
        """p: the norm's width, d_in."""
        return int(self.weight.shape[1])

    @property
    def out_features(self) -> int:
        """d_out: the map's output width."""
        return int(self.weight.shape[0])

    def consistent(self) -> bool:
        """Whether the shapes fit: a 2-D weight, gamma, beta of d_in entries and a bias of d_out."""
        if self.weight.dim() != 2:
            return False
        widths = [(self.gamma, self.width), (self.beta, self.width), (self.bias, self.out_features)]
        return all(t is None or tuple(t.shape) == (size,) for t, size in widths)


def _norm_fields(
    norm: nn.Module, width: int
) -> tuple[NormKind, torch.Tensor | None, torch.Tensor | None, float | None]:
    """(kind, gamma, beta, eps) of exactly ``nn.LayerNorm`` or ``nn.RMSNorm`` over the last dimension of ``width``
    (a subclass may compute something else); raises LookupError for any other norm."""
    shape: tuple[int, ...] = tuple(getattr(norm, "normalized_shape", ()))
    if shape != (width,):
        raise LookupError("not a norm over the last dimension of this width")
    if type(norm) is nn.LayerNorm:
        return "layer", norm.weight, norm.bias, norm.eps
    if type(norm) is nn.RMSNorm:
        return "rms", norm.weight, None, norm.eps
    raise LookupError("neither nn.LayerNorm nor nn.RMSNorm")


def from_modules(
    norm: nn.Module, first: nn.Module, act: Callable[[torch.Tensor], torch.Tensor], second: nn.Module
) -> NormFirstMLP | None:
    """norm -> first -> act -> second, for a norm of exactly ``nn.LayerNorm`` or ``nn.RMSNorm`` over the last
    dimension (a subclass may compute something else) and two ``nn.Linear``; else None."""
    if not (isinstance(first, nn.Linear) and isinstance(second, nn.Linear)):
        return None
    try:
        kind, gamma, beta, eps = _norm_fields(norm, first.in_features)
    except LookupError:
        return None
    return NormFirstMLP(kind, gamma, beta, eps, 1, first, act, second)


def linear_from_modules(norm: nn.Module, linear: nn.Module) -> NormLinear | None:
    """norm -> linear, for a norm of exactly ``nn.LayerNorm`` or ``nn.RMSNorm`` over the last dimension and one
    ``nn.Linear``; else None."""
    if not isinstance(linear, nn.Linear):
        return None
    try:
        kind, gamma, beta, eps = _norm_fields(norm, linear.in_features)
    except LookupError:
        return None
    return NormLinear(kind, gamma, beta, eps, linear.weight, linear.bias)


def describe(projector: object) -> NormFirstMLP | None:
    """The projector as a :class:`NormFirstMLP` (its own ``norm_first_mlp()``, transformers' InternVL projector, or a
    4-module ``nn.Sequential``), or None; shapes checked, the activation not (the scorer checks it)."""
    if not isinstance(projector, nn.Module):
        return None
    own = getattr(projector, DESCRIBE_METHOD, None)
    if callable(own):
        found = own()
    elif type(projector).__name__ in _LAYER_NORM_PROJECTORS:
        p = projector
        found = from_modules(p.layer_norm, p.linear_1, p.act, p.linear_2)  # type: ignore[arg-type]
    elif isinstance(projector, nn.Sequential) and len(projector) == 4:
        found = from_modules(*projector)
    else:
        return None
    return found if isinstance(found, NormFirstMLP) and found.consistent() else None


def describe_linear(projector: object) -> NormLinear | None:
    """The projector as a :class:`NormLinear` (its own ``norm_linear()``, or a 2-module ``nn.Sequential`` of a norm
    and an ``nn.Linear``), or None; shapes checked."""
    if not isinstance(projector, nn.Module):
        return None
    own = getattr(projector, DESCRIBE_LINEAR_METHOD, None)
    if callable(own):
        found = own()
    elif isinstance(projector, nn.Sequential) and len(projector) == 2:
        found = linear_from_modules(*projector)
    else:
        return None
    return found if isinstance(found, NormLinear) and found.consistent() else None


def normalized_blocks(desc: NormFirstMLP | NormLinear, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x̂ (N, blocks, p) and 1 / s (N, blocks) of every token's blocks, in the features' dtype, computed as the
    module computes them (``upcast``: statistics in at least float32)."""
    n = features.shape[0]
    x = features.reshape(n, desc.blocks, desc.width)
    work = x.to(torch.promote_types(x.dtype, torch.float32)) if desc.upcast else x
    eps = desc.eps if desc.eps is not None else torch.finfo(features.dtype).eps
    centred = work - work.mean(-1, keepdim=True) if desc.kind == "layer" else work
    inverse = torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps)
    return (centred * inverse).to(x.dtype), inverse.squeeze(-1).to(x.dtype)


def centred_blocks(desc: NormFirstMLP | NormLinear, directions: torch.Tensor) -> torch.Tensor:
    """t̃ (m, blocks, p): each direction's blocks less their mean (LayerNorm), or as they are (RMSNorm)."""
    t = directions.reshape(directions.shape[0], desc.blocks, desc.width)
    return t - t.mean(-1, keepdim=True) if desc.kind == "layer" else t


@dataclass(frozen=True)
class FirstLayer:
    """What :func:`first_layer_tangents` reuses for every chunk of directions.

    ``pre`` (N, d_h): W1 norm(v_i) + b1, the forward's pre-activation; ``partial`` (blocks, N, d_h): W1_b (g ⊙ x̂_ib);
    ``lifted`` (blocks, m, d_h): W1_b (g ⊙ t̃_jb), shared by all tokens; ``coef`` (blocks, N, m):
    ⟨x̂_ib, t̃_jb⟩ / (p s_ib); ``inverse`` (N, blocks): 1 / s_ib.
    """

    pre: torch.Tensor
    partial: torch.Tensor
    lifted: torch.Tensor
    coef: torch.Tensor
    inverse: torch.Tensor


def _linear_of(desc: NormFirstMLP | NormLinear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight (d_h, d_in), bias or None) of the map after the norm: the MLP's first layer, or the one map."""
    if isinstance(desc, NormFirstMLP):
        return desc.first.weight, desc.first.bias
    return desc.weight, desc.bias


def first_layer(desc: NormFirstMLP | NormLinear, features: torch.Tensor, directions: torch.Tensor) -> FirstLayer:
    """The per-token and per-direction products of the first layer (N d_in d_h + m d_in d_h + N m d_in
    multiply-adds; plus d_in d_h for W1 beta where the norm shifts); nothing of size (m, N, d_in). For a
    :class:`NormLinear` the first layer is its one map (d_h = d_out)."""
    xhat, inverse = normalized_blocks(desc, features)
    weight, bias = _linear_of(desc)
    d_h, blocks, p = weight.shape[0], desc.blocks, desc.width
    scaled = weight.reshape(d_h, blocks, p)
    if desc.gamma is not None:
        scaled = scaled * desc.gamma  # W1_b diag(g): the scale folded into the weight once
    right = scaled.permute(1, 2, 0)  # (blocks, p, d_h)
    partial = torch.matmul(xhat.transpose(0, 1), right)  # (blocks, N, d_h)
    t = centred_blocks(desc, directions)
    lifted = torch.matmul(t.transpose(0, 1), right)  # (blocks, m, d_h)
    coef = torch.matmul(xhat.transpose(0, 1), t.permute(1, 2, 0))  # (blocks, N, m): <x̂_ib, t̃_jb>
    coef *= inverse.T[:, :, None] / p
    pre = partial.sum(0)
    if desc.beta is not None:  # W1 (beta per block) + b1: a constant row
        pre += nn.functional.linear(desc.beta.repeat(blocks)[None], weight, bias)
    elif bias is not None:
        pre += bias
    return FirstLayer(pre, partial, lifted, coef, inverse)


def first_layer_tangents(prepared: FirstLayer, start: int, stop: int) -> torch.Tensor:
    """W1 J(v_i) u_j for directions start..stop-1 and every token: (N, c, d_h), token-major.

    Σ_b (1 / s_ib) W1_b (g ⊙ t̃_jb) is one (N, blocks) x (blocks, c d_h) product; Σ_b coef_ibj W1_b (g ⊙ x̂_ib) one
    batched (c, blocks) x (blocks, d_h) product per token, subtracted from it: 4 c N blocks d_h FLOPs in all.
    """
    lifted = prepared.lifted[:, start:stop]
    blocks, c, d_h = lifted.shape
    n = prepared.inverse.shape[0]
    shared = torch.matmul(prepared.inverse, lifted.reshape(blocks, c * d_h)).view(n, c, d_h)
    weights = prepared.coef[:, :, start:stop].permute(1, 2, 0)  # (N, c, blocks)
    # out= the input: in place (no second (N, c, d_h) buffer), and still the op FLOP counters see
    return torch.baddbmm(shared, weights, prepared.partial.transpose(0, 1), alpha=-1, out=shared)
