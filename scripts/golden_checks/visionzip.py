"""VisionZip golden files: tensor-level (``visionzip_n*``) and end-to-end through a real HF CLIP (``_e2e_tinyclip``).

Tensor-level: our :func:`visionzip_reduce` on the stored layer -2 CLS attention rows, hidden state and metric, for
every ``k{K}_*`` budget (``D = len(k{K}_all_indices)``, ``C = K - D``). The stored tensors go straight into the
function, so float arrays compare within an absolute :data:`ATOL`.

End-to-end: an HF ``CLIPVisionModel`` (eager attention) built from the stored config and ``w.*`` weights; our
hook-up (:func:`clip_layer_inputs`) takes ``attentions[-2][0, :, 0]``, ``hidden_states[-2][0]`` and the head-mean
of layer 22's ``k_proj(layer_norm1(hidden_states[22]))``, checks them against the stored mid-layer tensors, then
runs the tensor function. When the repository's probe adapter (``care_core.backbones.probes.clip_vision_probes``)
is importable, the registered ``visionzip`` method is also run on the probes it computes. These float arrays come
out of 22 float32 encoder layers, so they compare relative to each array's largest magnitude
(:data:`E2E_RTOL`, docs/design/conventions.md §Golden tolerances); index arrays compare exactly.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import torch

from care_core.methods.visionzip import VisionZip, visionzip_reduce
from scripts.golden_checks import CaseResult, compare, compare_relative

ATOL = 1e-5  # tensor-level files: no accumulation between the stored inputs and the outputs

# End-to-end float arrays: |ours - stored| <= E2E_RTOL * max |stored|, per array. Against a float64 run of the
# same model, float32 rounding reaches 1.9e-6 of each array's largest magnitude (all six stored float arrays);
# two float32 runs on different CPUs (other BLAS kernels, FMA, thread splits) can therefore differ by about
# 4e-6 of it, and one AMD EPYC differed by 4.3e-7 (3.8e-5 absolute on tokens of magnitude 88). 1e-4 leaves a
# 25x margin over that worst case; the smallest hook-up mistake the tests simulate (keys of one head instead of
# the head mean: K = 8 tokens off by 0.9 on a magnitude of 81) is 1.1e-2 of the magnitude, 100x the bound.
E2E_RTOL = 1e-4

Hookup = Callable[[torch.nn.Module, torch.Tensor], dict[str, torch.Tensor]]
Compare = Callable[[str, object, np.ndarray], CaseResult]


def _absolute(case: str, ours: object, expected: np.ndarray) -> CaseResult:
    return compare(case, ours, expected, ATOL)


def _relative(case: str, ours: object, expected: np.ndarray) -> CaseResult:
    return compare_relative(case, ours, expected, E2E_RTOL)


def _budgets(data: dict[str, np.ndarray]) -> list[int]:
    return sorted({int(m.group(1)) for k in data if (m := re.match(r"k(\d+)_out_tokens$", k))})


def _check_outputs(
    data: dict[str, np.ndarray],
    hidden: torch.Tensor,
    cls_rows: torch.Tensor,
    metric: torch.Tensor,
    tag: str = "",
    close: Compare = _absolute,
) -> list[CaseResult]:
    results = []
    for k in _budgets(data):
        expected_idx = data[f"k{k}_all_indices"]
        dominant = expected_idx.shape[0]
        out = visionzip_reduce(hidden, cls_rows, metric, dominant, k - dominant)
        results.append(close(f"{tag}k{k} out_tokens", out.tokens.numpy(), data[f"k{k}_out_tokens"]))
        results.append(compare(f"{tag}k{k} all_indices", out.all_indices.numpy(), expected_idx))
        if f"k{k}_dominant_kept_sorted" in data:
            results.append(
                compare(
                    f"{tag}k{k} dominant_kept_sorted", out.dominant_sorted.numpy(), data[f"k{k}_dominant_kept_sorted"]
                )
            )
    return results


def tiny_clip(data: dict[str, np.ndarray]) -> torch.nn.Module:
    """The stored tiny CLIPVisionModel (eager attention), weights keyed for 4.x or 5.x module layouts."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    config = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=24, num_attention_heads=2, image_size=336, patch_size=14
    )
    config._attn_implementation = "eager"
    model = CLIPVisionModel(config).eval()
    own = model.state_dict().keys()
    state = {}
    for key, value in data.items():
        if not key.startswith("w."):
            continue
        name = key[2:]
        if name not in own and name.startswith("vision_model."):  # 5.x dropped the .vision_model level
            name = name[len("vision_model.") :]
        state[name] = torch.from_numpy(value)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or any(not m.endswith("position_ids") for m in missing):
        raise RuntimeError(f"tiny CLIP weights do not fit: missing {missing}, unexpected {unexpected}")
    return model


def head_mean(keys: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """(T, H * d_head) projected keys -> (T, d_head): split into heads (head-major, as HF does), mean over heads."""
    return keys.view(keys.shape[0], num_heads, head_dim).mean(dim=1)


def clip_layer_inputs(
    model: torch.nn.Module,
    pixel_values: torch.Tensor,
    layer: int = -2,
    reduce_heads: Callable[[torch.Tensor, int, int], torch.Tensor] = head_mean,
) -> dict[str, torch.Tensor]:
    """VisionZip's three inputs from one eager forward: CLS attention rows, hidden state, head-mean keys."""
    encoder = getattr(model, "encoder", None)
    if encoder is None:  # transformers 4.x layout
        encoder = model.vision_model.encoder
    num_layers = len(encoder.layers)
    index = layer if layer >= 0 else num_layers + 1 + layer  # into hidden_states (num_layers + 1 entries)
    block = encoder.layers[index - 1]  # hidden_states[index] is the output of block index - 1
    with torch.no_grad():
        out = model(pixel_values=pixel_values, output_hidden_states=True, output_attentions=True)
        attn = block.self_attn
        keys = attn.k_proj(block.layer_norm1(out.hidden_states[index - 1][0]))
        keys = reduce_heads(keys, attn.num_heads, attn.head_dim)
    return {"cls_rows": out.attentions[index - 1][0, :, 0, :], "hidden": out.hidden_states[index][0], "keys": keys}


def check_e2e(
    data: dict[str, np.ndarray], hookup: Hookup = clip_layer_inputs, adapter_layer: int | None = -2
) -> list[CaseResult]:
    """The end-to-end cases with a given hook-up (tests pass deliberately wrong ones); ``adapter_layer`` is the
    feature layer handed to the repository's probe adapter (None: skip the adapter cases)."""
    model = tiny_clip(data)
    pixels = torch.from_numpy(data["in_pixel_values"])
    got = hookup(model, pixels)
    results = [
        _relative("hookup attn_layerm2_cls_row", got["cls_rows"].numpy(), data["mid_attn_layerm2_cls_row"]),
        _relative("hookup hidden_layerm2", got["hidden"].numpy(), data["mid_hidden_layerm2"]),
        _relative("hookup metric_layerm2", got["keys"].numpy(), data["mid_metric_layerm2"]),
    ]
    results += _check_outputs(data, got["hidden"], got["cls_rows"], got["keys"], close=_relative)
    if adapter_layer is not None:
        results += _check_adapter(data, model, pixels, adapter_layer)
    return results


def _check_adapter(
    data: dict[str, np.ndarray], model: torch.nn.Module, pixels: torch.Tensor, feature_layer: int = -2
) -> list[CaseResult]:
    """The registered method on the repository's own vision probes (skipped when the adapter is unavailable)."""
    try:
        from care_core.backbones.probes import clip_vision_probes
    except ImportError:
        return []
    from care_core.methods import MethodInputs

    try:
        probes = clip_vision_probes(model, pixels, feature_layer, {"cls_attention", "keys", "hidden_with_cls"})
    except Exception as error:  # report, don't crash the whole run
        return [CaseResult("adapter probes", False, float("nan"), f"clip_vision_probes failed: {error!r}")]
    hidden = probes["hidden_with_cls"]
    n = hidden.shape[0] - 1
    inputs = MethodInputs(hidden[1:], lambda x: x, torch.zeros(n, 2), probes=probes)
    results = []
    for k in _budgets(data):
        dominant = data[f"k{k}_all_indices"].shape[0]
        result = VisionZip(dominant=dominant)(inputs, k)
        results.append(_relative(f"adapter k{k} out_tokens", result.tokens.numpy(), data[f"k{k}_out_tokens"]))
        results.append(
            compare(f"adapter k{k} all_indices", result.info["all_indices"].numpy(), data[f"k{k}_all_indices"])
        )
    return results


def check(data: dict[str, np.ndarray], filename: str) -> list[CaseResult]:
    if "in_pixel_values" in data:
        return check_e2e(data)
    hidden = torch.from_numpy(data["in_hidden"])
    return _check_outputs(data, hidden, torch.from_numpy(data["in_attn_cls_row"]), torch.from_numpy(data["in_metric"]))
