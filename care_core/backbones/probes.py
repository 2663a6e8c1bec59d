"""Probe machinery shared by the adapters: scoped hooks, truncated forwards, temporary eager attention,
the CLIP vision-tower probes and the language-model probe handle.

Every hook is registered through a :class:`HookScope` (a context manager that removes all of its hooks on
exit, also when the forward raises), and every temporary attention-implementation switch goes through
:func:`attention_implementation` (restores every config's setting on exit). A capture that has everything
it needs raises :class:`StopForward` from inside the hook, so a forward never runs past the last layer a
probe needs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..architecture import hidden_state_indices
from ._hf import quiet_transformers
from .module_attrs import int_attr, optional_tensor_attr, pretrained_model, submodule, tensor_attr

# Probe names computed from one vision-tower forward (see care_core.vocabulary.PROBES); the attention
# probes are recomputed from the feature block's attention input.
ATTENTION_PROBES = frozenset({"cls_attention", "attention_logits", "keys"})
VISION_PROBES = ATTENTION_PROBES | {"hidden_with_cls", "last_layer_qk"}
#: a model's ``vision_feature_layer``: one index into ``hidden_states``, or several (features concatenated)
FeatureLayer = int | Sequence[int]


class StopForward(Exception):
    """Raised by a capture hook once everything needed is captured, to end the forward early."""


class HookScope:
    """Registers forward (pre-)hooks and removes all of them on exit, whatever happens inside."""

    def __init__(self) -> None:
        self._handles: list[Any] = []

    def __enter__(self) -> HookScope:
        return self

    def __exit__(self, *exc: object) -> None:
        while self._handles:
            self._handles.pop().remove()

    def forward_hook(self, module: torch.nn.Module, fn: Callable[..., Any], *, with_kwargs: bool = False) -> None:
        self._handles.append(module.register_forward_hook(fn, with_kwargs=with_kwargs))

    def forward_pre_hook(self, module: torch.nn.Module, fn: Callable[..., Any], *, with_kwargs: bool = False) -> None:
        self._handles.append(module.register_forward_pre_hook(fn, with_kwargs=with_kwargs))


def run_until_stopped(forward: Callable[[], Any]) -> bool:
    """Run ``forward()``; True when a hook ended it with :class:`StopForward`, False when it ran to the end."""
    try:
        forward()
    except StopForward:
        return True
    return False


def _hidden_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """The ``hidden_states`` argument of a transformer block / attention call (positional or keyword)."""
    if "hidden_states" in kwargs:
        return kwargs["hidden_states"]
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    raise RuntimeError("cannot find the hidden_states argument of the hooked module")


def first_output(output: Any) -> torch.Tensor:
    """A block's hidden-state output: the tensor itself (transformers 5) or the first of a tuple (4)."""
    return output[0] if isinstance(output, tuple | list) else output


# --------------------------------------------------------------------------------- attention setting
def _all_configs(model: torch.nn.Module) -> list[Any]:
    """Every (sub-)config reachable from the model's modules, each once."""
    from transformers import PretrainedConfig

    seen: dict[int, Any] = {}
    stack = [cfg for m in model.modules() if isinstance(cfg := getattr(m, "config", None), PretrainedConfig)]
    while stack:
        cfg = stack.pop()
        if id(cfg) in seen:
            continue
        seen[id(cfg)] = cfg
        for key in getattr(cfg, "sub_configs", {}) or {}:
            sub = getattr(cfg, key, None)
            if isinstance(sub, PretrainedConfig):
                stack.append(sub)
    return list(seen.values())


_MISSING = object()


def attention_settings(model: torch.nn.Module) -> dict[int, Any]:
    """Snapshot of every config's attention-implementation attribute (for restoring, and for tests)."""
    return {id(cfg): cfg.__dict__.get("_attn_implementation_internal", _MISSING) for cfg in _all_configs(model)}


@contextlib.contextmanager
def attention_implementation(model: torch.nn.Module, request: str | dict[str, Any]) -> Iterator[None]:
    """Temporarily ``model.set_attn_implementation(request)``; every config's setting is restored on exit.

    Not thread-safe: the setting lives on the (shared) model config while the context is open.
    """
    configs = _all_configs(model)
    saved = [(cfg, cfg.__dict__.get("_attn_implementation_internal", _MISSING)) for cfg in configs]
    try:
        with quiet_transformers():
            pretrained_model(model).set_attn_implementation(request)
        yield
    finally:
        for cfg, value in saved:
            if value is _MISSING:
                cfg.__dict__.pop("_attn_implementation_internal", None)
            else:
                cfg.__dict__["_attn_implementation_internal"] = value


# ------------------------------------------------------------------------------------ vision probes
def clip_encoder_layers(tower: torch.nn.Module) -> torch.nn.ModuleList:
    """The encoder blocks of a CLIP-style vision tower (5.x ``tower.encoder``; 4.x ``tower.vision_model.encoder``)."""
    encoder = getattr(tower, "encoder", None)
    if encoder is None:
        encoder = getattr(getattr(tower, "vision_model", None), "encoder", None)
    layers = getattr(encoder, "layers", None)
    if layers is None:
        raise RuntimeError(f"{type(tower).__name__} has no encoder.layers; not a CLIP-style vision tower")
    return layers


@dataclass(frozen=True)
class _CapturePlan:
    """What a capture hooks: ``indices`` into ``hidden_states`` (one per feature layer) and which probe groups."""

    indices: list[int]
    attention: bool  # an attention probe: the feature block's attention input
    hidden: bool  # hidden_with_cls: the hidden states at ``indices``
    last_qk: bool  # last_layer_qk: the last block's q_proj / k_proj outputs

    def feature_block(self, layers: torch.nn.ModuleList) -> torch.nn.Module:
        """The encoder block whose output is the (single) feature layer's hidden state."""
        return layers[self.indices[0] - 1]


def _capture_plan(num_layers: int, feature_layer: FeatureLayer, names: AbstractSet[str]) -> _CapturePlan:
    """The plan for probes `names`; ValueError when the attention probes lack one block to read from."""
    indices = hidden_state_indices(feature_layer, num_layers)
    attention_names = ATTENTION_PROBES & set(names)
    if attention_names and len(indices) != 1:
        raise ValueError(f"{sorted(attention_names)} need a single vision feature layer, got {feature_layer}")
    if attention_names and indices[0] == 0:
        raise ValueError(f"{sorted(attention_names)}: feature layer {feature_layer} is the embedding output")
    return _CapturePlan(indices, bool(attention_names), "hidden_with_cls" in names, "last_layer_qk" in names)


class _Captured:
    """Tensors the hooks store by key; the forward stops once every expected key is in."""

    def __init__(self) -> None:
        self.values: dict[Any, torch.Tensor] = {}
        self.expected: set[Any] = set()

    def store(self, key: Any, value: torch.Tensor) -> None:
        self.values[key] = value.detach()
        if self.expected <= self.values.keys():
            raise StopForward


def _hook_plan(hooks: HookScope, layers: torch.nn.ModuleList, plan: _CapturePlan, captured: _Captured) -> None:
    """Register the hooks `plan` needs, each storing into `captured` under a key it expects."""
    store = captured.store
    if plan.attention:
        captured.expected.add("attn_input")
        hooks.forward_pre_hook(
            submodule(plan.feature_block(layers), "self_attn"),
            lambda m, a, kw: store("attn_input", _hidden_input(a, kw)),
            with_kwargs=True,
        )
    if plan.hidden:
        for index in dict.fromkeys(plan.indices):
            captured.expected.add(("hidden", index))
            if index == 0:  # hidden_states[0] is the input of block 0
                hooks.forward_pre_hook(
                    layers[0],
                    lambda m, a, kw, key=("hidden", index): store(key, _hidden_input(a, kw)),
                    with_kwargs=True,
                )
            else:  # hidden_states[i] is the output of block i - 1
                hooks.forward_hook(
                    layers[index - 1], lambda m, a, o, key=("hidden", index): store(key, first_output(o))
                )
    if plan.last_qk:
        last = submodule(layers[len(layers) - 1], "self_attn")
        captured.expected.update({"last_q", "last_k"})
        hooks.forward_hook(submodule(last, "q_proj"), lambda m, a, o: store("last_q", o))
        hooks.forward_hook(submodule(last, "k_proj"), lambda m, a, o: store("last_k", o))


def _run_tower(tower: torch.nn.Module, pixel_values: torch.Tensor, captured: _Captured) -> None:
    """The tower's forward on `pixel_values` until the hooks have stored everything `captured` expects."""
    param = next(tower.parameters())
    pv = pixel_values.to(device=param.device, dtype=param.dtype)
    with quiet_transformers():
        stopped = run_until_stopped(lambda: tower(pixel_values=pv, return_dict=True))
    if not stopped:
        missing = sorted(map(str, captured.expected - captured.values.keys()))
        raise RuntimeError(f"the vision tower forward never reached the probe hooks {missing}")


def clip_vision_capture(
    tower: torch.nn.Module, pixel_values: torch.Tensor, feature_layer: FeatureLayer, names: AbstractSet[str]
) -> dict[str, Any]:
    """What the requested :data:`VISION_PROBES` need, captured in one (truncated) pass of a CLIP-style tower.

    ``pixel_values`` is a batch (B, 3, H, W) (LLaVA-NeXT: its crops); every captured tensor keeps that
    batch axis. Keys present only when needed: ``"attn_input"`` (B, T, d) the feature block's attention
    input (already ``layer_norm1``-ed) and ``"attention"`` that block's attention module; ``"hidden"`` a
    list (one per feature layer) of (B, T, d_v) hidden states; ``"last_q"``, ``"last_k"`` (B, T, d_v) the
    last block's ``q_proj`` / ``k_proj`` outputs. See :func:`clip_vision_probes` for the layer indexing.
    """
    unknown = set(names) - VISION_PROBES
    if unknown:
        raise ValueError(f"not vision probes: {sorted(unknown)}")
    layers = clip_encoder_layers(tower)
    plan = _capture_plan(len(layers), feature_layer, names)
    captured = _Captured()
    with torch.no_grad(), HookScope() as hooks:
        _hook_plan(hooks, layers, plan, captured)
        if not captured.expected:
            return {}
        _run_tower(tower, pixel_values, captured)

    out: dict[str, Any] = {}
    if plan.attention:
        out["attn_input"] = captured.values["attn_input"]
        out["attention"] = plan.feature_block(layers).self_attn
    if plan.hidden:
        out["hidden"] = [captured.values[("hidden", i)] for i in plan.indices]
    if plan.last_qk:
        out["last_q"], out["last_k"] = captured.values["last_q"], captured.values["last_k"]
    return out


def clip_vision_probes(
    tower: torch.nn.Module, pixel_values: torch.Tensor, feature_layer: FeatureLayer, names: AbstractSet[str]
) -> dict[str, torch.Tensor]:
    """The requested :data:`VISION_PROBES` of one image from one (truncated) pass of a CLIP-style tower.

    ``feature_layer`` is the model's ``vision_feature_layer`` (index into ``hidden_states``); the
    "feature layer" of the attention probes is the encoder block whose output is that hidden state,
    block ``L_v + feature_layer`` for a negative index. The tower keeps its attention implementation:
    a pre-hook takes that block's attention input (already ``layer_norm1``-ed) and the probes recompute
    its queries and keys in float32 with the block's own ``q_proj`` / ``k_proj`` (bias included).

    Returns, for ``T = 1 + N`` tokens (CLS first), on the tower's device:
    ``cls_attention`` (H, T) float32 softmax of the CLS query row; ``attention_logits`` (T, T) float32
    head-mean of ``q k^T * head_dim**-0.5`` per head; ``keys`` (T, d_head) float32 head-mean of the
    per-head keys; ``hidden_with_cls`` (T, d_v) in the tower's dtype (feature layers concatenated along
    the last axis when there are several, like the features); ``last_layer_qk`` (2, T, d_v) float32:
    the hooked ``q_proj`` and ``k_proj`` outputs of the last block.
    """
    captured = clip_vision_capture(tower, pixel_values, feature_layer, names)
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        attention_names = ATTENTION_PROBES & set(names)
        if attention_names:
            out.update(_attention_probes(captured["attention"], captured["attn_input"][0], attention_names))
        if "hidden_with_cls" in names:
            out["hidden_with_cls"] = torch.cat([h[0] for h in captured["hidden"]], dim=-1)
        if "last_layer_qk" in names:
            out["last_layer_qk"] = torch.stack([captured["last_q"][0], captured["last_k"][0]]).float()
    return out


def linear32(linear: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``linear`` applied to ``x`` with its weight and bias in float32: the vision probes' queries and keys are float32
    whatever the model's dtype (one grid here, LLaVA-NeXT's crops in its adapter)."""
    bias = optional_tensor_attr(linear, "bias")
    return F.linear(x, tensor_attr(linear, "weight").float(), bias.float() if bias is not None else None)


def _attention_probes(attn: torch.nn.Module, x: torch.Tensor, names: AbstractSet[str]) -> dict[str, torch.Tensor]:
    """cls_attention / attention_logits / keys from one attention module's (T, d) input, in float32."""
    heads = int_attr(attn, "num_heads")
    head_dim = int_attr(attn, "head_dim")
    scale = float(getattr(attn, "scale", head_dim**-0.5))
    x = x.float()
    tokens = x.shape[0]
    keys = linear32(submodule(attn, "k_proj"), x).view(tokens, heads, head_dim).transpose(0, 1)  # (H, T, d_head)
    out: dict[str, torch.Tensor] = {}
    if "keys" in names:
        out["keys"] = keys.mean(dim=0)
    if "attention_logits" in names or "cls_attention" in names:
        rows = x if "attention_logits" in names else x[:1]  # one query row suffices for the CLS attention
        queries = linear32(submodule(attn, "q_proj"), rows).view(rows.shape[0], heads, head_dim).transpose(0, 1)
        logits = torch.matmul(queries, keys.transpose(1, 2)) * scale  # (H, rows, T)
        if "cls_attention" in names:
            out["cls_attention"] = torch.softmax(logits[:, 0], dim=-1)
        if "attention_logits" in names:
            out["attention_logits"] = logits.mean(dim=0)
    return out


# ------------------------------------------------------------------------------ language-model probe
class LanguageModelRun:
    """:class:`care_core.methods.base.LanguageModelProbe` for one prompt of an HF decoder.

    ``forward()`` runs the full model on the prompt (all N visual tokens); ``attention_modules[i]`` is
    decoder layer i's attention module, whose output is ``(attn_output, attn_weights)``; ``eager()``
    is a context manager that switches the language model to eager attention (which returns the
    weights) and restores the setting. Attentions are computed at most once per layer and cached.
    """

    def __init__(
        self,
        *,
        forward: Callable[[], Any],
        input_ids: torch.Tensor,
        image_token_id: int,
        embeddings: Callable[[], torch.Tensor],
        attention_modules: Sequence[torch.nn.Module],
        eager: Callable[[], contextlib.AbstractContextManager[Any]],
    ) -> None:
        self._forward = forward
        self._embeddings = embeddings
        self._modules = list(attention_modules)
        self._eager = eager
        self._attentions: list[torch.Tensor] = []
        self._input_embeddings: torch.Tensor | None = None
        ids = input_ids.reshape(-1)
        self.input_ids = ids
        where = (ids == image_token_id).nonzero().flatten()
        if where.numel() == 0:
            raise RuntimeError("the prompt holds no image tokens")
        start, end = int(where[0]), int(where[-1]) + 1
        if end - start != where.numel():
            raise RuntimeError("the prompt's image tokens are not one contiguous run")
        self._image_span = (start, end)
        self._text_span = (end, int(ids.numel()))

    @property
    def num_layers(self) -> int:
        return len(self._modules)

    @property
    def image_span(self) -> tuple[int, int]:
        """[start, end) of the N visual tokens in the prompt."""
        return self._image_span

    @property
    def text_span(self) -> tuple[int, int]:
        """[start, end) of the text tokens after the image (the question and the prompt's end)."""
        return self._text_span

    def input_embeddings(self) -> torch.Tensor:
        """(L, d_t) input embeddings of the full prompt, the visual tokens scattered in (model dtype)."""
        if self._input_embeddings is None:
            with torch.no_grad():
                self._input_embeddings = self._embeddings().detach()
        return self._input_embeddings

    def attentions(self, upto_layer: int) -> list[torch.Tensor]:
        """Softmax attentions (H, L, L), float32, of layers 0..upto_layer on the full prompt.

        Like slicing a list of all layers' attentions: when the model has fewer layers, all of them are
        returned (callers check ``len``). One forward with eager attention, stopped right after layer
        ``upto_layer``'s attention; results are cached, so asking again for the same or fewer layers
        costs nothing.
        """
        if int(upto_layer) < 0:
            raise ValueError(f"upto_layer must be >= 0, got {upto_layer}")
        upto = min(int(upto_layer), self.num_layers - 1)
        if upto < len(self._attentions):
            return self._attentions[: upto + 1]
        captured: dict[int, torch.Tensor] = {}

        def capture(layer: int, output: Any) -> None:
            weights = output[1] if isinstance(output, tuple | list) and len(output) > 1 else None
            if weights is None:
                raise RuntimeError(f"language-model layer {layer} returned no attention weights under eager attention")
            captured[layer] = weights[0].detach().float()
            if layer == upto:
                raise StopForward

        with torch.no_grad(), self._eager(), HookScope() as hooks:
            for layer in range(upto + 1):
                hooks.forward_hook(self._modules[layer], lambda m, a, o, layer=layer: capture(layer, o))
            with quiet_transformers():
                stopped = run_until_stopped(self._forward)
        if not stopped or len(captured) != upto + 1:
            raise RuntimeError(f"the language-model forward did not reach layer {upto}'s attention")
        self._attentions = [captured[i] for i in range(upto + 1)]
        return list(self._attentions)
