"""What one evaluation runs: the model, the reduction (a method at a budget, or none) and CaRe's hyperparameters.

``model_args`` of the lmms-eval models (``pretrained=tiny-llava,method=care,keep=64,lam=0.5``) are parsed here,
without importing lmms-eval, torch or transformers, so that ``care eval`` can check them before loading anything.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from care_core.backbones.families import DEFAULT_DEMO
from care_core.batch_sizes import BatchSize, parse_batch_size
from care_core.config import CaReConfig
from care_core.errors import BudgetError, CareError, ConfigError, MethodError

#: Keys of ``model_args`` besides the CaReConfig fields.
MODEL_KEYS = ("pretrained", "method", "keep", "ratio", "device", "dtype", "cuda_graph")
#: Keys lmms-eval's own CLI adds (``--batch_size``, ``--max_batch_size``): how many samples are answered at once
#: (:func:`batch_arguments`); not part of the setting (per sample, a batch gives what a batch of one gives).
RUNNER_KEYS = ("batch_size", "max_batch_size")
NO_METHOD = "none"


class ModelArgsError(CareError):
    """``model_args`` are malformed: an unknown key, a value of the wrong type, a budget that makes no sense."""


@dataclass(frozen=True)
class EvalSpec:
    """One evaluated configuration: the backbone, the method (None: all visual tokens) and its budget."""

    pretrained: str = DEFAULT_DEMO
    method: str | None = "care"
    keep: int | None = None
    ratio: float | None = None
    device: str = "auto"
    dtype: str = "auto"
    config: CaReConfig = field(default_factory=CaReConfig)
    # generate from replayed CUDA graphs: None = where the backbone allows it; like the device, not in the
    # fingerprint (it moves float rounding only)
    cuda_graph: bool | None = None

    @property
    def budget(self) -> Any:
        """The :class:`care_core.pipeline.Budget` of the reduction (None without a method)."""
        from care_core.budget import Budget

        if self.method is None:
            return None
        return Budget.keep(self.keep) if self.keep is not None else Budget.ratio(float(self.ratio or 0))

    @property
    def label(self) -> str:
        """``none``, ``care K=64`` or ``visionzip ratio 0.11``."""
        if self.method is None:
            return NO_METHOD
        return f"{self.method} {self.budget.label}"

    @property
    def slug(self) -> str:
        """A file-name-safe name of the setting: ``none``, ``care-k64``, ``visionzip-r0.11``."""
        if self.method is None:
            return NO_METHOD
        return f"{self.method}-k{self.keep}" if self.keep is not None else f"{self.method}-r{self.ratio:g}"

    def model_args(self) -> dict[str, Any]:
        """The ``model_args`` that rebuild this setting (hyperparameters only where they differ from the defaults)."""
        out: dict[str, Any] = {"pretrained": self.pretrained, "method": self.method or NO_METHOD}
        if self.keep is not None:
            out["keep"] = self.keep
        if self.ratio is not None:
            out["ratio"] = self.ratio
        out["device"] = self.device
        out["dtype"] = self.dtype
        if self.cuda_graph is not None:
            out["cuda_graph"] = self.cuda_graph
        default = CaReConfig().to_dict()
        out.update({k: v for k, v in self.config.to_dict().items() if v != default[k]})
        return out

    def model_args_string(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.model_args().items())

    def fingerprint(self) -> str:
        """Everything that changes the answers, as stable text (the lmms-eval response cache keys on it)."""
        payload = {"pretrained": self.pretrained, "method": self.method, "keep": self.keep, "ratio": self.ratio,
                   "dtype": self.dtype, "config": self.config.to_dict()}  # fmt: skip
        return json.dumps(payload, sort_keys=True)


def _bad(key: str, expected: str, value: Any) -> ModelArgsError:
    return ModelArgsError(f"model_args: {key} must be {expected}, got {value!r}")


def _text(key: str, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)) or not str(value).strip():
        raise _bad(key, "a non-empty string", value)
    return str(value).strip()


def _auto_bool(key: str, value: Any) -> bool | None:
    text = str(value).strip().lower()
    if text in ("auto", "none"):
        return None
    if text in ("true", "1", "on", "yes"):
        return True
    if text in ("false", "0", "off", "no"):
        return False
    raise _bad(key, "auto, true or false", value)


def _check_keys(args: Mapping[str, Any], known: list[str]) -> None:
    """ModelArgsError for the first key not in `known`, with the closest known key as a hint."""
    for key in args:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ModelArgsError(f"model_args: unknown key {key!r}{hint}; known: {', '.join(known)}")


def _method(args: Mapping[str, Any], default_method: str | None) -> str | None:
    """The canonical method name, or None for ``none``."""
    method_arg = args.get("method", default_method if default_method is not None else NO_METHOD)
    method = _text("method", method_arg).lower()
    if method == NO_METHOD:
        return None
    from care_core.methods import canonical_name

    try:
        return canonical_name(method)
    except MethodError as exc:
        raise ModelArgsError(f"model_args: {exc}") from None


def _keep(value: Any) -> int | None:
    """``keep``: an integer >= 1 (or its digits), or None when not given."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _bad("keep", "an integer >= 1", value)
    return value


def _ratio(value: Any) -> float | None:
    """``ratio``: a number in (0, 1], or None when not given."""
    if value is None:
        return None
    try:
        ratio = float(value)
    except (TypeError, ValueError):
        raise _bad("ratio", "a number in (0, 1]", value) from None
    if isinstance(value, bool) or not 0 < ratio <= 1:
        raise _bad("ratio", "a number in (0, 1]", value)
    return ratio


def _budget(args: Mapping[str, Any], method: str | None) -> tuple[int | None, float | None]:
    """(keep, ratio): exactly one of them for a method, neither for ``none``."""
    keep = _keep(args.get("keep"))
    ratio = _ratio(args.get("ratio"))
    if method is None and (keep is not None or ratio is not None):
        raise ModelArgsError("model_args: method=none keeps every visual token; drop keep/ratio or name a method")
    if method is not None and (keep is None) == (ratio is None):
        raise ModelArgsError(f"model_args: method={method} needs exactly one budget: keep=K or ratio=R")
    return keep, ratio


def _config(args: Mapping[str, Any], hyper: set[str]) -> CaReConfig:
    """The CaReConfig with the hyperparameters named in `args` (numbers may come as text)."""
    values: dict[str, Any] = {}
    defaults = CaReConfig()
    for key in hyper & set(args):
        value = args[key]
        default = getattr(defaults, key)
        if isinstance(default, str):
            value = _text(key, value)
        elif isinstance(value, str):
            try:
                value = int(value) if isinstance(default, int) else float(value)
            except ValueError:
                raise _bad(key, "a number", value) from None
        values[key] = value
    try:
        return CaReConfig(**values)
    except ConfigError as exc:
        raise ModelArgsError(f"model_args: {exc}") from None


def parse_model_args(args: Mapping[str, Any], *, default_method: str | None = "care") -> EvalSpec:
    """An :class:`EvalSpec` from ``model_args`` key/values (strings, or numbers as lmms-eval parses them).

    ``method`` is a registered method (or alias) or ``none``; a method needs exactly one of ``keep`` (an integer
    >= 1) and ``ratio`` (in (0, 1]); ``none`` takes neither. CaReConfig fields (``lam``, ``m``, ``seed``, ...) set
    the hyperparameters; ``cuda_graph`` (auto, true, false) how answers are decoded. Anything else is a
    :class:`ModelArgsError` (one line).
    """
    hyper = set(CaReConfig.field_names())
    _check_keys(args, [*MODEL_KEYS, *sorted(hyper), *RUNNER_KEYS])
    pretrained = _text("pretrained", args.get("pretrained", DEFAULT_DEMO))
    method = _method(args, default_method)
    keep, ratio = _budget(args, method)
    config = _config(args, hyper)
    spec = EvalSpec(pretrained=pretrained, method=method, keep=keep, ratio=ratio,
                    device=_text("device", args.get("device", "auto")), dtype=_text("dtype", args.get("dtype", "auto")),
                    config=config, cuda_graph=_auto_bool("cuda_graph", args.get("cuda_graph", "auto")))  # fmt: skip
    try:
        spec.budget  # noqa: B018  (checks the budget)
    except BudgetError as exc:
        raise ModelArgsError(f"model_args: {exc}") from None
    return spec


def batch_arguments(args: Mapping[str, Any]) -> BatchSize:
    """``batch_size`` and ``max_batch_size`` (auto's cap) as lmms-eval's own CLI passes them in ``model_args``: it
    always passes ``batch_size`` (the int 1, or the text typed: ``"8"``, ``"auto"``, ``"auto:N"``) and
    ``max_batch_size`` (None or an int), read once here by care_core.batch_sizes's reader. ModelArgsError (one line)
    for anything else, e.g. ``"0"`` or ``"x"``."""
    try:
        return parse_batch_size(args.get("batch_size", 1), cap=args.get("max_batch_size"))
    except CareError as exc:
        raise ModelArgsError(str(exc)) from None
