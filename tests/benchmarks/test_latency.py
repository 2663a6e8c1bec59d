"""The latency gate's arithmetic: floors counted by hand, targets judged on figures made up for the test."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from benchmarks import common, latency


def test_factor_rows_cost_the_triangle_or_the_trapezoid() -> None:
    assert latency.factor_macs_per_row(4, 4) == 4 + 3 + 2 + 1  # square R: row i nonzero from column i on
    assert latency.factor_macs_per_row(5, 3) == 5 + 4 + 3  # wide W2 (d_out < d_h): a 3 x 5 trapezoid
    assert latency.factor_macs_per_row(4, 6) == 4 + 3 + 2 + 1  # tall W2: R is d_h x d_h


def test_second_layer_is_the_last_linear_or_a_one_map_projectors_own_widths() -> None:
    from transformers import Gemma3Config
    from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

    from care_core.backbones.gemma3.adapter import Gemma3TokenProjector

    mlp = nn.Sequential(nn.Linear(3, 5), nn.GELU(), nn.Linear(5, 7))
    assert latency.second_layer(mlp) == (5, 7)
    config = Gemma3Config(
        text_config={"hidden_size": 48},
        vision_config={"hidden_size": 32, "image_size": 56, "patch_size": 14},
        mm_tokens_per_image=4,
    )
    # Gemma 3: RMSNorm + one bare (d_v, d_t) matmul weight, no nn.Linear: the map is 32 -> 48
    assert latency.second_layer(Gemma3TokenProjector(Gemma3MultiModalProjector(config))) == (32, 48)


def test_norm_linear_floor_is_its_fast_paths_work_not_a_second_layer() -> None:
    from transformers import Gemma3Config
    from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

    from care_core.backbones.gemma3.adapter import Gemma3TokenProjector

    # m = 2, N = 5, d_in = 3, d_out = 4: shared products (N + m) d_in d_out = 84, inner products m N d_in = 30,
    # combination and norm 2 m N d_out = 80
    assert latency.norm_linear_macs(2, 5, 3, 4) == 84 + 30 + 80
    assert latency.scoring_floor_macs(nn.Sequential(nn.RMSNorm(3), nn.Linear(3, 4)), 2, 5) == 194
    mlp = nn.Sequential(nn.Linear(3, 5), nn.GELU(), nn.Linear(5, 7))
    assert latency.scoring_floor_macs(mlp, 2, 5) == 2 * 5 * (5 + 4 + 3 + 2 + 1)  # m N tangents through R (5 x 5)
    config = Gemma3Config(
        text_config={"hidden_size": 48},
        vision_config={"hidden_size": 32, "image_size": 56, "patch_size": 14},
        mm_tokens_per_image=4,
    )
    gemma = Gemma3TokenProjector(Gemma3MultiModalProjector(config))  # 32 -> 48, not a 32 x 32 triangle per tangent
    assert latency.scoring_floor_macs(gemma, 2, 5) == 7 * 32 * 48 + 2 * 5 * 32 + 2 * 2 * 5 * 48


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(8, 8, bias=False)
        self.self_attn.o_proj = nn.Linear(8, 8, bias=False)
        self.mlp = nn.Linear(8, 16, bias=False)


def _model() -> Any:
    lm = nn.Module()
    lm.layers = nn.ModuleList([_Layer(), _Layer()])
    lm.norm = nn.LayerNorm(8, bias=False)
    head = nn.Linear(8, 100, bias=False)
    return SimpleNamespace(model=SimpleNamespace(language_model=lm), lm_head=head)


def test_prefill_floor_counts_linears_causal_attention_the_head_and_the_weights_read() -> None:
    model = _model()  # float32 weights: 4 bytes each
    floor = latency.prefill_floor_ms(model, rows=10)
    per_row_macs = 2 * (8 * 8 + 8 * 8 + 8 * 16)  # two layers: q, o and the 8 -> 16 map
    flops = 2 * 10 * per_row_macs + 2 * 10 * 10 * 8 * 2 + 2 * 8 * 100  # linears, causal QK^T and AV, head
    weights = 4 * (2 * (64 + 64 + 128) + 8 + 800)  # layers, norm, head (the embedding table is not read)
    assert floor["flops"] == flops
    assert floor["weight_bytes"] == weights
    expected = max(flops / (latency.PEAK_BF16_TFLOPS * 1e12), weights / (latency.HBM_TBPS * 1e12)) * 1e3
    assert floor["floor_ms"] == pytest.approx(expected)


class _LinearAttentionLayer(nn.Module):  # a Gated DeltaNet layer: linear maps, no self_attn
    def __init__(self) -> None:
        super().__init__()
        self.linear_attn = nn.Module()
        self.linear_attn.in_proj = nn.Linear(8, 24, bias=False)
        self.linear_attn.out_proj = nn.Linear(8, 8, bias=False)
        self.mlp = nn.Linear(8, 16, bias=False)


def test_prefill_floor_of_a_hybrid_decoder_counts_attention_in_its_attention_layers_only() -> None:
    # Qwen3.5's form: a Gated DeltaNet layer first, then an attention layer whose q_proj also gives an output gate
    # (8 -> 16), so its q_dim is o_proj's input width, 8
    gated = _Layer()
    gated.self_attn.q_proj = nn.Linear(8, 16, bias=False)
    model = _model()
    model.model.language_model.layers = nn.ModuleList([_LinearAttentionLayer(), gated])
    floor = latency.prefill_floor_ms(model, rows=10)
    per_row_macs = (8 * 24 + 8 * 8 + 8 * 16) + (8 * 16 + 8 * 8 + 8 * 16)  # 384 + 320
    assert floor["flops"] == 2 * 10 * per_row_macs + 2 * 10 * 10 * 8 + 2 * 8 * 100  # one layer's causal attention


def test_budgets_are_a_ninth_and_the_papers_where_it_has_one() -> None:
    assert latency.keeps_for("llava-next", 2880) == {"N/9": 320, "160": 160}
    assert latency.keeps_for("qwen3-vl", 1024) == {"N/9": 113}
    assert latency.keeps_for("llava-1.5", 576) == {"N/9": 64}


def _answer(decoding: str, label: str, speedup: float, x_floor: float) -> dict[str, Any]:
    return {"decoding": decoding, "keep_label": label, "speedup": speedup, "prefill_care_x_floor": x_floor}


def test_verdicts_judge_each_figure_against_its_own_target() -> None:
    results = {"families": [
        {"family": "llava-next", "N": 2880, "scoring": {"scoring_x_floor": 1.2},
         "answers": [_answer("default", "N/9", 3.0, 1.9), _answer("default", "160", 3.6, 1.5),
                     _answer("eager", "N/9", 0.9, 9.0), _answer("eager", "160", 1.1, 9.0)]},
        {"family": "llava-1.5", "N": 576, "scoring": {"scoring_x_floor": 1.4},
         "answers": [_answer("default", "N/9", 1.3, 2.5), _answer("eager", "N/9", 0.8, 9.0)]},
        {"family": "gemma3", "N": 256, "scoring": {"scoring_x_floor": 90.0, "form": "norm-linear"}, "answers": []},
        {"family": "qwen3.5", "N": 1024, "scoring": {"scoring_x_floor": 1.2},
         "answers": [_answer("default", "N/9", 1.6, 16.0)]},
    ], "dropin": [{"family": "llava-next", "K": 160, "N": 2880, "speedup": 2.4}]}  # fmt: skip
    verdicts = {(v["figure"], v["family"], v["K"]): v["met"] for v in latency.verdicts(results)}
    assert verdicts == {
        ("first_default", "llava-next", "160"): True,  # 3.6 >= 3.5 (its N/9 row has no first-token target)
        ("first_default", "llava-1.5", "N/9"): True,  # 1.3 >= 1.2
        ("first_eager", "llava-next", "N/9"): False,  # 0.9 < 1.0; LLaVA-1.5 (N = 576 < 1000): no eager target
        ("prefill_x_floor", "llava-next", "N/9"): True,  # 1.9 <= 2
        ("prefill_x_floor", "llava-1.5", "N/9"): False,  # 2.5 > 2
        ("scoring_x_floor", "llava-next", "N/9"): True,  # 1.2 <= 1.3
        ("scoring_x_floor", "llava-1.5", "N/9"): False,  # 1.4 > 1.3 (gemma3's norm-then-linear: reported only)
        ("first_default", "qwen3.5", "N/9"): True,  # 1.6 >= 1.5 (issue #50's target)
        ("scoring_x_floor", "qwen3.5", "N/9"): True,  # 1.2 <= 1.3; its prefill, 16x its floor: reported only
        ("dropin_speedup", "llava-next", "160"): False,  # 2.4 < 2.5
    }


def test_source_state_takes_the_environment_where_set_and_else_git(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CARE_SOURCE_COMMIT", raising=False)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=common.ROOT, capture_output=True, text=True)
    if head.returncode == 0:  # a clone: the commit git names
        assert common.source_state()["commit"] == head.stdout.strip()
    monkeypatch.setenv("CARE_SOURCE_COMMIT", "abc123")  # set by whoever copied the tree: it wins over any git folder
    monkeypatch.setenv("CARE_SOURCE_DIRTY", "0")
    assert common.source_state() == {"commit": "abc123", "dirty": False, "from": "environment"}
    monkeypatch.delenv("CARE_SOURCE_COMMIT")
    monkeypatch.setattr(common, "ROOT", tmp_path)  # neither: said so
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert common.source_state()["commit"] is None


def test_docs_hold_the_newest_gate_result_as_rendered() -> None:
    """The README's and performance.md's speed figures are the newest committed gate result, rendered, never typed."""
    assert latency.newest_result() is not None, "no committed latency-gate result in benchmarks/results"
    block = latency.newest_block()
    for name in latency.DOC_BLOCKS:
        text = (latency.ROOT / name).read_text(encoding="utf-8")
        assert latency.BEGIN + "\n" + block + latency.END in text, f"{name}: run python -m benchmarks.latency --docs"


def test_each_family_runs_in_a_process_of_its_own_and_a_failed_one_is_recorded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    commands: list[list[str]] = []

    def child(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        commands.append(command)
        out = command[command.index("--family-out") + 1]
        family = command[command.index("--families") + 1]
        if family == "qwen3-vl":
            return subprocess.CompletedProcess(command, 137)  # killed: no result file
        (tmp_path / out).write_text(json.dumps({"family": family, "N": 576}))
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(common.subprocess, "run", child)  # the children run through common.child_result
    args = SimpleNamespace(reps=3, device="cuda", tiny=False)
    done = latency.family_in_own_process("llava-1.5", args, 400.0, tmp_path)
    failed = latency.family_in_own_process("qwen3-vl", args, 400.0, tmp_path)
    assert done == {"family": "llava-1.5", "N": 576}
    assert failed == {"family": "qwen3-vl", "error": "its process exited with code 137"}
    assert [c[c.index("--families") + 1] for c in commands] == ["llava-1.5", "qwen3-vl"]
    assert all(c[c.index("--tf32-tflops") + 1] == "400.0" and "--reps" in c for c in commands)
    with pytest.raises(SystemExit):
        latency.parse(["--families", "llava-1.5,qwen3-vl", "--family-out", str(tmp_path / "x.json")])


def test_the_footer_names_each_family_that_decoded_eagerly_by_default_and_why() -> None:
    def row(used: list[str], reasons: list[str | None]) -> dict[str, Any]:
        return {"used": used, "eager_reason": reasons}

    graphs = {("llava-next", "default", "160"): row(["cuda-graph", "cuda-graph"], [None, None]),
              ("llava-next", "eager", "160"): row(["eager", "eager"], ["turned off", "turned off"])}  # fmt: skip
    assert latency._default_decoding(graphs) == "default decoding: CUDA graphs"
    mixed = {**graphs, ("gemma3", "default", "N/9"): row(["eager", "eager"], ["sliding windows.", "sliding windows."])}
    assert latency._default_decoding(mixed) == (
        "default decoding: CUDA graphs, except eagerly where the static loop cannot run (gemma3: sliding windows)"
    )


def test_the_table_gives_each_budget_its_prompts_text_rows_and_marks_targetless_cells() -> None:
    answer = {"K": 113, "text_rows": 39, "first_all_ms": 30.0, "first_care_ms": 15.0, "speedup": 2.0,
              "prefill_care_x_floor": 16.0}  # fmt: skip
    fam = {"family": "qwen3.5", "image": "1024x1024", "N": 1024, "keeps": {"N/9": 113},
           "scoring": {"scoring_x_floor": 1.25}}  # fmt: skip
    lines = latency._table({"families": [fam]}, {("qwen3.5", "default", "N/9"): answer})
    assert lines[2] == "| qwen3.5 (1024x1024) | 1024 | 113 | 39 | 30.0 → 15.0 | 2.00× | — | 16.00 (reported) | 1.25 |"


def test_the_scoring_cell_adds_the_graph_replay_and_the_footer_says_what_it_is() -> None:
    answer = {"K": 64, "text_rows": 29, "first_all_ms": 14.1, "first_care_ms": 8.2, "speedup": 1.71,
              "prefill_care_x_floor": 2.21}  # fmt: skip
    fam = {"family": "llava-1.5", "image": "336x336", "N": 576, "keeps": {"N/9": 64},
           "scoring": {"scoring_x_floor": 1.5331, "graphed_x_floor": 1.2449}}  # fmt: skip
    rows = {("llava-1.5", "default", "N/9"): {**answer, "family": "llava-1.5", "decoding": "default",
                                             "keep_label": "N/9", "used": ["cuda-graph", "cuda-graph"],
                                             "eager_reason": [None, None]}}  # fmt: skip
    lines = latency._table({"families": [fam]}, rows)
    assert lines[2].endswith("| 2.21 | 1.53 (graph 1.24) |")
    results = {"environment": {"card": "NVIDIA H200"}, "families": [fam], "new_tokens": 8, "targets": [],
               "source": {"commit": "a7dd15fbb9", "dirty": False}}  # fmt: skip
    assert latency.GRAPH_NOTE in latency.render_markdown(results, "r.json")
    del fam["scoring"]["graphed_x_floor"]  # a result from before the field, or a capture that failed: as before
    assert latency._table({"families": [fam]}, rows)[2].endswith("| 2.21 | 1.53 |")
    assert latency.GRAPH_NOTE not in latency.render_markdown(results, "r.json")


class _Graphs:
    """A stand-in for ReductionGraphs: eager below its second call, "replays" (counted) after, or a failed capture."""

    def __init__(self, capture_fails: bool) -> None:
        self.capture_fails, self.calls, self.replays, self.released = capture_fails, 0, 0, False

    @property
    def failures(self) -> dict[str, str]:
        return {"scoring": "capturing the reduction failed (RuntimeError: no)"} if self.capture_fails else {}

    def run(self, key: Any, inputs: Any, step: Any) -> Any:
        self.calls += 1
        self.replays += self.calls > 2 and not self.capture_fails
        return step(tuple(inputs))

    def release(self) -> None:
        self.released = True


@pytest.mark.parametrize("capture_fails", [False, True])
def test_graphed_scoring_reports_replays_only(capture_fails: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from care_core import reduction_graphs

    made: list[_Graphs] = []
    monkeypatch.setattr(reduction_graphs, "ReductionGraphs", lambda: made.append(_Graphs(capture_fails)) or made[-1])
    seen: list[tuple[Any, ...]] = []
    features, directions = torch.zeros(5, 3), torch.ones(2, 3)
    out = latency.graphed_scoring(lambda *a: seen.append(a), features, directions, common.Clock("cpu"), reps=3)
    graphs = made[0]
    assert graphs.calls == 2 + 3 and graphs.released and len(seen) == 5  # CAPTURE_ON_SIGHTING warm-ups, then reps
    assert all(got[0] is features and got[1] is directions for got in seen)
    if capture_fails:  # every call eager: no graph figure, and why
        assert out["graphed_ms"] is None and out["graph_replays"] == 0 and "RuntimeError" in out["graph_failure"]
    else:
        assert out["graphed_ms"] is not None and out["graph_replays"] == 3 and out["graph_failure"] is None


def test_the_footer_gives_the_hosts_launch_time_when_the_result_has_it() -> None:
    results = {"environment": {"card": "NVIDIA H200", "launch_us": 10.71}, "families": [], "new_tokens": 8,
               "targets": [], "source": {"commit": "a7dd15fbb9", "dirty": False}}  # fmt: skip
    assert "; the host launches a kernel in 10.7 µs; 0 of 0 targets met." in latency.render_markdown(results, "r.json")
    del results["environment"]["launch_us"]  # results from before the field: no clause
    assert "default decoding: no CUDA graphs; 0 of 0 targets met." in latency.render_markdown(results, "r.json")


def test_the_drop_in_line_gives_its_verdict_commit_later_steps_and_the_hosts_launch_time() -> None:
    row = {"family": "llava-next", "K": 160, "batch": 8, "all_ms": 860.2, "care_ms": 467.9, "speedup": 1.8384,
           "tower_share_of_care": 0.286, "processor_ms": 121.4}  # fmt: skip
    dropin = {"new_tokens": 8, "dropin": [row], "environment": {"launch_us": 8.81},
              "source": {"commit": "99a198f", "dirty": False},
              "targets": [{"figure": "dropin_speedup", "family": "llava-next", "K": "160", "value": 1.8384,
                           "target": ">= 2.5", "met": False}]}  # fmt: skip
    line = latency._dropin_lines(dropin, "d.json")[1]
    share = "the tower 29% of the reduced call; the processor's call before either 121 ms"
    assert f"llava-next at K = 160: 860 → 468 ms (**1.84×**; {share})." in line
    assert "Target: llava-next 1.84× against ≥ 2.5×: NOT MET." in line
    assert line.endswith("(`python -m benchmarks.latency --part dropin`, commit 99a198f; the host launches a kernel in "
                         "8.8 µs).")  # fmt: skip
    row.update(new_tokens=8, all_first_token_ms=690.0, care_first_token_ms=310.4)  # 170.2 and 157.5 ms later
    later = f"(**1.84×**; {share}; the 7 steps after the first token 170 and 158 ms)."
    assert later in latency._dropin_lines(dropin, "d.json")[1]
    row.update(all_step_ms=24.3, care_step_ms=22.5, round_speedups=[1.79, 1.9, 1.84])
    each = f"(**1.84×**; {share}; the 7 steps after the first token 170 and 158 ms (24 and 22 ms a step); its 3 rounds "
    assert f"{each}1.79–1.90×)." in latency._dropin_lines(dropin, "d.json")[1]


class _Decoder(nn.Module):
    """A stand-in for a model whose ``generate`` runs ``extra`` forwards of its own, then one a new token."""

    def __init__(self, extra: int = 0) -> None:
        super().__init__()
        self.extra = extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, **_: Any) -> torch.Tensor:
        for _step in range(self.extra + max_new_tokens):
            self(input_ids)
        return input_ids


@pytest.mark.parametrize("extra", [0, 2])
def test_timed_generate_splits_the_call_at_its_last_forwards(extra: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Marks (seconds): the call's start, each forward's launch, the end; the first token is the start to the second
    of the last 8 forwards, the later steps launch to launch."""
    launches = [0.001 * (i + 1) for i in range(extra)] + [0.010, 0.110, 0.130, 0.150, 0.170, 0.190, 0.210, 0.240]
    marks = iter([0.0, *launches, 0.270])
    monkeypatch.setattr(latency.time, "perf_counter", lambda: next(marks))
    model = _Decoder(extra)
    timing = latency.timed_generate(model, {"input_ids": torch.zeros(1, 3)}, common.Clock("cpu"))
    assert timing.total_ms == pytest.approx(270.0)
    assert timing.first_token_ms == pytest.approx(110.0)
    assert timing.later_step_ms == pytest.approx((20 * 5 + 30 + 30) / 7)  # 0.110 -> 0.270 over 7 steps
    assert not model._forward_pre_hooks  # the hook went with the block


def test_drop_in_figures_are_medians_over_all_blocks_and_each_rounds_ratio() -> None:
    def block(*totals: float) -> list[latency.DecodeTiming]:
        return [latency.DecodeTiming(t, t / 4, t / 10) for t in totals]

    runs = {"all": [block(900, 880, 1000), block(940, 960, 950)], "care": [block(300, 320, 310), block(390, 400, 380)]}
    row: dict[str, Any] = {}
    latency.dropin_figures(row, runs)
    assert row["all_ms"] == pytest.approx(945.0)  # median of 880 900 940 950 960 1000
    assert row["care_ms"] == pytest.approx(350.0)  # median of 300 310 320 380 390 400
    assert row["all_first_token_ms"] == pytest.approx(945.0 / 4)
    assert row["care_step_ms"] == pytest.approx(35.0)
    assert row["speedup"] == pytest.approx(945 / 350)
    assert row["round_speedups"] == pytest.approx([900 / 310, 950 / 390])


def test_a_drop_in_line_from_before_the_fields_names_what_its_figures_held() -> None:
    """Older results: their tower figure held the processor too, and they have no first-token or launch fields."""
    row = {"family": "llava-next", "K": 160, "batch": 8, "all_ms": 860.2, "care_ms": 467.9, "speedup": 1.8384,
           "tower_ms": 133.8, "tower_share_of_care": 0.286}  # fmt: skip
    dropin = {"new_tokens": 8, "dropin": [row], "source": {"commit": "99a198f", "dirty": False}}
    assert latency._dropin_lines(dropin, "d.json")[1].endswith(
        "ms (**1.84×**; the processor and the tower, timed together, 134 ms). "
        "Source: `benchmarks/results/d.json` (`python -m "
        "benchmarks.latency --part dropin`, commit 99a198f)."
    )


def test_the_footer_names_each_target_not_met_on_its_side_of_its_bound() -> None:
    """A value that rounds onto its bound gets the decimals that keep it short of it (1.4997, not 1.50); met targets
    are not named."""

    def target(figure: str, family: str, value: float, bound: str, met: bool) -> dict[str, Any]:
        return {"figure": figure, "family": family, "K": "N/9", "value": value, "target": bound, "met": met}

    targets = [target("first_default", "qwen3.5", 1.499688, ">= 1.5", False),
               target("first_default", "qwen3-vl", 1.8559, ">= 2.0", False),
               target("first_default", "internvl3", 2.3882, ">= 2.0", True),
               target("scoring_x_floor", "llava-next", 1.2723, "<= 1.3", True),
               target("scoring_x_floor", "internvl3", 1.300012, "<= 1.3", False),
               target("scoring_x_floor", "qwen3-vl", 1.651, "<= 1.3", False)]  # fmt: skip
    assert latency._unmet_clause(targets) == (
        "; not met: first token qwen3.5 1.4997 (≥ 1.5); first token qwen3-vl 1.86 (≥ 2.0); "
        "scoring × floor internvl3 1.30001, qwen3-vl 1.65 (≤ 1.3)"
    )
    assert latency._unmet_clause(targets[2:4]) == ""


def test_the_drop_in_line_ends_with_the_targets_spread_over_every_committed_run(tmp_path: Path) -> None:
    """Three committed drop-in results (one holds no llava-next row, one is a probe the pattern leaves out)."""
    runs = {"2026-01-01-000000-gpu-h200-latency-dropin.json": [("llava-next", 2.0), ("qwen3-vl", 1.3)],
            "2026-01-02-000000-gpu-h200-latency-dropin.json": [("llava-next", 2.75)],
            "2026-01-03-000000-gpu-h200-latency-dropin.json": [("qwen3-vl", 1.1)],
            "2026-01-04-000000-gpu-h200-dropin-probe.json": [("llava-next", 9.0)],
            "2026-01-05-000000-gpu-h200-latency-dropin.json": [("llava-next", 2.5)]}  # fmt: skip
    for name, rows in runs.items():
        (tmp_path / name).write_text(json.dumps({"dropin": [{"family": f, "speedup": v} for f, v in rows]}))
    history = latency.dropin_history(tmp_path)
    assert history == [2.0, 2.75, 2.5]
    row = {"family": "llava-next", "K": 160, "all_ms": 900.0, "care_ms": 360.0, "speedup": 2.5, "batch": 8,
           "tower_share_of_care": 0.1, "processor_ms": 100.0}  # fmt: skip
    line = latency._dropin_lines({"new_tokens": 8, "dropin": [row]}, "d.json", history)[1]
    assert line.endswith(
        " Over all 3 committed runs (`benchmarks/results/*-latency-dropin*.json`, several commits and "
        "hosts) the llava-next call's speed-up spans 2.00–2.75× (median 2.50×; 2 at or above 2.5×)."
    )
    assert "committed runs" not in latency._dropin_lines({"new_tokens": 8, "dropin": [row]}, "d.json", [2.5])[1]
