"""Typed reads of a transformers model's parts, for the adapters' walks into the model.

``nn.Module.__getattr__`` is typed ``Tensor | Module`` for every attribute it finds, so a walk such as
``merger.ln_q.weight`` has no static type. Each reader here returns one type, checked at run time: a model that holds
something else at that name raises a TypeError naming the attribute, instead of failing later somewhere unrelated.
:func:`instance_forwards` is the one way care's stand-ins take a module's ``forward`` for the length of a block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

_T = TypeVar("_T")


def typed_attr(owner: object, name: str, kind: type[_T]) -> _T:
    """``owner.<name>``, checked to be a ``kind``; TypeError naming the attribute when it is something else."""
    value = getattr(owner, name)
    if not isinstance(value, kind):
        raise TypeError(f"{type(owner).__name__}.{name} is a {type(value).__name__}, not a {kind.__name__}")
    return value


def submodule(owner: nn.Module, name: str) -> nn.Module:
    """The child module ``owner.<name>``."""
    return typed_attr(owner, name, nn.Module)


def tensor_attr(owner: nn.Module, name: str) -> torch.Tensor:
    """The parameter or buffer ``owner.<name>``."""
    return typed_attr(owner, name, torch.Tensor)


def optional_tensor_attr(owner: nn.Module, name: str) -> torch.Tensor | None:
    """The parameter or buffer ``owner.<name>`` where a module may have none (a bias): None when absent or None."""
    if getattr(owner, name, None) is None:
        return None
    return tensor_attr(owner, name)


def int_attr(owner: object, name: str) -> int:
    """``int(owner.<name>)``: a size a module keeps as a plain attribute (``hidden_size``, ``num_heads``)."""
    return int(getattr(owner, name))


def float_attr(owner: object, name: str) -> float:
    """``float(owner.<name>)``: a constant a module keeps as a plain attribute (``variance_epsilon``, ``eps``)."""
    return float(getattr(owner, name))


def pretrained_model(model: nn.Module) -> PreTrainedModel:
    """``model`` as the transformers model it is: its ``config`` and methods (``set_attn_implementation``) typed."""
    # a cast, not a check: the check would import transformers with this module, which the backbone modules load
    # lazily; every model an adapter holds is a transformers PreTrainedModel
    return cast("PreTrainedModel", model)


def model_config(model: nn.Module) -> PretrainedConfig:
    """``model.config``, a transformers model's config (its fields are dynamic: each reads as Any)."""
    return pretrained_model(model).config


def input_embeddings(model: nn.Module) -> nn.Module:
    """``model.get_input_embeddings()``, read in three attribute lookups where the model has transformers' VLM layout
    (``model.model.language_model.embed_tokens``: every family here), which that method finds by a search through
    several names (about 10 µs of host time, once per request)."""
    inner = getattr(getattr(getattr(model, "model", None), "language_model", None), "embed_tokens", None)
    if isinstance(inner, nn.Module):
        return inner
    return cast("PreTrainedModel", model).get_input_embeddings()


@contextlib.contextmanager
def instance_forwards(stand_ins: Iterable[tuple[nn.Module, Callable[..., Any]]]) -> Iterator[int]:
    """Inside the block, each (module, forward) pair's module runs that forward: set as the module's own instance
    attribute, which ``nn.Module.__call__`` reads before its class's. A module whose instance ``forward`` is set
    already (by an enclosing block, or by its owner) is left as it is. Yields how many it set; each is removed on exit,
    also after an error. Not thread-safe: the setting lives on the (shared) modules while the block runs."""
    patched: list[nn.Module] = []
    try:
        for module, forward in stand_ins:
            if "forward" not in vars(module):
                vars(module)["forward"] = forward
                patched.append(module)
        yield len(patched)
    finally:
        for module in patched:
            vars(module).pop("forward", None)
