"""model_args parsing (no lmms-eval needed): every key, the budget rules, one-line errors."""

from __future__ import annotations

import pytest

from care_core.budget import Budget
from care_core.config import CaReConfig
from care_core.integrations import EVAL_EXTRA_HINT, lmms_eval_missing
from care_core.integrations.settings import EvalSpec, ModelArgsError, parse_model_args


def test_defaults_and_values_as_lmms_eval_parses_them() -> None:
    spec = parse_model_args({"pretrained": "tiny-llava", "method": "care", "keep": 64, "lam": 1, "m": "16",
                             "engine": "fd", "seed": 7, "device": "cpu", "dtype": "float32"})  # fmt: skip
    assert spec.method == "care" and spec.keep == 64 and spec.ratio is None
    assert spec.budget == Budget.keep(64)
    assert spec.config == CaReConfig(lam=1.0, m=16, engine="fd", seed=7)
    assert spec.device == "cpu" and spec.dtype == "float32"
    assert spec.label == "care K=64" and spec.slug == "care-k64"


def test_none_alias_ratio_and_round_trip() -> None:
    none = parse_model_args({"pretrained": "tiny-llava", "method": "none"})
    assert none.method is None and none.budget is None and none.label == "none"
    assert parse_model_args({"method": "NONE"}).method is None
    spec = parse_model_args({"method": "VisionZip", "ratio": 0.25, "batch_size": "1"})
    assert spec.method == "visionzip" and spec.budget == Budget.ratio(0.25) and spec.slug == "visionzip-r0.25"
    again = dict(part.split("=", 1) for part in spec.model_args_string().split(","))
    assert parse_model_args(again) == spec


def test_cuda_graph_key() -> None:
    assert parse_model_args({"keep": 4}).cuda_graph is None
    for text, value in (("auto", None), ("true", True), ("On", True), ("0", False), ("false", False)):
        spec = parse_model_args({"keep": 4, "cuda_graph": text})
        assert spec.cuda_graph is value
        again = dict(part.split("=", 1) for part in spec.model_args_string().split(","))
        assert parse_model_args(again) == spec
    with pytest.raises(ModelArgsError, match="cuda_graph must be auto, true or false"):
        parse_model_args({"keep": 4, "cuda_graph": "sometimes"})
    # like the device, the decoding path moves float rounding only: the response cache is shared
    eager = EvalSpec(method="care", keep=64, cuda_graph=False)
    assert eager.fingerprint() == EvalSpec(method="care", keep=64).fingerprint()


def test_fingerprint_changes_with_what_changes_answers() -> None:
    base = EvalSpec(method="care", keep=64)
    assert base.fingerprint() == EvalSpec(method="care", keep=64, device="cuda").fingerprint()
    for other in (EvalSpec(method="care", keep=32), EvalSpec(method="random", keep=64),
                  EvalSpec(method="care", keep=64, config=CaReConfig(lam=0.3)), EvalSpec(method=None)):  # fmt: skip
        assert other.fingerprint() != base.fingerprint()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"pretraind": "x", "keep": 4}, "unknown key 'pretraind' (did you mean pretrained?)"),
        ({"method": "nosuch", "keep": 4}, "unknown method 'nosuch'"),
        ({"method": "care"}, "needs exactly one budget"),
        ({"method": "care", "keep": 4, "ratio": 0.5}, "needs exactly one budget"),
        ({"method": "none", "keep": 4}, "method=none keeps every visual token"),
        ({"keep": 0}, "keep must be an integer >= 1"),
        ({"keep": 2.5}, "keep must be an integer >= 1"),
        ({"keep": "many"}, "keep must be an integer >= 1"),
        ({"ratio": 1.5}, "ratio must be a number in (0, 1]"),
        ({"ratio": "half"}, "ratio must be a number in (0, 1]"),
        ({"keep": 4, "lam": -1}, "lam must be"),
        ({"keep": 4, "m": "lots"}, "m must be a number"),
        ({"keep": 4, "engine": "magic"}, "engine must be 'jvp' or 'fd'"),
        ({"keep": 4, "pretrained": ""}, "pretrained must be a non-empty string"),
    ],
)
def test_malformed_model_args_are_one_line_errors(args: dict[str, object], message: str) -> None:
    with pytest.raises(ModelArgsError) as info:
        parse_model_args(args)
    text = str(info.value)
    assert message in text and "\n" not in text and text.startswith("model_args: ")


def test_missing_extra_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lmms_eval" else real(name, *a))
    message = lmms_eval_missing()
    assert message is not None and EVAL_EXTRA_HINT in message and "\n" not in message


def test_care_eval_without_the_extra_exits_2_with_the_install_line(care, monkeypatch: pytest.MonkeyPatch) -> None:
    import care_core.integrations as integrations

    monkeypatch.setattr(integrations, "lmms_eval_missing", lambda: f"care eval needs lmms-eval: {EVAL_EXTRA_HINT}")
    result = care("eval", "--tasks", "anything", "--keep", "64")
    assert result.code == 2
    assert result.err.strip() == f"error: care eval needs lmms-eval: {EVAL_EXTRA_HINT}"
    assert result.out == ""


def test_a_torchvision_that_cannot_be_imported_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util
    import sys

    from care_core.integrations import broken_torchvision

    real = importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:
        return object() if name == "torchvision" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setitem(sys.modules, "torchvision", None)  # `import torchvision` now fails, as a mismatched build does
    message = broken_torchvision()
    assert message is not None and "pip uninstall torchvision" in message and "\n" not in message
