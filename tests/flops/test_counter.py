"""Each analytic term against `torch.utils.flop_counter.FlopCounterMode` on real modules (within 0.1%)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, Qwen2Config, Qwen3_5TextConfig
from transformers.models.clip.modeling_clip import CLIPVisionModel
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
from transformers.models.llava.modeling_llava import LlavaMultiModalProjector
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VisionTransformerPretrainedModel,
    Qwen2_5_VLPatchMerger,
)
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel

from care_core.architecture import LanguageModelSpec, LinearAttentionSpec, ProjectorSpec, VisionSpec
from care_core.backbones.vision_encoder import encoder_hidden_states
from care_core.flops import formulas as fx
from care_core.flops.specs import KNOWN_BACKBONES

from ._counter import count_flops, cpu_sdpa_mapping

REL = 1e-3


def _close(counted: int, analytic: int) -> None:
    assert counted > 0
    assert abs(counted - analytic) <= REL * analytic, (counted, analytic, counted / analytic)


def _layer_flops(layer_cls, rotary_cls, config, w: int, device: str = "cpu") -> int:
    with torch.device(device):
        layer = layer_cls(config, layer_idx=0).eval()
        rotary = rotary_cls(config)
        hidden = torch.randn(1, w, config.hidden_size)
        positions = torch.arange(w)[None]
        embeddings = rotary(hidden, positions)
    total, _ = count_flops(lambda: layer(hidden, attention_mask=None, position_ids=positions,
                                         position_embeddings=embeddings))  # fmt: skip
    return total


def _lm(config) -> LanguageModelSpec:
    return LanguageModelSpec(
        layers=1, hidden=config.hidden_size, intermediate=config.intermediate_size,
        heads=config.num_attention_heads, kv_heads=config.num_key_value_heads, vocab=1,
    )  # fmt: skip


# (a) tiny decoder layers, real CPU compute ------------------------------------------------------------------
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("w", [7, 64, 586])
def test_tiny_llama_layer_matches_f_layer(attn: str, w: int) -> None:
    config = LlamaConfig(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=4,
                         num_hidden_layers=1, vocab_size=32)  # fmt: skip
    config._attn_implementation = attn
    counted = _layer_flops(LlamaDecoderLayer, LlamaRotaryEmbedding, config, w)
    lm = _lm(config)
    assert fx.layer_flops(w, lm) == fx.layer_flops(w, lm, gqa=True)  # MHA: both conventions agree
    assert fx.layer_flops(w, lm) == 8 * w * 64**2 + 6 * w * 64 * 160 + 4 * w * w * 64
    _close(counted, fx.layer_flops(w, lm))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_tiny_qwen2_gqa_layer_matches_gqa_formula(attn: str) -> None:
    config = Qwen2Config(hidden_size=64, intermediate_size=176, num_attention_heads=8, num_key_value_heads=2,
                         num_hidden_layers=1, vocab_size=32)  # fmt: skip
    config._attn_implementation = attn
    w = 150
    counted = _layer_flops(Qwen2DecoderLayer, Qwen2RotaryEmbedding, config, w)
    lm = _lm(config)
    _close(counted, fx.layer_flops(w, lm, gqa=True))
    assert fx.layer_flops(w, lm) > counted  # the plain 8WH² term over-counts K/V projections under GQA


def test_cpu_sdpa_op_counted_without_writing_torch_registry() -> None:
    from torch.utils.flop_counter import FlopCounterMode, flop_registry

    before = dict(flop_registry)
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    total, _ = count_flops(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
    assert total == 2 * (2 * 1 * 2 * 5 * 7 * 8)  # QKᵀ and AV: 2·b·h·s_q·s_k·d each
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    counter = FlopCounterMode(display=False, custom_mapping=cpu_sdpa_mapping())
    with counter:
        torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert counter.get_flop_counts()["Global"] == {op: total}  # counted as the CPU flash op itself
    assert flop_registry == before


# (b) full-size 7B decoder layers on the meta device -------------------------------------------------------
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("w", [64 + 64, 576 + 64, 2880 + 64])
def test_vicuna_7b_layer_on_meta(attn: str, w: int) -> None:
    spec = KNOWN_BACKBONES["llava-1.5-7b"].lm
    config = LlamaConfig(
        hidden_size=spec.hidden, intermediate_size=spec.intermediate, num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads, num_hidden_layers=1, max_position_embeddings=4096,
    )  # fmt: skip
    config._attn_implementation = attn
    _close(_layer_flops(LlamaDecoderLayer, LlamaRotaryEmbedding, config, w, "meta"), fx.layer_flops(w, spec))


@pytest.mark.parametrize("w", [111 + 64, 1110 + 64])
def test_qwen25_7b_layer_on_meta(w: int) -> None:
    spec = KNOWN_BACKBONES["qwen2.5-vl-7b"].lm
    config = Qwen2Config(
        hidden_size=spec.hidden, intermediate_size=spec.intermediate, num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads, num_hidden_layers=1, max_position_embeddings=32768,
    )  # fmt: skip
    config._attn_implementation = "eager"
    counted = _layer_flops(Qwen2DecoderLayer, Qwen2RotaryEmbedding, config, w, "meta")
    _close(counted, fx.layer_flops(w, spec, gqa=True))
    assert fx.layer_flops(w, spec) / counted > 1.05  # Supp. B's MHA count is ~9% high for Qwen2.5-7B


# (c) projectors: F_M(N) ------------------------------------------------------------------------------------
def _llava_projector(hidden: int) -> LlavaMultiModalProjector:
    vision = {"model_type": "clip_vision_model", "hidden_size": 1024, "num_attention_heads": 16}
    config = LlavaConfig(text_config={"model_type": "llama", "hidden_size": hidden}, vision_config=vision)
    with torch.device("meta"):
        return LlavaMultiModalProjector(config)


@pytest.mark.parametrize("name", ["llava-1.5-7b", "llava-1.5-13b", "llava-next-7b"])
def test_llava_projector_f_m(name: str) -> None:
    spec = KNOWN_BACKBONES[name]
    projector = _llava_projector(spec.lm.hidden)
    assert spec.projector.linears == ((projector.linear_1.in_features, projector.linear_1.out_features),
                                      (projector.linear_2.in_features, projector.linear_2.out_features))  # fmt: skip
    n = spec.default_tokens
    counted, _ = count_flops(lambda: projector(torch.empty(n, 1024, device="meta")))
    _close(counted, fx.projector_flops(spec.projector, n))


@pytest.mark.parametrize("name", ["qwen2.5-vl-7b", "qwen2.5-vl-3b"])
def test_qwen_merger_f_m(name: str) -> None:
    spec = KNOWN_BACKBONES[name]
    with torch.device("meta"):
        merger = Qwen2_5_VLPatchMerger(dim=spec.projector.out_dim, context_dim=1280, spatial_merge_size=2)
    n = spec.default_tokens
    counted, _ = count_flops(lambda: merger(torch.empty(4 * n, 1280, device="meta")))
    _close(counted, fx.projector_flops(spec.projector, n))
    assert spec.projector.token_dim == 4 * 1280


def test_internvl_projector_f_m_is_its_linears_plus_the_layer_norm() -> None:
    from transformers import InternVLConfig
    from transformers.models.internvl.modeling_internvl import InternVLMultiModalProjector

    spec = KNOWN_BACKBONES["internvl3-8b"]
    config = InternVLConfig(text_config={"model_type": "qwen2", "hidden_size": spec.lm.hidden})
    with torch.device("meta"):
        projector = InternVLMultiModalProjector(config)
    assert (projector.layer_norm.normalized_shape[0], projector.linear_1.in_features) == (4096, 4096)
    n = spec.default_tokens
    counted, _ = count_flops(lambda: projector(torch.empty(n, 4096, device="meta")))  # linears only (norms: 0)
    _close(counted + n * fx.LAYER_NORM_FLOPS_PER_ELEMENT * 4096, fx.projector_flops(spec.projector, n))


# (d) the score term: 2m F_M(N) = the projector on 2m·N rows (m perturbation pairs) -------------------------
@pytest.mark.parametrize("name", ["llava-1.5-7b", "qwen2.5-vl-7b"])
def test_score_term_is_projector_on_2mN_rows(name: str) -> None:
    spec, m = KNOWN_BACKBONES[name], 64
    n = spec.default_tokens
    terms = fx.score_terms(n, 128, m, spec.projector, spec.lm.hidden)
    if spec.family == "llava-1.5":
        module, rows = _llava_projector(spec.lm.hidden), torch.empty(2 * m * n, 1024, device="meta")
    else:
        with torch.device("meta"):
            module = Qwen2_5_VLPatchMerger(dim=spec.projector.out_dim, context_dim=1280, spatial_merge_size=2)
        rows = torch.empty(2 * m * n * 4, 1280, device="meta")
    counted, _ = count_flops(lambda: module(rows))
    _close(counted, terms["2mF_M(N)"])


# (e) the jvp engine's response terms, counted on the code path care_reduce runs (care_core.scoring) -----------
@pytest.mark.parametrize(("name", "n"), [("llava-1.5-7b", None), ("llava-next-7b", None), ("llava-next-7b", 100)])
def test_jvp_response_terms_match_the_jvp_code_path(name: str, n: int | None) -> None:
    from care_core.scoring import responses_jvp

    spec, m = KNOWN_BACKBONES[name], 64
    n = n or spec.default_tokens
    projector = _llava_projector(spec.lm.hidden)
    features = torch.empty(n, 1024, device="meta")
    directions = torch.empty(m, 1024, device="meta")
    counted, _ = count_flops(lambda: responses_jvp(features, projector, directions, "float32", kernel="torch"))
    terms = fx.jvp_response_terms(n, m, spec.projector)
    assert set(terms) == {"F_1(N)", "F_1(m)", "2mN d_h d_out"}
    _close(counted, sum(terms.values()))
    # Supp. B's 2mF_M(N) is 2.5x more at d_v = 1024, d_h = d_out = 4096: the jvp engine does not run it
    assert fx.score_terms(n, 1, m, spec.projector, spec.lm.hidden)["2mF_M(N)"] > 2.4 * sum(terms.values())


@pytest.mark.parametrize("n", [2880, 100])
def test_triangular_second_layer_terms_match_the_code_path(n: int) -> None:
    """--second-layer triangular: the PyTorch path's column blocks of W2's factor R, counted by FlopCounterMode."""
    from care_core._chunks import TRIANGULAR_BLOCKS
    from care_core.scoring import responses_jvp

    spec, m = KNOWN_BACKBONES["llava-next-7b"], 64
    projector = _llava_projector(spec.lm.hidden)
    features = torch.empty(n, 1024, device="meta")
    directions = torch.empty(m, 1024, device="meta")
    factor = torch.empty(4096, 4096, device="meta")  # R of W2 = QR (its values do not change the count)
    counted, _ = count_flops(
        lambda: responses_jvp(features, projector, directions, "float32", kernel="torch", factor=factor)
    )
    terms = fx.jvp_response_terms(n, m, spec.projector, "triangular", blocks=TRIANGULAR_BLOCKS)
    _close(counted, sum(terms.values()))
    # by hand: 4 blocks of 1024 columns need 4096, 3072, 2048, 1024 hidden units: 5/8 of 2mN·4096²
    assert terms["2mN R-triangle (4 blocks)"] == 2 * m * n * 4096 * 4096 * 5 // 8
    # the default counts the fused kernel's 256-column tiles: 17/32 of dense
    assert fx.jvp_response_terms(n, m, spec.projector, "triangular")["2mN R-triangle (16 blocks)"] == (
        2 * m * n * 4096 * 4096 * 17 // 32
    )


@pytest.mark.parametrize(("n", "m"), [(50, 8), (1110, 64)])  # one chunk of directions; 13 chunks of 5
def test_jvp_response_terms_of_the_qwen_merger_match_its_norm_first_path(n: int, m: int) -> None:
    """The merger (RMSNorm per patch, then Linear-GELU-Linear) takes the jvp engine's norm-first path; the generic
    torch.func.jvp path (forced by a plain function) still runs, per chunk, one primal pass and one product with the
    weights' zero tangent besides the chunk's tangents."""
    from care_core._chunks import two_pass_chunk
    from care_core.backbones.qwen2_5_vl.adapter import QwenMergerProjector
    from care_core.scoring import responses_jvp

    spec = KNOWN_BACKBONES["qwen2.5-vl-7b"]
    with torch.device("meta"):
        merger = Qwen2_5_VLPatchMerger(dim=spec.projector.out_dim, context_dim=1280, spatial_merge_size=2)
    projector = QwenMergerProjector(merger)
    features = torch.empty(n, spec.projector.token_dim, device="meta")
    directions = torch.empty(m, spec.projector.token_dim, device="meta")
    counted, _ = count_flops(lambda: responses_jvp(features, projector, directions, "float32", kernel="torch"))
    terms = fx.jvp_response_terms(n, m, spec.projector)
    _close(counted, sum(terms.values()))
    d, out = 5120, 3584  # 4 patches of 1280 -> 5120 -> 3584, no shift (RMSNorm)
    by_hand = 2 * n * d * d + 2 * m * d * d + 2 * m * n * d + 4 * m * n * 4 * d + 2 * m * n * d * out
    assert sum(terms.values()) == by_hand
    generic, _ = count_flops(lambda: responses_jvp(features, lambda v: projector(v), directions, "float32"))
    chunks = -(-m // two_pass_chunk(m, n, spec.projector.token_dim, spec.projector.out_dim))
    assert chunks == (1 if m == 8 else 13)
    f_m = fx.projector_flops(spec.projector, n)
    no_norm_path = replace(spec.projector, norm_blocks=0)  # what the count gives a projector on the generic path
    assert sum(fx.jvp_response_terms(n, m, no_norm_path).values()) == (m + 2 * chunks) * f_m  # Supp. B: 2 m F_M(N)
    width_probe = fx.projector_flops(spec.projector, 1)  # a plain function names no out_features: one row through it
    _close(generic - width_probe, (m + 2 * chunks) * f_m)


@pytest.mark.parametrize(("n", "m"), [(50, 8), (1280, 64)])
def test_jvp_response_terms_of_the_internvl_projector_match_its_norm_first_path(n: int, m: int) -> None:
    """InternVL's LayerNorm(4096) + MLP: one block, a shift (W1 β once); the LayerNorm's own 7 FLOPs per element
    on the N tokens, which FlopCounterMode counts 0, are added back as for F_M."""
    from transformers import InternVLConfig
    from transformers.models.internvl.modeling_internvl import InternVLMultiModalProjector

    from care_core._chunks import TRIANGULAR_BLOCKS
    from care_core.scoring import responses_jvp

    spec = KNOWN_BACKBONES["internvl3-8b"]
    config = InternVLConfig(text_config={"model_type": "qwen2", "hidden_size": spec.lm.hidden})
    with torch.device("meta"):
        projector = InternVLMultiModalProjector(config)
    features = torch.empty(n, 4096, device="meta")
    directions = torch.empty(m, 4096, device="meta")
    counted, _ = count_flops(lambda: responses_jvp(features, projector, directions, "float32", kernel="torch"))
    terms = fx.jvp_response_terms(n, m, spec.projector)
    _close(counted + n * fx.LAYER_NORM_FLOPS_PER_ELEMENT * 4096, sum(terms.values()))
    factor = torch.empty(3584, 3584, device="meta")  # R of W2 = QR, square (d_out = d_h)
    through_r, _ = count_flops(
        lambda: responses_jvp(features, projector, directions, "float32", kernel="torch", factor=factor)
    )
    terms = fx.jvp_response_terms(n, m, spec.projector, "triangular")
    assert f"2mN R-triangle ({TRIANGULAR_BLOCKS} blocks)" in terms  # the PyTorch path's blocks: no fused kernel here
    _close(through_r + n * fx.LAYER_NORM_FLOPS_PER_ELEMENT * 4096, sum(terms.values()))


# optional vision-tower term --------------------------------------------------------------------------------
def test_tiny_clip_tower_matches_formula() -> None:
    config = CLIPVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                              image_size=56, patch_size=14)  # fmt: skip
    config._attn_implementation = "eager"
    model = CLIPVisionModel(config).eval()
    spec = VisionSpec(kind="clip", layers=3, hidden=32, intermediate=48, heads=4, patch_size=14, image_size=56)
    counted, _ = count_flops(lambda: model(pixel_values=torch.randn(1, 3, 56, 56)))
    _close(counted, sum(fx.clip_tower_flops(spec).values()))


def test_the_clip_tower_care_runs_matches_the_formula_up_to_the_feature_layer() -> None:
    """care's encoder stops after hidden_states[-2] (care_core.backbones.vision_encoder): 2 of 3 layers counted."""
    config = CLIPVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                              image_size=56, patch_size=14)  # fmt: skip
    config._attn_implementation = "eager"
    model = CLIPVisionModel(config).eval()
    spec = VisionSpec(kind="clip", layers=3, hidden=32, intermediate=48, heads=4, patch_size=14, image_size=56,
                      layers_run=2)  # fmt: skip
    counted, _ = count_flops(lambda: encoder_hidden_states(model, torch.randn(1, 3, 56, 56), -2))
    _close(counted, sum(fx.clip_tower_flops(spec).values()))


@pytest.mark.parametrize("grid", [(8, 12), (10, 6)])
def test_tiny_qwen_vit_matches_formula(grid: tuple[int, int]) -> None:
    config = Qwen2_5_VLVisionConfig(depth=4, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=40,
                                    patch_size=14, spatial_merge_size=2, window_size=56, fullatt_block_indexes=[1],
                                    temporal_patch_size=2, in_channels=3)  # fmt: skip
    config._attn_implementation = "eager"
    model = Qwen2_5_VisionTransformerPretrainedModel(config).eval()
    rows, cols = grid  # patches; merged grid rows/2 × cols/2; windows of 56/2/14 = 2 merged units
    pixels = torch.randn(rows * cols, 3 * 2 * 14 * 14)
    _, per_module = count_flops(lambda: model(pixels, grid_thw=torch.tensor([[1, rows, cols]])))
    name = type(model).__name__
    merger = per_module[f"{name}.merger"]
    tower = per_module[name] - merger
    spec = VisionSpec(
        kind="qwen2.5-vit", layers=4, hidden=32, intermediate=48, heads=4, patch_size=14,
        temporal_patch_size=2, spatial_merge_size=2, window_size=56, full_attention_layers=(1,),
    )  # fmt: skip
    _close(tower, sum(fx.qwen_tower_flops(spec, rows // 2, cols // 2).values()))
    _close(merger, fx.projector_flops(ProjectorSpec("qwen2.5-vl merger", 128, ((128, 128), (128, 40))),
                                      rows * cols // 4))  # fmt: skip


@pytest.mark.parametrize(("n", "m"), [(50, 8), (1024, 64)])
def test_jvp_and_fd_response_terms_of_the_qwen3_merger_match_the_code_that_runs(n: int, m: int) -> None:
    """Qwen3-VL's main merger (LayerNorm per patch, then the MLP on 4·d_v) takes the jvp engine's norm-first path
    like Qwen2.5-VL's, dense or through W2's trapezoidal factor R (4096 x 4608); the fd engine costs Supp. B's
    2 m F_M(N)."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionPatchMerger

    from care_core.backbones.qwen3_vl.adapter import Qwen3VLMergerProjector
    from care_core.scoring import responses_fd, responses_jvp

    spec = KNOWN_BACKBONES["qwen3-vl-8b"]
    assert spec.projector.linears == ((4608, 4608), (4608, 4096))
    config = Qwen3VLVisionConfig(hidden_size=1152, out_hidden_size=spec.projector.out_dim, spatial_merge_size=2)
    with torch.device("meta"):
        projector = Qwen3VLMergerProjector(Qwen3VLVisionPatchMerger(config))
    features = torch.empty(n, spec.projector.token_dim, device="meta")
    directions = torch.empty(m, spec.projector.token_dim, device="meta")
    counted, _ = count_flops(lambda: responses_jvp(features, projector, directions, "float32", kernel="torch"))
    _close(counted, sum(fx.jvp_response_terms(n, m, spec.projector).values()))
    factor = torch.empty(4096, 4608, device="meta")  # R of the wide W2 = QR: upper trapezoidal
    through_r, _ = count_flops(
        lambda: responses_jvp(features, projector, directions, "float32", kernel="torch", factor=factor)
    )
    terms = fx.jvp_response_terms(n, m, spec.projector, "triangular")
    # by hand: output blocks of 1024 rows read hidden units 0.., 1024.., 2048.., 3072.. of 4608
    assert terms["2mN R-trapezoid (4 blocks)"] == 2 * m * n * (4608 + 3584 + 2560 + 1536) * 1024
    _close(through_r, sum(terms.values()))
    counted_fd, _ = count_flops(lambda: responses_fd(features, projector, directions, 1e-3))
    _close(counted_fd, fx.score_terms(n, 1, m, spec.projector, spec.lm.hidden)["2mF_M(N)"])


@pytest.mark.parametrize("grid", [(8, 12), (10, 6)])
def test_tiny_qwen3_vit_with_deepstack_mergers_matches_formula(grid: tuple[int, int]) -> None:
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    config = Qwen3VLVisionConfig(depth=4, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=40,
                                 patch_size=16, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                                 deepstack_visual_indexes=[1, 2])  # fmt: skip
    config._attn_implementation = "eager"
    model = Qwen3VLVisionModel(config).eval()
    rows, cols = grid  # patches; merged grid rows/2 × cols/2
    pixels = torch.randn(rows * cols, 3 * 2 * 16 * 16)
    _, per_module = count_flops(lambda: model(pixels, grid_thw=torch.tensor([[1, rows, cols]])))
    name = type(model).__name__
    merger = per_module[f"{name}.merger"]
    spec = VisionSpec(kind="qwen3-vit", layers=4, hidden=32, intermediate=48, heads=4, patch_size=16,
                      temporal_patch_size=2, spatial_merge_size=2, full_attention_layers=(0, 1, 2, 3),
                      deepstack_layers=(1, 2), out_hidden=40)  # fmt: skip
    terms = fx.VISION_TOWERS[spec.kind].flops(spec, rows // 2, cols // 2)  # the table the report counts with
    deepstack = sum(v for k, v in per_module.items() if k.startswith(f"{name}.deepstack_merger_list.") and
                    k.count(".") == 2)  # fmt: skip
    _close(deepstack, terms["deepstack_mergers"])
    _close(per_module[name] - merger, sum(terms.values()))
    _close(merger, fx.projector_flops(ProjectorSpec("qwen3-vl merger", 128, ((128, 128), (128, 40))),
                                      rows * cols // 4))  # fmt: skip


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("w", [5, 70])
def test_tiny_qwen3_5_hybrid_decoder_matches_prefill_flops(attn: str, w: int) -> None:
    # a Gated DeltaNet layer, then a gated full-attention layer (Qwen3.5's pattern), transformers' torch fallback;
    # W = 70 pads the delta rule's rows to two chunks of 64
    config = Qwen3_5TextConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, vocab_size=32, linear_num_key_heads=2,
                               linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=16,
                               linear_conv_kernel_dim=4,
                               layer_types=["linear_attention", "full_attention"])  # fmt: skip
    config._attn_implementation = attn
    model = Qwen3_5TextModel(config).eval()
    hidden = torch.randn(1, w, 64)
    counted, _ = count_flops(lambda: model(inputs_embeds=hidden, use_cache=False))
    gdn = LinearAttentionSpec(key_heads=2, value_heads=4, key_head_dim=8, value_head_dim=16, conv_kernel=4)
    lm = LanguageModelSpec(layers=2, hidden=64, intermediate=96, heads=4, kv_heads=2, vocab=32, head_dim=16,
                           attention_output_gate=True, linear_layers=(0,), linear_attention=gdn)  # fmt: skip
    assert counted == fx.prefill_flops(fx.uniform_schedule(lm, 0), lm, w, gqa=True)
