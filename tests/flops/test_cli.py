"""`care flops` via the CLI: the table, --json (docs/design/conventions.md §Conventions), --paper, errors (exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_acceptance_table_llava_next(care) -> None:
    run = care("flops", "--backbone", "llava-next", "--keep", "640", "--keep", "320", "--keep", "160", "--paper")
    assert run.code == 0, run.err
    assert run.err == ""
    out = run.out
    assert "LLaVA-NeXT-7B" in out and "TFLOPs" in out and "constant 1" in out and "T = 64" in out
    for figure in ("42.675", "42.700", "12.500", "8.200", "6.100", "6.219", "15.47"):  # ours, the paper's, jvp, fd
        assert figure in out, figure
    assert "Paper Table S1" in out and "Why the CaRe rows differ" in out and "closest: jvp" in out
    assert "jvp engine" in out and "adopt none" in out


def test_engine_jvp_scoring_term_and_fd_keeps_supp_b(care) -> None:
    """The acceptance command: the jvp scoring term is what the jvp code path runs (counted with FlopCounterMode
    in tests/flops/test_counter.py); --engine fd keeps Supp. B's numbers; the default is the library's (jvp)."""
    from care_core.config import CaReConfig

    jvp = care("flops", "--backbone", "llava-next", "--keep", "160", "--engine", "jvp", "--json").json()
    fd = care("flops", "--backbone", "llava-next", "--keep", "160", "--engine", "fd", "--json").json()
    default = care("flops", "--backbone", "llava-next", "--keep", "160", "--json").json()
    assert CaReConfig().engine == "jvp" and default["rows"] == jvp["rows"]
    assert jvp["options"]["engine"] == "jvp" and fd["options"]["engine"] == "fd"
    n, m = 2880, 64
    responses = 2 * n * 1024 * 4096 + 2 * m * 1024 * 4096 + 2 * m * n * 4096 * 4096
    selection = m * n * 4096 + n * n * 1024 + 160 * n
    care_jvp, care_fd = jvp["rows"][1], fd["rows"][1]
    assert care_jvp["engine"] == "jvp" and jvp["rows"][0]["engine"] is None
    assert care_jvp["terms"]["score"] == pytest.approx((responses + selection) / 1e12, rel=1e-12)
    assert care_jvp["breakdown"]["score"]["2mN d_h d_out"] == pytest.approx(2 * m * n * 4096**2 / 1e12)
    f_m = 2 * n * (1024 * 4096 + 4096 * 4096)
    assert care_fd["terms"]["score"] == pytest.approx((2 * m * f_m + selection) / 1e12, rel=1e-12)
    assert round(care_fd["terms"]["score"], 1) == 15.5 and round(care_jvp["terms"]["score"], 1) == 6.2
    assert care_fd["terms"]["prefill"] == care_jvp["terms"]["prefill"]
    bad = care("flops", "--engine", "exact")
    assert bad.code == 2 and "--engine" in bad.err


def test_second_layer_triangular_counts_what_a_cuda_scorer_runs(care) -> None:
    tri = care("flops", "--backbone", "llava-next", "--keep", "160", "--second-layer", "triangular", "--json").json()
    dense = care("flops", "--backbone", "llava-next", "--keep", "160", "--json").json()
    assert tri["options"]["second_layer"] == "triangular" and dense["options"]["second_layer"] == "dense"
    n, m = 2880, 64
    # 16 tiles of 256 output columns, tile b from hidden unit 256 b on: sum_b (4096 - 256 b) 256 = 17/32 of 4096²
    triangle = 2 * m * n * sum((4096 - 256 * b) * 256 for b in range(16))
    assert tri["rows"][1]["breakdown"]["score"]["2mN R-triangle (16 blocks)"] == pytest.approx(triangle / 1e12)
    saved = (2 * m * n * 4096**2 - triangle) / 1e12
    assert dense["rows"][1]["terms"]["score"] - tri["rows"][1]["terms"]["score"] == pytest.approx(saved)
    assert tri["rows"][1]["second_layer"] == "triangular" and tri["rows"][0]["second_layer"] is None
    fd = care("flops", "--backbone", "llava-next", "--keep", "160", "--engine", "fd", "--second-layer", "triangular",
              "--json").json()  # fmt: skip
    assert fd["rows"][1]["terms"] == care("flops", "--backbone", "llava-next", "--keep", "160", "--engine", "fd",
                                          "--json").json()["rows"][1]["terms"]  # fmt: skip
    table = care("flops", "--backbone", "llava-next", "--keep", "160", "--second-layer", "triangular")
    assert table.code == 0 and "triangular factor" in table.out
    bad = care("flops", "--second-layer", "sparse")
    assert bad.code == 2 and "--second-layer" in bad.err


def test_json_has_the_spec_keys(care) -> None:
    run = care("flops", "--backbone", "llava-next", "--keep", "640", "--keep", "320", "--keep", "160", "--paper",
               "--json")  # fmt: skip
    assert run.code == 0, run.err
    report = run.json()
    assert report["command"] == "flops" and report["convention"] == "flops" and report["text_tokens"] == 64
    rows = report["rows"]
    assert [(r["method"], r["tokens"]) for r in rows] == [("baseline", 2880), ("care", 640), ("care", 320),
                                                         ("care", 160)]  # fmt: skip
    for row in rows:
        assert {"method", "tokens", "tflops", "terms", "avg_tokens", "paper_tflops", "paper_diff"} <= set(row)
        terms = row["terms"]
        assert {"score", "residual", "prefill"} <= set(terms)
        assert row["tflops"] == pytest.approx(terms["score"] + terms["residual"] + terms["prefill"])
    assert rows[0]["terms"]["score"] == 0 and rows[0]["paper_tflops"] == 42.7
    assert abs(rows[0]["paper_diff_pct"]) < 0.5
    assert [r["paper_tflops"] for r in rows[1:]] == [12.5, 8.2, 6.1]
    assert round(rows[1]["terms"]["score"], 1) == 6.2  # the jvp engine, the default
    gaps = report["paper"]["gap_analysis"]
    assert [g["closest_engine"] for g in gaps] == ["jvp"] * 3
    assert all(1.0 < g["paper_overhead_over_hypothesis"] < 1.04 for g in gaps)
    assert len(report["paper"]["table_s1"]) == 11 and len(report["paper"]["table_s1_vs_ours"]) == 11
    assert report["backbone"]["lm"]["hidden"] == 4096 and report["backbone"]["tokens"] == 2880


@pytest.mark.parametrize(("backbone", "paper"), [("llava-1.5", 8.54), ("llava-next", 42.7), ("qwen2.5-vl", 17.3)])
def test_baseline_rows_within_half_a_percent(care, backbone: str, paper: float) -> None:
    row = care("flops", "--backbone", backbone, "--json").json()["rows"][0]
    assert row["method"] == "baseline" and abs(row["tflops"] - paper) / paper < 0.005


def test_all_methods_baseline_first(care) -> None:
    report = care("flops", "--method", "all", "--keep", "192", "--json").json()
    methods = [r["method"] for r in report["rows"]]
    assert methods[0] == "baseline" and methods.count("baseline") == 1
    assert {"care", "zoo-prune", "divprune", "visionzip", "fastv", "sparsevlm"} <= set(methods)
    fastv = next(r for r in report["rows"] if r["method"] == "fastv")
    assert fastv["schedule"] == [[2, 576], [30, 192]] and 192 < fastv["avg_tokens"] < 576


def test_paper_table1_values_for_peers(care) -> None:
    report = care("flops", "--method", "fastv", "--method", "divprune", "--keep", "128", "--paper", "--json").json()
    by_method = {r["method"]: r for r in report["rows"]}
    assert by_method["fastv"]["paper_tflops"] == 2.62 and by_method["fastv"]["paper_source"] == "Table 1"
    assert by_method["divprune"]["paper_tflops"] is None  # printed as "-"


def test_convention_and_options(care) -> None:
    report = care("flops", "--backbone", "qwen2.5-vl", "--convention", "macs", "--gqa", "--lm-head",
                  "--vision-tower", "--ratio", "0.2", "--json").json()  # fmt: skip
    assert report["unit"] == "TMACs" and report["options"]["gqa"] is True
    row = report["rows"][1]
    assert row["tokens"] == 222 and row["tmacs"] == pytest.approx(row["tflops"] / 2)
    assert {"lm_head", "vision_tower"} <= set(row["terms"])
    human = care("flops", "--backbone", "qwen2.5-vl", "--convention", "macs", "--lm-head")
    assert human.code == 0 and "TMACs" in human.out and "lm_head" in human.out


def test_image_size_sets_n(care) -> None:
    report = care("flops", "--backbone", "llava-next", "--image-size", "500x800", "--keep", "100", "--json").json()
    assert report["N"] == 2016 and report["backbone"]["token_detail"]["high_res_grid"] == [30, 48]
    assert care("flops", "--backbone", "llava-1.5", "--tokens", "1000", "--keep", "999", "--json").json()["N"] == 1000


def test_where_n_came_from_is_a_parameter_in_json_and_a_flag_on_screen(care) -> None:
    report = care("flops", "--tokens", "1000", "--keep", "99", "--json").json()
    assert report["backbone"]["tokens_source"] == "tokens" and "--" not in report["backbone"]["tokens_note"]
    sized = care("flops", "--backbone", "llava-next", "--image-size", "500x800", "--keep", "100", "--json").json()
    assert sized["backbone"]["tokens_source"] == "image_size"
    assert "(--tokens)" in care("flops", "--tokens", "1000", "--keep", "99").out
    assert "(--image-size)" in care("flops", "--backbone", "llava-next", "--image-size", "500x800").out


def test_config_folder_backbone(care, tmp_path: Path) -> None:
    from .test_specs import LLAVA_HF_7B, _write

    _write(tmp_path, LLAVA_HF_7B)
    run = care("flops", "--backbone", tmp_path, "--paper", "--json")
    assert run.code == 0, run.err
    assert run.json()["rows"][0]["paper_tflops"] == 8.54


def test_gemma3_config_folder_counts_by_hand(care, tmp_path: Path) -> None:
    """`care flops --gqa --vision-tower --lm-head` on a tiny saved Gemma 3 config (test_specs.TINY_GEMMA3_*),
    T = 4 text tokens, N = 4 visual tokens, so W = 8 rows per layer. By hand:
    - decoder layer (GQA: q = 2 heads x 32 = 64, kv = 1 x 32 = 32, H = 48, I = 96):
      4 W H q + 4 W H kv + 6 W H I + 4 W^2 q = 98,304 + 49,152 + 221,184 + 16,384 = 385,024; 2 layers: 770,048;
    - SigLIP tower (no CLS; 56 / 14 = 4x4 = 16 patches, d = 32, I_v = 64, 1 layer): patch conv
      2 * 16 * 32 * 3 * 14^2 = 602,112; layer 8 * 16 * 32^2 + 4 * 16 * 32 * 64 + 4 * 16^2 * 32 = 294,912;
    - head on the last row: 2 H V = 2 * 48 * 1000 = 96,000."""
    from transformers import Gemma3Config

    from .test_specs import TINY_GEMMA3_TEXT, TINY_GEMMA3_VISION

    Gemma3Config(text_config=TINY_GEMMA3_TEXT, vision_config=TINY_GEMMA3_VISION,
                 mm_tokens_per_image=4).save_pretrained(tmp_path)  # fmt: skip
    run = care("flops", "--backbone", tmp_path, "--gqa", "--vision-tower", "--lm-head", "--text-tokens", "4",
               "--keep", "2", "--json")  # fmt: skip
    assert run.code == 0, run.err
    baseline = run.json()["rows"][0]
    assert (baseline["method"], baseline["tokens"]) == ("baseline", 4)
    assert baseline["terms"]["prefill"] * 1e12 == pytest.approx(770_048)
    assert baseline["terms"]["vision_tower"] * 1e12 == pytest.approx(602_112 + 294_912)
    assert baseline["terms"]["lm_head"] * 1e12 == pytest.approx(96_000)
    assert baseline["flops"] == 770_048 + 602_112 + 294_912 + 96_000


def _bad(run, *needles: str) -> None:
    assert run.code == 2
    assert run.out == ""
    lines = run.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), run.err
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_unknown_backbone_suggests(care) -> None:
    _bad(care("flops", "--backbone", "llava-nxt"), "did you mean", "llava-next")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--keep", "577"], "between 1 and N = 576, got 577"),
        (["--keep", "0"], "--keep must be between 1 and N = 576, got 0"),
        (["--ratio", "0"], "(0, 1]"),
        (["--ratio", "1.5"], "(0, 1]"),
        (["--tokens", "100", "--image-size", "10x10"], "not both"),
        (["--image-size", "big"], "HEIGHTxWIDTH"),
        (["--method", "fastvv"], "did you mean fastv"),
        (["--convention", "tflops"], "--convention"),
        (["--text-tokens", "-1"], ">= 0"),
    ],
)
def test_bad_options(care, args: list[str], needle: str) -> None:
    _bad(care("flops", *args), needle)


def test_malformed_config(care, tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "llava", ')
    _bad(care("flops", "--backbone", bad), "not valid JSON")
    _bad(care("flops", "--backbone", tmp_path / "nothing-here.json"), "no such file")


def test_folder_without_config(care, tmp_path: Path) -> None:
    _bad(care("flops", "--backbone", tmp_path), "no config.json")


@pytest.mark.parametrize(("tokens", "ratio", "keep"), [(100, "0.29", 29), (576, "0.11", 63), (2880, "0.056", 161)])
def test_ratio_budgets_are_the_decimal_typed(care, tokens: int, ratio: str, keep: int) -> None:
    """The one budget rule: 0.29 of 100 tokens is 29 (binary floating point would give 28.999…, floor 28)."""
    run = care("flops", "--backbone", "llava-1.5", "--tokens", str(tokens), "--ratio", ratio, "--json")
    assert run.code == 0, run.err
    assert run.json()["budgets"] == [keep]


def _console_width(monkeypatch: pytest.MonkeyPatch, width: int) -> None:
    from rich.console import Console

    from care_cli import render

    monkeypatch.setattr(render, "stdout", Console(width=width, soft_wrap=False))


def _table_body(out: str, methods: tuple[str, ...]) -> list[str]:
    """The lines of the first table from below its header rule to its last row."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if "───" in line)
    rows = [i for i, line in enumerate(lines) if line.split()[:1] and line.split()[0] in methods]
    return lines[start + 1 : rows[-1] + 1]


def test_the_title_wraps_at_the_console_width_not_the_table_width(care, monkeypatch: pytest.MonkeyPatch) -> None:
    _console_width(monkeypatch, 200)
    run = care("flops")
    assert run.code == 0, run.err
    assert run.out.splitlines()[0] == "Analytic TFLOPs — LLaVA-1.5-7B: N = 576 visual tokens, T = 64 text tokens"


def test_rows_follow_each_other_and_budgets_of_several_rows_are_ruled_apart(
    care, monkeypatch: pytest.MonkeyPatch
) -> None:
    _console_width(monkeypatch, 120)
    body = _table_body(care("flops").out, ("baseline", "care"))
    assert len(body) == 4 and all(line.strip() for line in body)  # baseline and care at 3 budgets, no blank row
    args = ["--method", "care", "--method", "fastv", "--keep", "64", "--keep", "128"]
    body = _table_body(care("flops", *args).out, ("baseline", "care", "fastv"))
    assert all(line.strip() for line in body), body
    rules = [i for i, line in enumerate(body) if "┈" in line]
    assert len(rules) == 1 and len(body) == 6  # baseline, K=64 x 2 methods, a rule, K=128 x 2 methods
    tokens = [line.split()[1] for line in body if "┈" not in line]
    assert tokens[1] == tokens[2] != tokens[3] == tokens[4]  # the rule between the two budgets


def test_paper_comparison_is_two_parts_at_80_columns_the_comparison_first(
    care, monkeypatch: pytest.MonkeyPatch
) -> None:
    _console_width(monkeypatch, 80)
    run = care("flops", "--paper")
    assert run.code == 0, run.err
    lines = run.out.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Paper Table S1")]
    assert len(starts) == 2, run.out
    first_part = "\n".join(lines[starts[0] : starts[1]])
    assert "paper %" in first_part and "-0.42%" in first_part and "residual" not in first_part
