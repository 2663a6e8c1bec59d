"""The static loop's decoder layer as a short run of tensor ops over the layer's own weights.

transformers' decoder layers spend about 42 kernels a layer on a forward: each RMSNorm takes eight (upcast, square,
mean, add, rsqrt, multiply, downcast, scale), the rotary embedding ten, the MLP six. At the ~100-250 rows a reduced
prompt has, those small kernels, not the weights' bytes, set the prefill's time even when replayed from a CUDA
graph, and without graphs their launches from Python do. :func:`layer_forward` computes the same layer:

    h' = h + W_o attn(rope(W_q n1(h)), rope(W_k n1(h)), W_v n1(h))
    out = h' + W_down(silu(W_gate n2(h')) ⊙ W_up n2(h'))

with n1, n2 the layer's RMSNorms (and Qwen3's per-head q/k norms before the rotation), in two pure pieces around the
attention: :func:`attention_inputs` (norm, projections, rotation) and :func:`mlp_block` (output projection,
residuals, norm, MLP). In the steps a CUDA graph captures, where Triton runs
(:func:`care_core.kernels.dispatch.why_not_fused`), each piece is compiled once per process with ``torch.compile``
(batch and rows symbolic: one compiled piece serves every batch and prompt length), which fuses the norms, the
rotation and the gated activation into a few kernels; eager steps and the CPU run the pieces as written
(:class:`LeanLayers` says why).
A prefill's keys and values are written to the cache inside :func:`attention_inputs` (in a compiled piece, by the
rotation's kernel); a decode step's cache writes and the attention (``F.scaled_dot_product_attention``, causal over
a fresh prompt or with the decode step's additive mask) run between the pieces as plain ops.

The maths is the module's; the order of float roundings is not (one fused RMSNorm instead of upcast, normalise,
downcast, scale; ``x cos + roll(x) sin±`` for ``x cos + rotate_half(x) sin``), so in bfloat16 a hidden state may
differ from transformers' in its last bits. :func:`layer_reason` says where a layer is not of this form.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.dispatch import why_not_fused
from .module_attrs import float_attr, optional_tensor_attr, submodule, tensor_attr

#: transformers' RMSNorm classes whose forward is weight * (x.float() * rsqrt(mean(x²) + eps)).to(x.dtype)
RMS_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen2_5_VLRMSNorm", "Qwen3VLTextRMSNorm"})
# compiled variants each piece may have in a process (dynamo's default is 8): per model, batch 1 or more times prefill
# or decode, and a few models in one process (a benchmark, a test session) each add theirs; past the limit dynamo
# would run the piece uncompiled without a word
RECOMPILE_LIMIT = 64

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def compile_settings() -> AbstractContextManager[None]:
    """dynamo's settings while the pieces run: :data:`RECOMPILE_LIMIT`, and no automatic dynamic shapes. With them, a
    process that compiled the pieces for one model recompiled them for a second model of other widths with every
    width that changed symbolic, and Inductor's kernels then divide by runtime widths in their index arithmetic and
    load without vectors: on an H200, Qwen2.5-VL-7B's gated activation took 15 us a layer against 8, and its K-row
    prefill's other kernels 0.93 against 0.67 ms (benchmarks/results/2026-11-30-160301-gpu-h200-prefill-kernels.json,
    every family in one process, against 2026-12-01-080619-..., each in its own). Only the dims :func:`_varying`
    marks are symbolic, in every model's pieces."""
    return torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, automatic_dynamic_shapes=False)


class LayerTensors(NamedTuple):
    """One decoder layer's weights (views of the module's own tensors; biases None where the layer has none).

    ``qkv`` and ``gate_up`` are the row-stacked weights of q/k/v and gate/up (:func:`stacked_rows`): one product for
    the three attention inputs and one for the two MLP inputs. At a reduced prompt's ~100-200 rows each product is
    bound by reading its weights, and one wide product reads them nearer the card's bandwidth than two or three
    narrow ones (the k and v maps of grouped-query attention are a few hundred rows each) and launches fewer kernels.
    """

    input_norm: torch.Tensor
    qkv: torch.Tensor  # (q + 2 kv widths, d): W_q over W_k over W_v
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # Qwen3: RMSNorm over each head's dims before the rotation
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # (2 ff, d): W_gate over W_up
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


class Shape(NamedTuple):
    """What every layer of a decoder shares: head counts and sizes, the norms' epsilon, the attention's scale."""

    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    scaling: float


#: (cos, sin±), each (batch, rows, 1, head_dim): :func:`rotation_tables`
Rotation = tuple[torch.Tensor, torch.Tensor]
#: (keys, values) cache rows, each (batch, kv_heads, rows, head_dim), that a prefill writes
CacheRows = tuple[torch.Tensor, torch.Tensor]

#: activation modules whose forward is F.silu (transformers' "silu" and "swish")
SILU_MODULES = frozenset({"SiLU", "SiLUActivation"})


def _is_silu(act: object) -> bool:
    return type(act).__name__ in SILU_MODULES and isinstance(act, nn.Module)


def _plain_linear(module: object) -> bool:
    """An ``nn.Linear`` itself, its weight and bias plain floating-point tensors: a subclass may compute something
    else, and a quantised map's packed weights (an integer tensor, or a tensor subclass) are no operand for
    ``F.linear`` and cannot be stacked (:func:`stacked_rows`)."""
    if type(module) is not nn.Linear:
        return False
    tensors = (module.weight, module.bias)
    return all(t is None or (type(t) in (nn.Parameter, torch.Tensor) and t.is_floating_point()) for t in tensors)


def layer_reason(layer: nn.Module) -> str | None:
    """Why :func:`layer_forward` would not compute ``layer`` (one line), or None: it needs transformers' RMSNorm
    (:data:`RMS_NORMS`) before the attention and the MLP, q/k/v/o and gate/up/down maps that are plain ``nn.Linear``
    with floating-point weights (:func:`_plain_linear`), and a SiLU-gated MLP."""
    name = type(layer).__name__
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attention is None or mlp is None:
        return f"{name} has no self_attn and mlp"
    norms = [getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)]
    norms += [getattr(attention, n) for n in ("q_norm", "k_norm") if getattr(attention, n, None) is not None]
    odd = [type(n).__name__ for n in norms if type(n).__name__ not in RMS_NORMS]
    if odd:
        return f"{name} normalises with {', '.join(odd)} (the lean layer knows {', '.join(sorted(RMS_NORMS))})"
    linears = {f"self_attn.{p}": getattr(attention, p, None) for p in _PROJECTIONS}
    linears.update({f"mlp.{p}": getattr(mlp, p, None) for p in _MLP})
    odd = [f"{path} ({type(m).__name__})" for path, m in linears.items() if not _plain_linear(m)]
    if odd:
        more = f" and {len(odd) - 1} more" if len(odd) > 1 else ""
        return f"{name}'s {odd[0]}{more}: not nn.Linear with floating-point weights"
    if not _is_silu(getattr(mlp, "act_fn", None)):
        return f"{name}'s MLP activation is {type(getattr(mlp, 'act_fn', None)).__name__}, not SiLU"
    return None


def _linear(owner: nn.Module, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    linear = submodule(owner, name)
    return tensor_attr(linear, "weight"), optional_tensor_attr(linear, "bias")


def _norm_weight(owner: nn.Module, name: str) -> torch.Tensor | None:
    norm = getattr(owner, name, None)
    return None if norm is None else tensor_attr(submodule(owner, name), "weight")


def _adjacent_rows(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``tensors`` (each (rows_i, ...), same trailing sizes) as one (sum rows_i, ...) view where they lie back to
    back in one storage, in order, else None."""
    first = tensors[0]
    offset, storage = first.storage_offset(), first.untyped_storage().data_ptr()
    for t in tensors:
        same = t.device == first.device and t.dtype == first.dtype and t.shape[1:] == first.shape[1:]
        placed = t.untyped_storage().data_ptr() == storage and t.storage_offset() == offset
        if not (same and placed and t.is_contiguous()):
            return None
        offset += t.numel()
    rows = sum(int(t.shape[0]) for t in tensors)
    return torch.as_strided(first.detach(), (rows, *first.shape[1:]), first.stride(), first.storage_offset())


def stacked_rows(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``tensors`` (a layer's weights or biases, each (rows_i, ...)) stacked by rows in one tensor that the modules'
    own tensors are views of.

    Where they are not so already (:func:`_adjacent_rows`), they are copied into one new buffer and each tensor's
    ``.data`` becomes a view of its rows: the same values and the same Parameter objects (an optimiser's or a hook's
    references stay valid), and no memory added once the old storage is freed, where a stacked copy would add two
    thirds of the decoder's size. The model's own forward reads the same values from the views; ``.to()`` or
    ``.half()`` gives each tensor its own storage again (then the next stacking copies once more)."""
    joined = _adjacent_rows(tensors)
    if joined is not None:
        return joined
    with torch.no_grad():
        buffer = torch.cat([t.detach() for t in tensors])
        start = 0
        for t in tensors:
            t.data = buffer[start : start + t.shape[0]]
            start += int(t.shape[0])
    return buffer


def _stacked_biases(linears: Sequence[nn.Module]) -> torch.Tensor | None:
    """The linear maps' biases stacked as :func:`stacked_rows` stacks them; None where none has one; where only
    some have one, a stacked copy with zeros for the others (a few kilobytes)."""
    biases = [optional_tensor_attr(m, "bias") for m in linears]
    if all(b is None for b in biases):
        return None
    if all(b is not None for b in biases):
        return stacked_rows([b for b in biases if b is not None])
    rows = [int(tensor_attr(m, "weight").shape[0]) for m in linears]
    present = next(b for b in biases if b is not None)
    return torch.cat([present.new_zeros(n) if b is None else b.detach() for b, n in zip(biases, rows, strict=True)])


def _stacked_linears(owner: nn.Module, names: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
    linears = [submodule(owner, name) for name in names]
    return stacked_rows([tensor_attr(m, "weight") for m in linears]), _stacked_biases(linears)


def layer_tensors(layer: nn.Module) -> LayerTensors:
    """The weights of a layer :func:`layer_reason` accepts, q/k/v and gate/up stacked (:func:`stacked_rows`: the
    layer's own tensors may become views of the stacked ones)."""
    attention, mlp = submodule(layer, "self_attn"), submodule(layer, "mlp")
    qkv, gate_up = _stacked_linears(attention, _PROJECTIONS[:3]), _stacked_linears(mlp, _MLP[:2])
    return LayerTensors(
        tensor_attr(submodule(layer, "input_layernorm"), "weight"),
        *qkv, *_linear(attention, "o_proj"),
        _norm_weight(attention, "q_norm"), _norm_weight(attention, "k_norm"),
        tensor_attr(submodule(layer, "post_attention_layernorm"), "weight"),
        *gate_up, *_linear(mlp, "down_proj"),
    )  # fmt: skip


def layer_shape(config: Any, layer: nn.Module) -> Shape:
    """Head counts and sizes from the text config, epsilon from the layer's input norm, scale from its attention."""
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    eps = float_attr(submodule(layer, "input_layernorm"), "variance_epsilon")
    scaling = float(getattr(submodule(layer, "self_attn"), "scaling", head_dim**-0.5))
    return Shape(heads, kv_heads, head_dim, eps, scaling)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x²) + eps) over the last dimension, the statistics in at least float32."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rotation_tables(cos: torch.Tensor, sin: torch.Tensor) -> Rotation:
    """(cos, sin±), each (batch, rows, 1, head_dim), from the rotary embedding's (batch, rows, head_dim) tables:
    rotate_half(x) sin = roll(x, head_dim / 2) sin± with sin± = (-sin first half, sin second half)."""
    half = cos.shape[-1] // 2
    signed = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
    return cos[:, :, None], signed[:, :, None]


def attention_inputs(
    hidden: torch.Tensor, w: LayerTensors, rotation: Rotation, shape: Shape, cache_rows: CacheRows | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys and values, each (batch, heads, rows, head_dim), of the layer's input ``hidden``: the input
    norm, the projections, Qwen3's per-head norms, the rotation by ``rotation`` (:func:`rotation_tables`).
    ``cache_rows``: (keys, values) cache rows of the same shape that the keys and values are also written to (a
    prefill's; in a compiled piece the writes join the rotation's kernel instead of two copies of their own)."""
    batch, rows, _ = hidden.shape
    x = rms_norm(hidden, w.input_norm, shape.eps)
    kv_width = shape.kv_heads * shape.head_dim
    q, k, v = F.linear(x, w.qkv, w.qkv_bias).split([shape.heads * shape.head_dim, kv_width, kv_width], dim=-1)
    q = q.view(batch, rows, shape.heads, shape.head_dim)
    k = k.view(batch, rows, shape.kv_heads, shape.head_dim)
    v = v.view(batch, rows, shape.kv_heads, shape.head_dim)
    if w.q_norm is not None and w.k_norm is not None:
        q, k = rms_norm(q, w.q_norm, shape.eps), rms_norm(k, w.k_norm, shape.eps)
    half, (cos, sin) = shape.head_dim // 2, rotation
    q = torch.addcmul(q * cos, q.roll(half, -1), sin)
    k = torch.addcmul(k * cos, k.roll(half, -1), sin)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if cache_rows is not None:
        cache_rows[0].copy_(k)
        cache_rows[1].copy_(v)
    return q, k, v


def mlp_block(hidden: torch.Tensor, attended: torch.Tensor, w: LayerTensors, shape: Shape) -> torch.Tensor:
    """The layer's output from its input ``hidden`` and the attention's output (batch, heads, rows, head_dim)."""
    batch, rows, _ = hidden.shape
    hidden = hidden + F.linear(attended.transpose(1, 2).reshape(batch, rows, -1), w.o, w.o_bias)
    x = rms_norm(hidden, w.post_norm, shape.eps)
    gate, up = F.linear(x, w.gate_up, w.gate_up_bias).chunk(2, dim=-1)
    gated = F.silu(gate) * up
    return hidden + F.linear(gated, w.down, w.down_bias)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, shape: Shape) -> torch.Tensor:
    """Scaled dot-product attention of the queries over the keys (grouped heads shared): causal where ``mask`` is
    None (a fresh prompt: the cache held nothing before it), else with the additive ``mask``."""
    causal = mask is None and q.shape[2] > 1
    grouped = shape.heads != shape.kv_heads
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=shape.scaling,
                                          enable_gqa=grouped)  # fmt: skip


def _varying(*dims: tuple[torch.Tensor, int, int]) -> None:
    """Mark each tensor's batch and rows dimensions (the two indices given) symbolic for the compiled pieces,
    where larger than 1: one compiled piece serves every prompt length and batch, while the widths and head
    sizes stay constants that Inductor's kernels are specialised for (a size of 1, a decode step's rows, is
    always specialised: that is one more compiled piece)."""
    for tensor, batch_dim, rows_dim in dims:
        for dim in (batch_dim, rows_dim):
            if tensor.shape[dim] > 1:
                torch._dynamo.mark_dynamic(tensor, dim)


class LeanLayers:
    """The two pure pieces of :func:`layer_forward`: compiled for the steps a CUDA graph captures where Triton runs on
    ``device``, as written everywhere else (``compiled`` says whether the compiled pieces exist). Where compiling
    fails (dynamo or Inductor cannot build a piece here, e.g. no C compiler for Triton's launcher), the pieces run as
    written from then on and ``compile_failure`` says why: the same maths, more kernels. Run the layers inside
    :meth:`scope`.

    Why only captures: a compiled piece pays dynamo's guards and its wrapper on every call from Python, about
    0.3-0.5 ms a layer on an H200 host, which a replayed graph never pays and an eager step pays on every layer.
    Eager K-row first tokens (no graphs) took 33.7 ms compiled against 21.5 as written on InternVL3-8B, 24.0 against
    17.6 on Qwen3-VL-8B, 32.4 against 21.1 on LLaVA-1.5-7B (H200,
    benchmarks/results/2026-11-29-130800-gpu-h200-eager-pieces-ab.json). In a capture the kernels, not their
    launches, are what a replay costs, and there the compiled pieces' fused norms, rotation and activation win.
    """

    def __init__(self, device: torch.device) -> None:
        self.compiled = why_not_fused(device) is None
        self.compile_failure: str | None = None
        self.for_graphs = False  # which pieces run: set by scope()
        self._compiled: tuple[Callable[..., Any], Callable[..., Any]] | None = None
        if self.compiled:
            # only the dims _varying marks are symbolic (dynamic=None); with every size symbolic, head_dim and widths
            # too, Inductor's kernels were slower: a 96-row LLaVA-1.5-7B prefill graph took 6.2 ms against 5.7,
            # LLaVA-NeXT-7B's all-token first token 81.6 against 69.6 (H200)
            self._compiled = (torch.compile(attention_inputs, dynamic=None, fullgraph=True),
                              torch.compile(mlp_block, dynamic=None, fullgraph=True))  # fmt: skip

    def _fall_back(self, exc: Exception) -> None:
        self.compiled = False
        self.compile_failure = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]

    def _use_compiled(self) -> bool:
        return self.for_graphs and self.compiled and self._compiled is not None

    def attention_inputs(
        self, hidden: torch.Tensor, w: LayerTensors, rotation: Rotation, shape: Shape, cache_rows: CacheRows | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:func:`attention_inputs`, compiled in captures where it can be."""
        args = (hidden, w, rotation, shape, cache_rows)
        if self._use_compiled() and self._compiled is not None:
            try:
                _varying((hidden, 0, 1), *((t, 0, 1) for t in rotation), *((t, 0, 2) for t in cache_rows or ()))
                return self._compiled[0](*args)  # type: ignore[no-any-return]
            except torch._dynamo.exc.TorchDynamoException as exc:
                self._fall_back(exc)
        return attention_inputs(*args)

    def mlp_block(self, hidden: torch.Tensor, attended: torch.Tensor, w: LayerTensors, shape: Shape) -> torch.Tensor:
        """:func:`mlp_block`, compiled in captures where it can be."""
        if self._use_compiled() and self._compiled is not None:
            try:
                _varying((hidden, 0, 1), (attended, 0, 2))
                return self._compiled[1](hidden, attended, w, shape)  # type: ignore[no-any-return]
            except torch._dynamo.exc.TorchDynamoException as exc:
                self._fall_back(exc)
        return mlp_block(hidden, attended, w, shape)

    @contextmanager
    def scope(self, *, for_graphs: bool) -> Iterator[None]:
        """Where the pieces run: ``for_graphs`` (a step a CUDA graph captures, or its warm-up: compiled) or eager steps
        (as written); dynamo's settings those of :func:`compile_settings` (both restored on exit)."""
        saved, self.for_graphs = self.for_graphs, for_graphs
        try:
            with compile_settings() if self.compiled else nullcontext():
                yield
        finally:
            self.for_graphs = saved


def layer_forward(
    pieces: LeanLayers,
    hidden: torch.Tensor,
    w: LayerTensors,
    rotation: Rotation,
    shape: Shape,
    cache: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    mask: torch.Tensor | None,
    cache_rows: CacheRows | None = None,
) -> torch.Tensor:
    """One decoder layer on ``hidden`` (batch, rows, d): ``rotation`` from :func:`rotation_tables`; ``cache`` takes
    the new keys and values and gives those to attend over (a static cache's update); ``cache_rows``: where the
    keys and values are written as they are made (:func:`attention_inputs`), or None."""
    q, k, v = pieces.attention_inputs(hidden, w, rotation, shape, cache_rows)
    k, v = cache(k, v)
    return pieces.mlp_block(hidden, attend(q, k, v, mask, shape), w, shape)
