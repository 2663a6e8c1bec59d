"""VisionZip golden files: tensor-level (``visionzip_n*``) and end-to-end through a real HF CLIP (``_e2e_tinyclip``).

Tensor-level: our :func:`visionzip_reduce` on the stored layer -2 CLS attention rows, hidden state and metric, for
every ``k{K}_*`` budget (``D = len(k{K}_all_indices)``, ``C = K - D``).

End-to-end: an HF ``CLIPVisionModel`` (eager attention) built from the stored config and ``w.*`` weights; our
hook-up takes ``attentions[-2][0, :, 0]``, ``hidden_states[-2][0]`` and the head-mean of layer 22's
``k_proj(layer_norm1(hidden_states[22]))``, checks them against the stored mid-layer tensors, then runs the
tensor function. When the repository's probe adapter (``care_core.backbones.probes.clip_vision_probes``) is
importable, the registered ``visionzip`` method is also run on the probes it computes.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from care_core.methods.visionzip import VisionZip, visionzip_reduce
from golden_checks import CaseResult, compare

ATOL = 1e-5


def _budgets(data: dict[str, np.ndarray]) -> list[int]:
    return sorted({int(m.group(1)) for k in data if (m := re.match(r"k(\d+)_out_tokens$", k))})


def _check_outputs(
    data: dict[str, np.ndarray], hidden: torch.Tensor, cls_rows: torch.Tensor, metric: torch.Tensor, tag: str = ""
) -> list[CaseResult]:
    results = []
    for k in _budgets(data):
        expected_idx = data[f"k{k}_all_indices"]
        dominant = expected_idx.shape[0]
        out = visionzip_reduce(hidden, cls_rows, metric, dominant, k - dominant)
        results.append(compare(f"{tag}k{k} out_tokens", out.tokens.numpy(), data[f"k{k}_out_tokens"], ATOL))
        results.append(compare(f"{tag}k{k} all_indices", out.all_indices.numpy(), expected_idx))
        if f"k{k}_dominant_kept_sorted" in data:
            results.append(
                compare(
                    f"{tag}k{k} dominant_kept_sorted", out.dominant_sorted.numpy(), data[f"k{k}_dominant_kept_sorted"]
                )
            )
    return results


def _tiny_clip(data: dict[str, np.ndarray]) -> torch.nn.Module:
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


def clip_layer_inputs(model: torch.nn.Module, pixel_values: torch.Tensor, layer: int = -2) -> dict[str, torch.Tensor]:
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
        keys = keys.view(keys.shape[0], attn.num_heads, attn.head_dim).mean(dim=1)
    return {"cls_rows": out.attentions[index - 1][0, :, 0, :], "hidden": out.hidden_states[index][0], "keys": keys}


def _check_e2e(data: dict[str, np.ndarray]) -> list[CaseResult]:
    model = _tiny_clip(data)
    pixels = torch.from_numpy(data["in_pixel_values"])
    got = clip_layer_inputs(model, pixels)
    results = [
        compare("hookup attn_layerm2_cls_row", got["cls_rows"].numpy(), data["mid_attn_layerm2_cls_row"], ATOL),
        compare("hookup hidden_layerm2", got["hidden"].numpy(), data["mid_hidden_layerm2"], ATOL),
        compare("hookup metric_layerm2", got["keys"].numpy(), data["mid_metric_layerm2"], ATOL),
    ]
    results += _check_outputs(data, got["hidden"], got["cls_rows"], got["keys"])
    results += _check_adapter(data, model, pixels)
    return results


def _check_adapter(data: dict[str, np.ndarray], model: torch.nn.Module, pixels: torch.Tensor) -> list[CaseResult]:
    """The registered method on the repository's own vision probes (skipped when the adapter is unavailable)."""
    try:
        from care_core.backbones.probes import clip_vision_probes
    except ImportError:
        return []
    from care_core.methods import MethodInputs

    try:
        probes = clip_vision_probes(model, pixels, -2, {"cls_attention", "keys", "hidden_with_cls"})
    except Exception as error:  # report, don't crash the whole run
        return [CaseResult("adapter probes", False, float("nan"), f"clip_vision_probes failed: {error!r}")]
    hidden = probes["hidden_with_cls"]
    n = hidden.shape[0] - 1
    inputs = MethodInputs(hidden[1:], lambda x: x, torch.zeros(n, 2), probes=probes)
    results = []
    for k in _budgets(data):
        dominant = data[f"k{k}_all_indices"].shape[0]
        result = VisionZip(dominant=dominant)(inputs, k)
        results.append(compare(f"adapter k{k} out_tokens", result.tokens.numpy(), data[f"k{k}_out_tokens"], ATOL))
        results.append(
            compare(f"adapter k{k} all_indices", result.info["all_indices"].numpy(), data[f"k{k}_all_indices"])
        )
    return results


def check(data: dict[str, np.ndarray], filename: str) -> list[CaseResult]:
    if "in_pixel_values" in data:
        return _check_e2e(data)
    hidden = torch.from_numpy(data["in_hidden"])
    return _check_outputs(data, hidden, torch.from_numpy(data["in_attn_cls_row"]), torch.from_numpy(data["in_metric"]))
