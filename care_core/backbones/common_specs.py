"""``care flops`` building blocks that several families' records share (torch-free, plain data).

Sources:
- CLIP-L/14-336 (the LLaVA-1.5 and LLaVA-NeXT tower, ``vision_config`` of ``llava-hf/llava-1.5-7b-hf``): hidden 1024,
  intermediate 4096, 24 layers, 16 heads, image 336, patch 14; ``vision_feature_layer: -2`` and
  ``vision_feature_select_strategy: "default"`` hand on the 576 patch tokens (CLS dropped) of ``hidden_states[-2]``,
  the 23rd layer's output (the 24th is not run: care_core.backbones.vision_encoder).
- Vicuna-7B-v1.5: the ``llava-hf/llava-1.5-7b-hf`` ``text_config`` names ``lmsys/vicuna-7b-v1.5`` and sets only
  ``vocab_size: 32064``, so the rest are ``LlamaConfig`` defaults (L=32, H=4096, I=11008, 32 heads, 32 KV heads).
- Vicuna-13B-v1.5 (``llava-hf/llava-1.5-13b-hf``): L=40, H=5120, I=13824, 40 heads (MHA), vocab 32064.
- The LLaVA projector ``LlavaMultiModalProjector`` (``projector_hidden_act: "gelu"``):
  Linear(d_v, H) -> GELU -> Linear(H, H).
- The Qwen mergers: ``Qwen2_5_VLPatchMerger``: RMSNorm(d) -> view(-1, 4 d) -> Linear(4 d, 4 d) -> GELU ->
  Linear(4 d, out); ``Qwen3VLVisionPatchMerger`` the same with a LayerNorm(d).
"""

from __future__ import annotations

from care_core.architecture import LanguageModelSpec, ProjectorSpec, VisionSpec

CLIP_L336 = VisionSpec(kind="clip", layers=24, hidden=1024, intermediate=4096, heads=16, patch_size=14,
                       image_size=336, feature_tokens=576, layers_run=23)  # fmt: skip
VICUNA_7B = LanguageModelSpec(layers=32, hidden=4096, intermediate=11008, heads=32, kv_heads=32, vocab=32064)
VICUNA_13B = LanguageModelSpec(layers=40, hidden=5120, intermediate=13824, heads=40, kv_heads=40, vocab=32064)


def llava_projector(hidden: int, token_dim: int = 1024) -> ProjectorSpec:
    """LLaVA's two-layer GELU MLP from visual tokens of width ``token_dim`` to the language model's ``hidden``."""
    return ProjectorSpec(kind="mlp2x_gelu", token_dim=token_dim, linears=((token_dim, hidden), (hidden, hidden)))


def qwen_merger(out: int, vit_hidden: int = 1280, merge: int = 2, kind: str = "qwen2.5-vl merger") -> ProjectorSpec:
    """A Qwen merger (Qwen2.5-VL: RMSNorm per patch; Qwen3-VL: LayerNorm per patch, with a shift; norms cost 0):
    the MLP on the 4 · d_v group."""
    width = vit_hidden * merge * merge
    return ProjectorSpec(kind=kind, token_dim=width, linears=((width, width), (width, out)), norm_blocks=merge * merge,
                         norm_shift=kind == "qwen3-vl merger")  # fmt: skip
