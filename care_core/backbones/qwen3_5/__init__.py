"""The Qwen3.5 family's record (dense ``qwen3_5``, ``Qwen3_5ForConditionalGeneration``, transformers 5.24): its facts,
demos, ``care flops`` specs and lmms-eval id (torch-free).

Qwen3-VL's vision tower and per-patch LayerNorm merger without DeepStack, Qwen2-VL's multimodal glue (M-RoPE from
``get_rope_index``, pre-encoded rows through ``mm_encoder_outputs``), and a hybrid decoder: three Gated DeltaNet
linear-attention layers to one full-attention layer (with an output gate). The adapter is ``adapter.py``, the demo
and full-size builders ``demo.py``.

Sources of the ``care flops`` numbers. No stored copy of the hub files ``Qwen/Qwen3.5-9B`` and ``Qwen/Qwen3.5-27B``
``config.json`` was found, so every number is **unchecked against the hub file**; each agrees across the independent
public copies named here:
- Qwen3.5-9B: text L=32, H=4096, I=12288, 16 heads / 4 KV heads of 256, vocab 248320; Gated DeltaNet 16 key heads
  and 32 value heads of 128, conv kernel 4, every 4th layer full attention (``full_attention_interval`` 4): the
  model card's architecture list (as reproduced on public pages, e.g. 2048ai.net "Qwen3.5-9B 官方文档总结"), the
  ``Qwen3_5TextConfig`` class defaults of transformers 5.24 (its docstring: "Qwen3.5-9B style"), and public test
  fixtures that copy the checkpoint's config.json (vision depth 27, hidden 1152, intermediate 4304, 16 heads,
  patch 16, spatial_merge_size 2, temporal_patch_size 2, out_hidden_size 4096, deepstack_visual_indexes []).
- Qwen3.5-27B, the largest dense size (the released Qwen3.5 sizes above it, 35B-A3B, 122B-A10B and 397B-A17B, are
  MoE): text L=64, H=5120, I=17408, 24 heads / 4 KV heads of 256, vocab 248320: ``THUDM/slime``
  ``scripts/models/qwen3.5-27B.sh``; Gated DeltaNet 16 key heads and 48 value heads of 128, conv kernel 4,
  interval 4, and the vision side (as 9B's, out_hidden_size 5120): public copies of its config.json (test fixtures
  and a ``Qwen3_5Config`` built with its values) and the GPTQ model cards built on it ("64 layers, 48 Gated
  DeltaNet, 16 full attention (24 Q / 4 KV heads, head_dim 256)").
- The processor's pixel budget (65536..16777216) is Qwen3-VL's assumed hub budget, unchecked for Qwen3.5 (the
  ``Qwen3VLProcessor`` class is the same). A real config.json through ``care flops --backbone <folder>`` (with its
  ``preprocessor_config.json``) gives exact dims.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from care_core.architecture import BackboneSpec, BackboneSpecError, LanguageModelSpec, LinearAttentionSpec
from care_core.backbones.common_specs import qwen_merger
from care_core.backbones.config_reading import positive
from care_core.backbones.families import OPTIONAL_WEIGHTS, BackboneFamily, DemoBackbone, FullSizeModel
from care_core.backbones.qwen2_5_vl import qwen_config, qwen_vit, with_pixel_budget
from care_core.backbones.qwen3_vl import QWEN3_VIT

_DEMO = "care_core.backbones.qwen3_5.demo"
_GEOMETRY = (
    "Qwen3.5 geometry (patch 16, 2x2 merge, resize factor 32, no deepstack; decoder of 3 Gated DeltaNet layers and "
    "1 full-attention layer)"
)
#: the real decoders' pattern (``full_attention_interval`` 4): layers 3, 7, 11, ... are full attention
FULL_ATTENTION_INTERVAL = 4
GDN_128 = dict(key_heads=16, key_head_dim=128, value_head_dim=128, conv_kernel=4)  # both sizes' key side and kernel


def linear_layer_indices(layers: int, interval: int = FULL_ATTENTION_INTERVAL) -> tuple[int, ...]:
    """The Gated DeltaNet layers of a decoder whose every ``interval``-th layer is full attention."""
    return tuple(i for i in range(layers) if (i + 1) % interval)


def _lm(layers: int, hidden: int, intermediate: int, heads: int, value_heads: int) -> LanguageModelSpec:
    return LanguageModelSpec(layers=layers, hidden=hidden, intermediate=intermediate, heads=heads, kv_heads=4,
                             vocab=248320, head_dim=256, attention_output_gate=True,
                             linear_layers=linear_layer_indices(layers),
                             linear_attention=LinearAttentionSpec(value_heads=value_heads, **GDN_128))  # fmt: skip


QWEN3_5_VIT = replace(QWEN3_VIT, deepstack_layers=(), out_hidden=0)  # Qwen3-VL's tower without DeepStack
MIN_PIXELS, MAX_PIXELS = 65536, 16777216  # unchecked (see the module docstring)
#: N of a 1024×1024 image and the budgets there (20 % and 10 %: there is no paper setting for Qwen3.5)
DEFAULT_IMAGE, DEFAULT_TOKENS, BUDGETS = (1024, 1024), 1024, (204, 102)
NOTE = "Qwen3.5 at 1024×1024: a 32×32 merged grid (not a paper setting; budgets 20 % and 10 % of N)"
_UNCHECKED = "no stored copy of the hub config.json; the numbers agree across public copies (record docstring)"


def _spec(size: str, lm: LanguageModelSpec, source: str) -> BackboneSpec:
    projector = qwen_merger(lm.hidden, QWEN3_5_VIT.hidden, kind="qwen3-vl merger")
    return BackboneSpec(
        f"qwen3.5-{size.lower()}", f"Qwen3.5-{size}", "qwen3.5", lm, projector, QWEN3_5_VIT, DEFAULT_TOKENS,
        f"{NOTE}; dims unchecked against the hub file", DEFAULT_IMAGE,
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, paper_budgets=BUDGETS, source=f"{source}; {_UNCHECKED}",
        aliases=(f"qwen/qwen3.5-{size.lower()}", f"qwen3_5-{size.lower()}", f"qwen35-{size.lower()}"),
    )  # fmt: skip


QWEN3_5_9B = _spec("9B", _lm(32, 4096, 12288, 16, 32), "Qwen/Qwen3.5-9B model card; Qwen3_5TextConfig defaults")
QWEN3_5_27B = _spec("27B", _lm(64, 5120, 17408, 24, 48), "THUDM/slime scripts/models/qwen3.5-27B.sh; config copies")

FAMILY = BackboneFamily(
    name="qwen3.5", rank=45, display="Qwen3.5", model_types=("qwen3_5",),
    adapter="care_core.backbones.qwen3_5.adapter:Qwen3_5Adapter", has_cls_token=False, single_grid=True, crops=False,
    flops_spec="qwen3.5-9b", lmms_eval_model="care_qwen3_5",
    lm_attention_maps=False,  # layers 0-2 of every 4 are Gated DeltaNet: no attention map for FastV / SparseVLM
    demos=(
        DemoBackbone("tiny-qwen3.5", 1, "qwen3.5", f"{_DEMO}:build_tiny_qwen3_5", f"{_GEOMETRY}, " + OPTIONAL_WEIGHTS,
                     weights="tiny-qwen3.5.safetensors", trained_builder=f"{_DEMO}:build_trained_tiny_qwen3_5"),
        DemoBackbone("tiny-qwen3.5-random", 1, "qwen3.5", f"{_DEMO}:build_tiny_qwen3_5",
                     f"{_GEOMETRY}, tiny random weights; demo only"),
    ),
    flops_specs=(QWEN3_5_9B, QWEN3_5_27B),
    flops_config="care_core.backbones.qwen3_5:spec_from_config",
    full_size=FullSizeModel(image_side_px=1024, builder=f"{_DEMO}:build_full_size"),
)  # fmt: skip


def hybrid_lm(text: Any, lm: LanguageModelSpec, path: Path) -> LanguageModelSpec:
    """``lm`` with the text config's Gated DeltaNet layers (``layer_types``) and widths, and the output gate."""
    types = list(getattr(text, "layer_types", None) or [])
    if len(types) != lm.layers or set(types) - {"linear_attention", "full_attention"}:
        raise BackboneSpecError(f"{path}: text_config.layer_types must name linear_attention or full_attention for "
                                f"each of the {lm.layers} layers")  # fmt: skip
    linear = tuple(i for i, kind in enumerate(types) if kind == "linear_attention")
    widths = LinearAttentionSpec(
        key_heads=positive(text.linear_num_key_heads, "linear_num_key_heads", path),
        value_heads=positive(text.linear_num_value_heads, "linear_num_value_heads", path),
        key_head_dim=positive(text.linear_key_head_dim, "linear_key_head_dim", path),
        value_head_dim=positive(text.linear_value_head_dim, "linear_value_head_dim", path),
        conv_kernel=positive(text.linear_conv_kernel_dim, "linear_conv_kernel_dim", path),
    )
    return replace(lm, attention_output_gate=True, linear_layers=linear, linear_attention=widths if linear else None)


def spec_from_config(raw: Mapping[str, Any], path: Path, family: BackboneFamily) -> BackboneSpec:
    """Qwen3-VL's full-attention ViT without deepstack on one merged grid, the hybrid decoder; N at 1024×1024."""
    config, lm = qwen_config(raw, path)
    vit, out = qwen_vit(config, path)
    vision = replace(QWEN3_5_VIT, full_attention_layers=tuple(range(vit["layers"])), **vit)
    projector = qwen_merger(out, vision.hidden, vision.spatial_merge_size, kind="qwen3-vl merger")
    spec = BackboneSpec(f"config:{path}", f"{family.display} (config)", family.name,
                        hybrid_lm(config.text_config, lm, path), projector, vision, DEFAULT_TOKENS, NOTE,
                        DEFAULT_IMAGE, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, paper_budgets=BUDGETS,
                        source=str(path))  # fmt: skip
    return with_pixel_budget(spec, path)
