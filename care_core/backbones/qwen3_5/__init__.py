"""The Qwen3.5 family's record (dense ``qwen3_5``, ``Qwen3_5ForConditionalGeneration``, transformers 5.24): its facts,
demo and lmms-eval id (torch-free).

Qwen3-VL's vision tower and per-patch LayerNorm merger without DeepStack, Qwen2-VL's multimodal glue (M-RoPE from
``get_rope_index``, pre-encoded rows through ``mm_encoder_outputs``), and a hybrid decoder: three Gated DeltaNet
linear-attention layers to one full-attention layer. The adapter is ``adapter.py``, the demo builder ``demo.py``.

No ``care flops`` spec yet: ``LanguageModelSpec`` cannot say which layers are Gated DeltaNet, and no stored copy of a
released config (Qwen/Qwen3.5-9B, Qwen/Qwen3.5-27B) was found to take the numbers from.
"""

from __future__ import annotations

from care_core.backbones.families import BackboneFamily, DemoBackbone

_DEMO = "care_core.backbones.qwen3_5.demo"
_GEOMETRY = (
    "Qwen3.5 geometry (patch 16, 2x2 merge, resize factor 32, no deepstack; decoder of 3 Gated DeltaNet layers and "
    "1 full-attention layer)"
)

FAMILY = BackboneFamily(
    name="qwen3.5", rank=45, display="Qwen3.5", model_types=("qwen3_5",),
    adapter="care_core.backbones.qwen3_5.adapter:Qwen3_5Adapter", has_cls_token=False, single_grid=True, crops=False,
    flops_spec="qwen3.5-9b",  # names no spec yet (flops_specs is empty; see the module docstring)
    lmms_eval_model="care_qwen3_5",
    lm_attention_maps=False,  # layers 0-2 of every 4 are Gated DeltaNet: no attention map for FastV / SparseVLM
    demos=(
        DemoBackbone("tiny-qwen3.5-random", 1, "qwen3.5", f"{_DEMO}:build_tiny_qwen3_5",
                     f"{_GEOMETRY}, tiny random weights; demo only"),
    ),
)  # fmt: skip
