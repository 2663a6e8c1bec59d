"""The GPU throughput benchmarks' verdicts, from hand-made care eval / care csr rows: the ratio of CaRe to all tokens
at the same batch size, 2 processes over one, and each issue target MET or NOT MET."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pytest import approx, raises

from benchmarks import bench_csr_scale, bench_eval_gpu
from benchmarks.gpu import context


def _eval_row(backbone: str, method: str | None, processes: int, rate: float, size: int = 32) -> dict[str, Any]:
    return {"backbone": backbone, "method": method, "processes": processes, "decoding": "graphs",
            "batch_size_requested": "auto", "batch_size_start": size, "batch_size": size,
            "samples_per_s": rate}  # fmt: skip


def test_eval_ratios_and_targets_compare_rows_of_the_same_command() -> None:
    rows = [_eval_row("llava-next-7b", None, 1, 10.0), _eval_row("llava-next-7b", "care", 1, 36.0),
            _eval_row("llava-next-7b", None, 2, 19.0), _eval_row("llava-next-7b", "care", 2, 63.0),
            _eval_row("llava-1.5-7b", None, 1, 20.0), _eval_row("llava-1.5-7b", "care", 1, 38.0)]  # fmt: skip
    bench_eval_gpu.add_ratios(rows)
    assert [r["x_all_tokens"] for r in rows] == [None, approx(3.6), None, approx(63 / 19), None, approx(1.9)]
    assert [r["x_one_process"] for r in rows] == [None, None, approx(1.9), approx(1.75), None, None]
    verdicts = {(c["where"], c["what"]): c["met"] for c in bench_eval_gpu.targets(rows)}
    assert verdicts == {
        ("llava-next-7b batch 32", "CaRe samples/s"): False,  # 36 < 50
        ("llava-next-7b batch 32, 1 proc", "CaRe / all tokens"): True,  # 3.6 >= 3
        ("llava-next-7b batch 32, 2 proc", "CaRe / all tokens"): True,  # 3.32 >= 3
        ("llava-next-7b batch 32", "2 procs / 1"): False,  # 63 / 36 = 1.75 < 1.8
        ("llava-1.5-7b batch 32, 1 proc", "CaRe / all tokens"): False,  # 1.9 < 2
    }


def test_care_over_all_tokens_is_a_target_only_at_the_same_batch_size() -> None:
    # auto picked 16 for all tokens and 64 for CaRe (its answers read K rows): the ratio is reported, not judged
    rows = [_eval_row("llava-next-7b", None, 1, 13.0, size=16), _eval_row("llava-next-7b", "care", 1, 52.0, size=64)]
    bench_eval_gpu.add_ratios(rows)
    assert rows[1]["x_all_tokens"] == approx(4.0) and rows[1]["same_batch_as_all_tokens"] is False
    verdicts = {(c["where"], c["what"]): c["met"] for c in bench_eval_gpu.targets(rows)}
    assert verdicts == {("llava-next-7b batch 64", "CaRe samples/s"): True}  # 52 >= 50


def test_preprocessing_share_is_ms_per_image_over_the_care_settings_ms_per_sample() -> None:
    rows = [_eval_row("llava-1.5-7b", None, 1, 20.0), _eval_row("llava-1.5-7b", "care", 1, 40.0)]
    cost = {"images": 16, "threads": 8, "ms_per_image_threads": 5.0, "ms_per_image_one_thread": 20.0}
    (share,) = bench_eval_gpu.preprocess_shares(rows, {"llava-1.5-7b": cost})
    assert share["per_sample_ms"] == 25.0  # 1000 / 40 samples/s
    assert (share["share_threads"], share["share_one_thread"]) == (approx(0.2), approx(0.8))


def _csr_row(batch: str, processes: int, rate: float, pairs: int = 192) -> dict[str, Any]:
    return {"batch_size_requested": batch, "batch_size": 1 if batch == "1" else 64, "processes": processes,
            "pairs_per_s": rate, "pairs": pairs}  # fmt: skip


def test_csr_compares_with_batch_one_of_this_run_or_else_the_recorded_pipeline() -> None:
    measured = [_csr_row("1", 1, 1.25), _csr_row("auto", 1, 5.0)]
    checks = bench_csr_scale.compare(measured)
    assert measured[1]["x_batch_one"] == approx(4.0) and [c["met"] for c in checks] == [True]
    alone = [_csr_row("auto", 1, 4.72), _csr_row("auto", 2, 8.0)]
    checks = bench_csr_scale.compare(alone)
    assert alone[0]["x_batch_one"] == approx(4.72 / 1.18)  # the recorded 1.18 pairs/s
    assert [(c["what"], c["met"]) for c in checks] == [("x batch 1", True), ("2 procs / 1", False)]  # 8 / 4.72 < 1.8


def test_csr_compares_each_pair_count_within_its_own_rows() -> None:
    """192 and 768 pairs in one run: the 768-pair processes are judged against the 768-pair single process."""
    rows = [_csr_row("auto", 1, 4.0), _csr_row("auto", 2, 7.0), _csr_row("auto", 1, 5.0, 768),
            _csr_row("auto", 2, 9.5, 768)]  # fmt: skip
    checks = bench_csr_scale.compare(rows)
    assert rows[1]["x_one_process"] == approx(7.0 / 4.0) and rows[3]["x_one_process"] == approx(9.5 / 5.0)
    assert [(c["where"].split(",")[0], c["what"], c["met"]) for c in checks] == [
        ("192 pairs", "x batch 1", False), ("192 pairs", "2 procs / 1", False),
        ("768 pairs", "x batch 1", True), ("768 pairs", "2 procs / 1", True)]  # fmt: skip


def test_a_pass_reads_apart_into_its_first_steady_and_last_batches() -> None:
    # rank 0: a slow first batch of 64, three steady ones, a short tail of 4; rank 1's batches are not read
    batches = [[0, 64, 0.94], [0, 64, 0.80], [1, 64, 9.0], [0, 64, 0.84], [0, 64, 0.82], [0, 4, 0.42]]
    profile = bench_eval_gpu.batch_profile(batches, wall_s=4.62)
    assert profile is not None
    assert (profile["batches"], profile["full_size"], profile["last_size"]) == (5, 64, 4)
    assert (profile["first_s"], profile["median_s"], profile["last_s"]) == (0.94, 0.82, 0.42)
    assert profile["outside_s"] == approx(4.62 - 3.82)
    assert profile["steady_samples_per_s"] == approx(64 / 0.82)
    assert bench_eval_gpu.batch_profile([[1, 8, 1.0]], wall_s=1.0) is None  # nothing from rank 0
    two = bench_eval_gpu.batch_profile([[0, 64, 1.0], [0, 8, 0.3]], wall_s=1.5)
    assert two is not None and two["median_s"] is None and two["steady_samples_per_s"] is None  # no middle batch


def test_the_issue_47_families_run_at_the_gates_sides_with_k_of_n_over_9() -> None:
    # N at the gate's sides, by each processor's geometry: OneVision 729 + 2916 at 768² (four 384 px crops),
    # Qwen2.5-VL (1008 / 28)² = 1296, Qwen3-VL (1024 / 32)² = 1024, InternVL3 5 x 256 = 1280 at 672²
    assert {
        name: bench_eval_gpu.keep_of(name)
        for name in ("llava-onevision-7b", "qwen2.5-vl-7b", "qwen3-vl-8b", "internvl3-8b")
    } == {
        "llava-onevision-7b": 3645 // 9,
        "qwen2.5-vl-7b": 1296 // 9,
        "qwen3-vl-8b": 1024 // 9,
        "internvl3-8b": 1280 // 9,
    }
    assert (bench_eval_gpu.keep_of("llava-next-7b"), bench_eval_gpu.keep_of("llava-1.5-7b")) == (160, 64)
    rows = [_eval_row("llava-onevision-7b", None, 1, 10.0), _eval_row("llava-onevision-7b", "care", 1, 14.0),
            _eval_row("qwen3-vl-8b", None, 1, 10.0), _eval_row("qwen3-vl-8b", "care", 1, 30.0)]  # fmt: skip
    bench_eval_gpu.add_ratios(rows)
    verdicts = {(c["where"], c["what"]): c["met"] for c in bench_eval_gpu.targets(rows)}
    assert verdicts == {
        ("llava-onevision-7b batch 32, 1 proc", "CaRe / all tokens"): False
    }  # 1.4 < 1.5; Qwen: reported


def test_a_task_at_a_side_holds_its_images_resized(tmp_path: Any) -> None:
    import json

    from PIL import Image

    name = bench_eval_gpu.write_task(tmp_path / "task", copies=2, side=96)
    rows = [json.loads(line) for line in (tmp_path / "task" / "data.jsonl").read_text().splitlines()]
    assert name == "care_pope_examples_x2" and len(rows) == 2 * len(bench_eval_gpu.task_rows())
    assert {Image.open(row["image"]).size for row in rows} == {(96, 96)}


def test_cpu_model_is_the_first_model_name_of_cpuinfo() -> None:
    text = "processor\t: 0\nvendor_id\t: x\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n\nprocessor\t: 1\n"
    assert context.cpu_model(text + "model name\t: other\n") == "Intel(R) Xeon(R) Platinum 8480+"
    assert context.cpu_model("processor\t: 0\n") is None


def test_care_stage_per_sample_counts_the_stages_care_times_itself() -> None:
    # the pipeline's "method" is the time outside CaRe's own stages (scoring, anchors, calibration)
    stages = {"scoring": 640.0, "anchors": 96.0, "calibration": 32.0, "method": 6.4, "projection": 3.2}
    assert bench_eval_gpu.care_ms_per_sample(stages, 64) == approx(777.6 / 64)


def test_the_tower_is_timed_alone_on_images_preprocessed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # the features stage less a preprocessing time measured in another call mixed two calls' paces; the tower's time
    # per image comes from encode_processed alone, every call on the same preprocessed inputs
    calls: list[tuple[str, Any]] = []
    processed = {"pixel_values": "four images' pixels"}

    class Image:
        height, width = 20, 30

    class Adapter:
        def preprocess(self, images: list[Any]) -> dict[str, str]:
            calls.append(("preprocess", len(images)))
            return processed

        def encode_processed(self, given: dict[str, str], sizes: list[tuple[int, int]]) -> None:
            calls.append(("encode", (given is processed, sizes)))

    def median_wall_ms(step: Any, reps: int, cuda: bool) -> float:
        for _ in range(reps):
            step()
        return 40.0  # the median call: 40 ms for the four images

    monkeypatch.setattr(bench_eval_gpu, "median_wall_ms", median_wall_ms)
    ms = bench_eval_gpu.tower_ms_per_image(Adapter(), [Image()] * 4, "cpu")
    assert calls[0] == ("preprocess", 4)
    assert calls[1:] == [("encode", (True, [(20, 30)] * 4))] * (1 + bench_eval_gpu.STAGE_REPEATS)
    assert ms == 10.0


def test_answers_that_run_out_of_memory_are_timed_at_half_the_batch_until_they_fit() -> None:
    sizes: list[int] = []

    class Adapter:
        def generate_batch(self, questions: list[str], *parts: list[Any], max_new_tokens: int) -> None:
            sizes.append(len(questions))
            if len(questions) > 16:
                raise RuntimeError("CUDA out of memory. Tried to allocate 1.45 GiB")

    feed = tuple([f"q{i}" for i in range(64)] for _ in range(4))
    size, first_ms, _ = bench_eval_gpu.answer_times(Adapter(), feed, 64, "cpu")
    assert size == 16 and first_ms >= 0
    calls = bench_eval_gpu.STAGE_REPEATS + 1
    assert sizes == [64, 32] + [16] * (2 * calls)  # one failed call each at 64 and 32, then both timings at 16


def test_answers_failing_otherwise_are_not_retried() -> None:
    class Adapter:
        def generate_batch(self, questions: list[str], *parts: list[Any], max_new_tokens: int) -> None:
            raise RuntimeError("device-side assert triggered")

    with raises(RuntimeError, match="device-side assert"):
        bench_eval_gpu.answer_times(Adapter(), ([""] * 8,), 8, "cpu")


def test_eval_block_gives_each_setting_its_rate_and_cares_stage_from_its_raw_timings() -> None:
    rows = [_eval_row("llava-onevision-7b", None, 1, 8.0, size=32), _eval_row("llava-onevision-7b", "care", 1, 24.0)]
    for row in rows:
        row |= {"peak_gpu_memory_gib": 30.0, "keep": None if row["method"] is None else 405, "samples": 516}
    bench_eval_gpu.add_ratios(rows)
    rows[1]["batch_profile"] = bench_eval_gpu.batch_profile([[0, 32, 1.5], [0, 32, 1.0], [0, 32, 1.0], [0, 4, 0.2]],
                                                            wall_s=4.5)  # fmt: skip
    side = {"preprocessing": 7.0, "tower": 12.0, "care": 0.1, "prefill": 10.0, "decoding": 1.0}
    stages = {
        "batch_size": 32,
        "care_timings_ms": {"scoring": 300.0, "anchors": 60.0, "method": 4.0},
        "care": {"ms_per_sample": side},
        "all tokens": {"ms_per_sample": dict(side, care=0.0, prefill=80.0)},
    }
    results = {"source": {"commit": "0123456789abcdef", "dirty": False}, "environment": {"gpus": ["H200"]},
               "rows": rows, "targets": bench_eval_gpu.targets(rows), "preprocessing_share": [],
               "backbones": {"llava-onevision-7b": {"stages": stages}}}  # fmt: skip
    block = bench_eval_gpu.render_markdown(results, "x.json")
    assert "| llava-onevision-7b (768²), 405 | 1 | 8.00 (32, 30.0) | 24.00 (32, 30.0) | 3.00 |" in block
    assert "Targets: llava-onevision-7b batch 32, 1 proc, CaRe / all tokens 3.00 (target 1.5): MET." in block
    # CaRe: (300 + 60 + 4) / 32 = 11.375 ms a sample, never the JSON's own 0.1; with it 41.375 ms a sample, of which
    # the tower's 12 are 29% and CaRe's 11.375 are 27%
    assert (
        "tower 12.0 (29%), care 11.4 (27%), prefill 10.0 (24%), decoding 1.0 (2%) ms with CaRe (41.4); prefill "
        "80.0 of 100.0 with all tokens" in block
    )
    # 32 samples in the 1.0 s full batch; 4.5 - (1.5 + 1.0 + 1.0 + 0.2) = 0.8 s outside the batches (a result from
    # before care eval reported its wait for inputs says nothing of it)
    assert (
        "llava-onevision-7b CaRe's pass (process 0): first batch 1.50 s, full batches 1.00 s (32.00 samples/s), "
        "0.8 s outside its batches." in block
    )
    rows[1]["input_wait_s"] = 0.3
    assert "0.8 s outside its batches (0.3 s of them waiting for prepared images)." in bench_eval_gpu.render_markdown(
        results, "x.json"
    )
    assert block.rstrip().endswith("commit 0123456789).")


def test_eval_block_says_which_backbones_stages_were_not_timed_and_why(tmp_path: Path) -> None:
    _eval_result(tmp_path / "r.json", ["llava-next-7b", "qwen3-vl-8b"])
    results = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))
    results["backbones"]["llava-next-7b"]["stages_skipped"] = "out of memory timing the stages at batch 64"
    block = bench_eval_gpu.render_markdown(results, "r.json")
    assert "llava-next-7b stages: not timed (out of memory timing the stages at batch 64)." in block
    assert "qwen3-vl-8b stages" not in block and "qwen3-vl-8b per sample" not in block


def test_stage_line_names_the_smaller_batch_all_tokens_answered_at() -> None:
    side = {"preprocessing": 5.0, "tower": 5.0, "prefill": 5.0, "decoding": 5.0}
    stages = {"batch_size": 64, "care_timings_ms": {"scoring": 320.0}, "care": {"ms_per_sample": side},
              "all tokens": {"ms_per_sample": dict(side, prefill=50.0), "answer_batch_size": 32}}  # fmt: skip
    line = bench_eval_gpu._stage_line("llava-next-7b", stages)
    assert line.endswith("prefill 50.0 of 65.0 with all tokens (answers at batch 32: batch 64 ran out of memory).")
    assert "care 5.0 (20%)" in line  # 320 ms / 64 samples, of 25 ms a sample


def test_stage_line_says_how_an_older_result_timed_the_tower() -> None:
    side = {"preprocessing": 5.0, "tower": 5.0, "prefill": 5.0, "decoding": 5.0}
    stages = {"batch_size": 8, "care_timings_ms": {"scoring": 40.0}, "care": {"ms_per_sample": side},
              "all tokens": {"ms_per_sample": side}}  # fmt: skip
    older = bench_eval_gpu._stage_line("llava-next-7b", stages)
    newer = bench_eval_gpu._stage_line("llava-next-7b", dict(stages, tower_timing="encode_processed alone"))
    assert "stage by stage (the tower as the features stage less the pool's preprocessing timed in" in older
    assert "timed stage by stage: preprocessing 5.0 (20%), tower 5.0 (20%)" in newer


def test_eval_block_says_when_the_all_token_setting_paid_lmms_evals_one_time_imports(tmp_path: Path) -> None:
    _eval_result(tmp_path / "r.json", ["llava-next-7b"])
    older = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))
    newer = dict(older, setting_clock="after lmms-eval's aggregation imports")
    said = "first setting (all tokens) also paid lmms-eval's one-time imports"
    assert said in bench_eval_gpu.render_markdown(older, "r.json")
    assert said not in bench_eval_gpu.render_markdown(newer, "r.json")


def test_docs_hold_each_backbones_newest_eval_result_as_rendered() -> None:
    assert bench_eval_gpu.newest_per_backbone(), "no committed care eval result naming its commit"
    text = (bench_eval_gpu.ROOT / bench_eval_gpu.DOC_FILE).read_text(encoding="utf-8")
    block = bench_eval_gpu.docs_block()
    assert bench_eval_gpu.BEGIN + "\n" + block + bench_eval_gpu.END in text, (
        "run python -m benchmarks.bench_eval_gpu --docs"
    )


def _eval_result(path: Path, backbones: list[str]) -> None:
    rows = [_eval_row(name, method, 1, rate) for name in backbones for method, rate in ((None, 10.0), ("care", 30.0))]
    for row in rows:
        row |= {"peak_gpu_memory_gib": 20.0, "keep": None if row["method"] is None else 100, "samples": 12}
    bench_eval_gpu.add_ratios(rows)
    results = {"source": {"commit": path.stem[:10], "dirty": False}, "environment": {"gpus": ["H200"]}, "rows": rows,
               "targets": bench_eval_gpu.targets(rows), "preprocessing_share": [],
               "backbones": {name: {"stages": None} for name in backbones}}  # fmt: skip
    path.write_text(json.dumps(results), encoding="utf-8")


def test_docs_show_each_backbone_from_its_newest_result_only(tmp_path: Path) -> None:
    _eval_result(tmp_path / "2026-01-01-000000-eval-gpu-h200.json", ["llava-next-7b", "qwen2.5-vl-7b"])
    _eval_result(tmp_path / "2026-01-02-000000-eval-gpu-h200.json", ["qwen2.5-vl-7b", "internvl3-8b"])
    (tmp_path / "2026-01-03-000000-eval-gpu-h200.json").write_text(json.dumps({"rows": []}), encoding="utf-8")
    newest = bench_eval_gpu.newest_per_backbone(tmp_path)
    assert [(path.name[:10], names) for path, names in newest] == [
        ("2026-01-01", ["llava-next-7b"]), ("2026-01-02", ["qwen2.5-vl-7b", "internvl3-8b"])]  # fmt: skip
    block = bench_eval_gpu.docs_block(tmp_path)
    assert block.count("| qwen2.5-vl-7b (1008²)") == 1  # the older file's Qwen2.5-VL row is superseded
    assert block.count("| llava-next-7b (task images)") == 1 and block.count("| internvl3-8b (672²)") == 1
    assert (
        block.index("llava-next-7b")
        < block.index("Source: `benchmarks/results/2026-01-01")
        < block.index("| qwen2.5-vl-7b")
    )


def test_onevision_over_all_tokens_is_judged_at_each_settings_auto_batch_size() -> None:
    """Issue #47's OneVision target compares the settings as a user's ``auto`` runs them (all tokens at 32, CaRe at
    64); LLaVA-1.5's issue #22 target at the same sizes stays reported only."""
    rows = [
        _eval_row("llava-onevision-7b", None, 1, 10.0, size=32),
        _eval_row("llava-onevision-7b", "care", 1, 29.0, size=64),
        _eval_row("llava-1.5-7b", None, 1, 20.0, size=32),
        _eval_row("llava-1.5-7b", "care", 1, 50.0, size=64),
    ]
    bench_eval_gpu.add_ratios(rows)
    verdicts = {(c["where"], c["what"]): (c["value"], c["met"]) for c in bench_eval_gpu.targets(rows)}
    assert verdicts == {("llava-onevision-7b batch 64, 1 proc", "CaRe / all tokens"): (approx(2.9), True)}
    fixed = [dict(row, batch_size_requested="64", batch_size_start=64, batch_size=64) for row in rows[:2]]
    fixed[0]["batch_size_start"] = fixed[0]["batch_size"] = 32  # asked for 64, split to 32 after running out of memory
    bench_eval_gpu.add_ratios(fixed)
    assert bench_eval_gpu.targets(fixed) == []  # sizes differ and none was auto's pick: reported only


def test_the_decoding_is_the_median_of_paired_differences_that_a_change_of_pace_cancels_out_of() -> None:
    clock = {"ms": 0.0}
    calls: list[int] = []

    class Adapter:  # 300 ms to the first token, 7 ms for the 7 later ones; the first four calls 1.5 times slower
        def generate_batch(self, questions: list[str], *parts: list[Any], max_new_tokens: int) -> None:
            calls.append(max_new_tokens)
            pace = 1.5 if len(calls) <= 4 else 1.0
            clock["ms"] += pace * (300.0 + (7.0 if max_new_tokens > 1 else 0.0))

    def median_wall_ms(step: Any, reps: int, cuda: bool) -> float:
        before = clock["ms"]
        step()
        return clock["ms"] - before

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bench_eval_gpu, "median_wall_ms", median_wall_ms)
        size, first_ms, decoding_ms = bench_eval_gpu.answer_times(Adapter(), ([""] * 8,), 8, "cpu")
    assert bench_eval_gpu.STAGE_REPEATS == 3 and bench_eval_gpu.STAGE_NEW_TOKENS == 8
    assert calls == [1, 8] * 4  # alternating, one untimed pair first
    # timed rounds (450, 460.5), (300, 307), (300, 307): prefill median 300, decoding median of 10.5, 7, 7. Four
    # 1-token calls and then four 8-token ones would have given 450 and 307 - 450 = -143 ms of decoding.
    assert size == 8 and first_ms == 300.0 and decoding_ms == approx(7.0)


def test_a_stage_timed_below_zero_is_named_and_left_out_of_every_total() -> None:
    side = {"preprocessing": 5.0, "tower": 5.0, "prefill": 5.0, "decoding": 5.0}
    stages = {"batch_size": 8, "care_timings_ms": {"scoring": 40.0}, "care": {"ms_per_sample": side},
              "all tokens": {"ms_per_sample": dict(side, prefill=50.0, decoding=-6.0)},
              "tower_timing": "encode_processed alone"}  # fmt: skip
    line = bench_eval_gpu._stage_line("qwen2.5-vl-7b", stages)
    assert line.endswith("prefill 50.0 of 60.0 with all tokens (not counted: decoding -6.0 ms, timed below zero).")
    assert "ms with CaRe (25.0);" in line  # 5 + 5 + 5 (40 ms / 8) + 5 + 5
