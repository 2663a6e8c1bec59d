"""Supp. B term by term, the paper's baseline rows, conventions, schedules and equivalent token counts."""

from __future__ import annotations

import itertools

import pytest

from care_core.architecture import LanguageModelSpec, LinearAttentionSpec
from care_core.flops import formulas as fx
from care_core.flops.methods import cost_model_names, method_cost, sparsevlm_counts
from care_core.flops.report import FlopsOptions, flops_report
from care_core.flops.specs import KNOWN_BACKBONES


@pytest.mark.parametrize(("name", "n", "paper"), [("llava-1.5-7b", 576, 8.54), ("llava-next-7b", 2880, 42.7),
                                                  ("qwen2.5-vl-7b", 1110, 17.3)])  # fmt: skip
def test_paper_baselines_within_half_a_percent(name: str, n: int, paper: float) -> None:
    spec = KNOWN_BACKBONES[name]
    assert spec.default_tokens == n
    ours = fx.to_unit(fx.prefill_flops(fx.uniform_schedule(spec.lm, n), spec.lm, 64))
    assert abs(ours - paper) / paper < 0.005, ours


def test_spec_numbers_quoted() -> None:
    # the exact figures of docs/design/measures.md §Paper issues: 8.50 / 42.67 / 17.32
    got = [round(fx.to_unit(fx.prefill_flops(((s.lm.layers, s.default_tokens),), s.lm, 64)), 2)
           for s in (KNOWN_BACKBONES[n] for n in ("llava-1.5-7b", "llava-next-7b", "qwen2.5-vl-7b"))]  # fmt: skip
    assert got == [8.50, 42.67, 17.32]


def test_care_terms_as_spec_writes_them() -> None:
    spec = KNOWN_BACKBONES["llava-1.5-7b"]
    n, k, m, t = 576, 192, 64, 64
    cost = method_cost("care", spec, n, k, m, t, engine="fd")
    f_m = 2 * n * (1024 * 4096 + 4096 * 4096)
    assert fx.projector_flops(spec.projector, n) == f_m
    assert sum(cost.score.values()) == 2 * m * f_m + m * n * 4096 + n * n * 1024 + k * n
    # the jvp engine (the default): first layer on N tokens and on m directions, second layer on m·N tangents
    jvp = method_cost("care", spec, n, k, m, t)
    first, second = 2 * 1024 * 4096, 2 * 4096 * 4096
    assert sum(jvp.score.values()) == n * first + m * first + m * n * second + m * n * 4096 + n * n * 1024 + k * n
    assert jvp.residual == cost.residual and jvp.schedule == cost.schedule
    assert sum(cost.residual.values()) == (n - k) * k * 1024 + (n - k) * k
    w = t + k
    layer = 8 * w * 4096**2 + 6 * w * 4096 * 11008 + 4 * w * w * 4096
    assert fx.prefill_flops(cost.schedule, spec.lm, t) == 32 * layer


@pytest.mark.parametrize(
    ("name", "d", "d_h", "d_out", "blocks", "shift", "layer_norm"),
    [("qwen2.5-vl-7b", 5120, 5120, 3584, 4, False, 0), ("qwen3-vl-8b", 4608, 4608, 4096, 4, True, 0),
     ("internvl3-8b", 4096, 3584, 3584, 1, True, 4096)],
)  # fmt: skip
def test_care_jvp_terms_of_norm_first_projectors_by_hand(
    name: str, d: int, d_h: int, d_out: int, blocks: int, shift: bool, layer_norm: int
) -> None:
    """The jvp engine's norm-first path: per-block first layer on the N tokens, W1 on the m directions, W1 β once
    (a LayerNorm's shift), the (N, m) inner products per block, the two products that combine them, the second
    layer on m·N tangents (dense, or through R: triangle or trapezoid in 4 column blocks)."""
    spec, n, k, m = KNOWN_BACKBONES[name], 1000, 100, 64
    selection = m * n * spec.lm.hidden + n * n * d + k * n
    first = 2 * n * d * d_h + 2 * m * d * d_h + (2 * d * d_h if shift else 0) + n * 7 * layer_norm
    through_norm = 2 * m * n * d + 4 * m * n * blocks * d_h
    dense = method_cost("care", spec, n, k, m)
    assert sum(dense.score.values()) == first + through_norm + 2 * m * n * d_h * d_out + selection
    assert "norm-first" in dense.note
    factor = method_cost("care", spec, n, k, m, second_layer="triangular")
    rows = min(d_h, d_out)  # R is (rows, d_h); block [lo, hi) of its rows reads hidden units lo..
    edges = [rows * b // 4 for b in range(5)]
    upper = sum((d_h - lo) * (hi - lo) for lo, hi in itertools.pairwise(edges))
    assert sum(factor.score.values()) == first + through_norm + 2 * m * n * upper + selection
    # Supp. B's 2 m F_M(N) (the fd engine) is over 4x the jvp engine's score work on these projectors
    assert sum(method_cost("care", spec, n, k, m, engine="fd").score.values()) > 4 * sum(dense.score.values())


def test_spec_projector_gap_figure() -> None:
    # docs/design/measures.md §Paper issues: at 640 LLaVA-NeXT tokens the formula's 2 m F_M(N) alone is ~15.5 TFLOPs
    cost = method_cost("care", KNOWN_BACKBONES["llava-next-7b"], 2880, 640, engine="fd")
    assert round(fx.to_unit(cost.score["2mF_M(N)"]), 1) == 15.5


@pytest.mark.parametrize("method", ["care", "prca-only", "prca+simple-calib"])
def test_prca_methods_follow_the_engine_zoo_anchors_do_not(method: str) -> None:
    spec = KNOWN_BACKBONES["llava-next-7b"]
    assert "2mF_M(N)" in method_cost(method, spec, 2880, 160, engine="fd").score
    assert "2mN d_h d_out" in method_cost(method, spec, 2880, 160, engine="jvp").score
    for zoo in ("zoo-prune", "simple-calib", "confidence-calib"):  # always finite differences, as ZOO-Prune defines
        assert method_cost(zoo, spec, 2880, 160, engine="jvp") == method_cost(zoo, spec, 2880, 160, engine="fd")


def test_macs_are_half_of_flops() -> None:
    spec = KNOWN_BACKBONES["llava-next-7b"]
    flops = flops_report(spec, keeps=[640], methods=["care", "fastv"], options=FlopsOptions())
    macs = flops_report(spec, keeps=[640], methods=["care", "fastv"], options=FlopsOptions(convention="macs"))
    assert macs["unit"] == "TMACs" and flops["unit"] == "TFLOPs"
    for a, b in zip(flops["rows"], macs["rows"], strict=True):
        assert b["tflops"] == a["tflops"] and b["tmacs"] == pytest.approx(a["tflops"] / 2)
        assert b["terms_tmacs"]["score"] == pytest.approx(a["terms"]["score"] / 2)


def test_gqa_changes_only_grouped_models() -> None:
    vicuna, qwen = KNOWN_BACKBONES["llava-1.5-7b"].lm, KNOWN_BACKBONES["qwen2.5-vl-7b"].lm
    assert fx.layer_flops(640, vicuna, gqa=True) == fx.layer_flops(640, vicuna)
    assert fx.layer_flops(640, qwen, gqa=True) < fx.layer_flops(640, qwen)
    # hf_internals.md §5: Qwen2-7B dims at W = 640 count 304.171 GFLOP; the MHA formula gives 332.357
    assert round(fx.layer_flops(640, qwen, gqa=True) / 1e9, 3) == 304.171
    assert round(fx.layer_flops(640, qwen) / 1e9, 3) == 332.357


def test_equivalent_tokens() -> None:
    lm = KNOWN_BACKBONES["llava-1.5-7b"].lm
    assert fx.equivalent_tokens(((32, 192),), lm, 64) == pytest.approx(192)
    fastv = method_cost("fastv", KNOWN_BACKBONES["llava-1.5-7b"], 576, 192)
    assert fastv.schedule == ((2, 576), (30, 192))
    assert fx.layer_average_tokens(fastv.schedule) == pytest.approx((2 * 576 + 30 * 192) / 32)
    eq = fx.equivalent_tokens(fastv.schedule, lm, 64)
    assert 192 < eq < 576
    assert fx.prefill_flops(fastv.schedule, lm, 64) == pytest.approx(fx.prefill_flops(((32, eq),), lm, 64), rel=1e-9)


def test_sparsevlm_published_schedule() -> None:
    counts, pruned, clusters, _ = sparsevlm_counts(576, 192)
    assert [c - cl for c, cl in zip(counts, clusters, strict=True)] == [300, 200, 110]
    assert pruned[0] == 276 and clusters[0] == 9  # int(276·0.3)+1 = 83 recycled -> int(83/10)+1 = 9 centres
    cost = method_cost("sparsevlm", KNOWN_BACKBONES["llava-1.5-7b"], 576, 192)
    assert cost.schedule == ((3, 576), (4, counts[0]), (9, counts[1]), (16, counts[2]))


def test_sparsevlm_k96_uses_its_published_schedule() -> None:
    """K = 96 on LLaVA-1.5-7B (N = 576): SparseVLM v1 publishes keep (238, 48, 26) after layers 2, 6, 15 (score.py
    RETAIN_TOKN=96); each stage also recycles int((int(0.3 p) + 1) / 10) + 1 cluster centres of its p pruned tokens:
    576 -> 238 kept, p = 338, 102 recycled, 11 centres: 249; -> 48, p = 201, 61 recycled, 7 centres: 55;
    -> 26, p = 29, 9 recycled, 1 centre: 27. A pruning layer still runs at the previous length, so layers 0-2 see
    576, 3-6 see 249, 7-15 see 55 and 16-31 see 27."""
    report = flops_report(KNOWN_BACKBONES["llava-1.5-7b"], keeps=[96], methods=["sparsevlm"])
    row = report["rows"][1]
    assert row["schedule"] == [[3, 576], [4, 249], [9, 55], [16, 27]]
    h, i, t = 4096, 11008, 64  # Vicuna-7B hidden and FFN widths; T = 64 text tokens (the report's default)

    def layer(w: int) -> int:  # Supp. B: F_layer = 8 W H^2 + 6 W H I + 4 W^2 H
        return 8 * w * h * h + 6 * w * h * i + 4 * w * w * h

    prefill = 3 * layer(t + 576) + 4 * layer(t + 249) + 9 * layer(t + 55) + 16 * layer(t + 27)
    assert prefill == 2_337_484_259_328
    assert row["terms"]["prefill"] == pytest.approx(prefill / 1e12, rel=1e-12)


def test_every_method_covers_all_layers_and_is_non_negative() -> None:
    for spec in KNOWN_BACKBONES.values():
        n = spec.default_tokens
        for name in ["baseline", *cost_model_names()]:
            for k in (1, n // 9, n // 3, n):
                cost = method_cost(name, spec, n, k)
                assert sum(layers for layers, _ in cost.schedule) == spec.lm.layers, (spec.name, name, k)
                assert all(v >= 0 for v in [*cost.score.values(), *cost.residual.values()])
                assert all(t >= 1 for _, t in cost.schedule)


def test_pre_llm_methods_prefill_equals_care() -> None:
    spec = KNOWN_BACKBONES["llava-1.5-7b"]
    care = fx.prefill_flops(method_cost("care", spec, 576, 128).schedule, spec.lm, 64)
    for name in ("zoo-prune", "divprune", "visionzip", "tome", "random", "pool", "ficoco-v"):
        assert fx.prefill_flops(method_cost(name, spec, 576, 128).schedule, spec.lm, 64) == care


def test_optional_terms() -> None:
    spec = KNOWN_BACKBONES["llava-1.5-7b"]
    assert fx.lm_head_flops(spec.lm) == 2 * 4096 * 32064
    report = flops_report(spec, keeps=[64], options=FlopsOptions(lm_head=True, vision_tower=True))
    row = report["rows"][0]
    assert set(row["terms"]) == {"score", "residual", "prefill", "lm_head", "vision_tower"}
    assert row["tflops"] == pytest.approx(sum(row["terms"].values()))
    # CLIP-L/14-336: 23 of its 24 layers at T = 577 (the features are hidden_states[-2]) + the patch conv
    t, d = 577, 1024
    clip = 23 * (8 * t * d * d + 4 * t * d * 4096 + 4 * t * t * d) + 2 * 576 * d * 3 * 14 * 14
    assert row["terms"]["vision_tower"] == pytest.approx(clip / 1e12)
    assert set(report["options"]["optional_terms"]) == {"lm_head", "vision_tower"}


def test_schedule_must_cover_the_model() -> None:
    with pytest.raises(ValueError):
        fx.check_schedule([(3, 10)], KNOWN_BACKBONES["llava-1.5-7b"].lm)


# a hybrid decoder (Qwen3.5's form): layer 0 Gated DeltaNet, layer 1 attention with an output gate
_GDN = LinearAttentionSpec(key_heads=1, value_heads=2, key_head_dim=4, value_head_dim=2, conv_kernel=3, chunk=4)
_HYBRID = LanguageModelSpec(layers=2, hidden=8, intermediate=16, heads=2, kv_heads=1, vocab=10, head_dim=4,
                            attention_output_gate=True, linear_layers=(0,), linear_attention=_GDN)  # fmt: skip


def test_hybrid_decoder_prefill_counted_by_hand() -> None:
    # W = 5 rows; H 8, I 16; Gated DeltaNet kd = 1·4 = 4, vd = 2·2 = 4, n_v 2, kernel 3, chunk 4 (W_p = 8).
    # linear layer: in_proj_qkv 2·5·8·(8+4) = 960, in_proj_z 2·5·8·4 = 320, in_proj_b+a 4·5·8·2 = 320,
    #   out_proj 2·5·4·8 = 320 -> 1920; conv 2·12·3·(5+2) = 504; rule 2·8·(4·4·4 + 6·4·2 + 2·4·2) = 2·8·128 = 2048;
    #   FFN 6·5·8·16 = 3840 -> 8312
    # attention layer, gqa (q_dim 8, kv_dim 4): q,o 4·5·8·8 = 1280, k,v 4·5·8·4 = 640, gate 2·5·8·8 = 640 -> 2560;
    #   QK^T, AV 4·25·8 = 800; FFN 3840 -> 7200.  Without gqa: 8·5·64 + gate 2·5·64 = 3200, 4·25·8 = 800 -> 7840
    linear = fx.gated_deltanet_terms(5, _HYBRID)
    assert (linear.projections, linear.attention, linear.ffn) == (1920, 504 + 2048, 3840)
    schedule = fx.uniform_schedule(_HYBRID, 0)
    assert fx.prefill_flops(schedule, _HYBRID, 5, gqa=True) == 8312 + 7200
    assert fx.prefill_flops(schedule, _HYBRID, 5) == 8312 + 7840
    assert fx.prefill_breakdown(schedule, _HYBRID, 5, gqa=True) == {"projections": 1920 + 2560, "ffn": 2 * 3840,
                                                                    "attention": 2552 + 800}  # fmt: skip


def test_a_schedule_segment_counts_each_layer_by_its_kind() -> None:
    # one layer each: the first segment is the Gated DeltaNet layer at W = 5, the second the attention one at W = 3
    split = ((1, 2), (1, 0))
    assert fx.prefill_flops(split, _HYBRID, 3, gqa=True) == (fx.gated_deltanet_terms(5, _HYBRID).total
                                                             + fx.layer_flops(3, _HYBRID, gqa=True))  # fmt: skip


@pytest.mark.parametrize("k", [1, 37, 204, 1024])
def test_equivalent_tokens_of_a_uniform_hybrid_schedule_is_its_tokens(k: int) -> None:
    lm = KNOWN_BACKBONES["qwen3.5-9b"].lm
    assert fx.equivalent_tokens(fx.uniform_schedule(lm, k), lm, 64) == pytest.approx(k, abs=1e-6)
    # half the layers at 2K, half at none: the linear terms average to K, the W² terms (convex) a little above
    assert k < fx.equivalent_tokens(((16, 2 * k), (16, 0)), lm, 64) < 2 * k


def test_attention_only_models_are_counted_as_before() -> None:
    # the hybrid fields' defaults leave a plain decoder as Supp. B writes it (8WH² + 6WHI + 4W²H per layer)
    lm = LanguageModelSpec(layers=3, hidden=8, intermediate=16, heads=2, kv_heads=2, vocab=10)
    assert fx.prefill_flops(fx.uniform_schedule(lm, 2), lm, 3) == 3 * (8 * 5 * 64 + 6 * 5 * 8 * 16 + 4 * 25 * 8)
