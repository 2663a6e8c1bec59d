"""What every family's ``care flops`` config reader shares: reading the JSON, checking that a ``config.json`` states
its sizes, filling the rest the way transformers does, and the language model's dims.

A family's record names its reader (``BackboneFamily.flops_config``, a ``"module:function"``); the reader turns a
read ``config.json`` (its path beside, for the folder's ``preprocessor_config.json``) into a
:class:`~care_core.architecture.BackboneSpec`. Torch-free; transformers is imported only when a config is read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from care_core.architecture import BackboneSpecError, LanguageModelSpec
from care_core.errors import CareError, one_line

# What a config.json must state itself: sizes transformers would otherwise fill from its defaults (7B-class
# numbers) without saying so. llava-hf configs name the text model in text_config and let its class fill the
# sizes, which is how the checkpoint itself is built, so a named text model is enough there.
VISION_FIELDS = ("hidden_size", "image_size", "patch_size", "num_hidden_layers")
TEXT_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
#: the processor's settings, beside config.json in a model folder
PREPROCESSOR = "preprocessor_config.json"


def load_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; BackboneSpecError naming the problem otherwise."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise BackboneSpecError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise BackboneSpecError(f"{path} is not UTF-8 text") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno}, column {exc.colno}"
        raise BackboneSpecError(f"{path} is not valid JSON ({where}: {exc.msg})") from None
    if not isinstance(data, dict):
        raise BackboneSpecError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def brief(exc: Exception, limit: int = 200) -> str:
    """An exception as one line of at most ``limit`` characters."""
    text = one_line(f"{type(exc).__name__}: {exc}")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def positive(value: Any, what: str, path: Path) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BackboneSpecError(f"{path}: {what} must be a positive integer, got {value!r}")
    return value


def missing_vision(raw: Mapping[str, Any], fields: Sequence[str] = VISION_FIELDS) -> list[str]:
    """What the config's ``vision_config`` lacks of ``fields`` (all of it when there is none)."""
    vision = raw.get("vision_config")
    if not isinstance(vision, dict):
        return ["vision_config"]
    return [f"vision_config.{k}" for k in fields if k not in vision]


def missing_named_text(raw: Mapping[str, Any]) -> list[str]:
    """What ``text_config`` lacks: nothing when it names its text model (whose class fills the sizes) or states
    every size (:data:`TEXT_FIELDS`)."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        return ["text_config"]
    if not (text.get("model_type") or text.get("_name_or_path")) and any(k not in text for k in TEXT_FIELDS):
        return [f"text_config.{k}" for k in ("model_type", *TEXT_FIELDS) if k not in text]
    return []


def missing_text_sizes(raw: Mapping[str, Any]) -> list[str]:
    """The text sizes (:data:`TEXT_FIELDS`) missing from ``text_config``, or from the top level when
    ``text_config`` states no ``hidden_size`` (older Qwen configs keep the text fields there)."""
    text = raw.get("text_config")
    source = text if isinstance(text, dict) and "hidden_size" in text else raw
    where = "text_config." if source is text else ""
    return [f"{where}{k}" for k in TEXT_FIELDS if k not in source]


def check_complete(raw: Mapping[str, Any], path: Path, missing: Sequence[str]) -> None:
    """BackboneSpecError naming every missing field of an incomplete config.json."""
    if missing:
        raise BackboneSpecError(f"{path}: incomplete {raw.get('model_type')} config, missing {', '.join(missing)}")


def hf_config(raw: Mapping[str, Any], path: Path) -> Any:
    """The transformers config of ``raw`` (missing fields take transformers' own defaults)."""
    try:
        from transformers import AutoConfig  # only here: reading a config is the one use, and it is heavy

        return AutoConfig.for_model(**raw)
    except CareError:
        raise
    except Exception as exc:  # transformers raises many types for malformed configs
        raise BackboneSpecError(f"{path}: malformed {raw.get('model_type')} config ({brief(exc)})") from None


def lm_spec(text: Any, path: Path) -> LanguageModelSpec:
    """The language model's dims from a config's text part."""
    layers = positive(text.num_hidden_layers, "num_hidden_layers", path)
    hidden = positive(text.hidden_size, "hidden_size", path)
    heads = positive(text.num_attention_heads, "num_attention_heads", path)
    kv_heads = positive(getattr(text, "num_key_value_heads", None) or heads, "num_key_value_heads", path)
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    return LanguageModelSpec(
        layers=layers, hidden=hidden, intermediate=positive(text.intermediate_size, "intermediate_size", path),
        heads=heads, kv_heads=kv_heads, vocab=positive(text.vocab_size, "vocab_size", path), head_dim=head_dim,
    )  # fmt: skip
