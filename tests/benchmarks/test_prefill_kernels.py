"""The prefill-kernels benchmark: kernel names sorted into classes (names from an H200 trace, classes by hand), the
per-call sums of a hand-made trace, and a smoke run on a tiny demo on the CPU."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from pytest import approx, mark

from benchmarks import prefill_kernels

H200_KERNELS = {  # kernel names seen in a Qwen3-VL / InternVL3 / LLaVA-1.5 prefill on an H200
    "nvjet_sm90_tst_128x160_64x5_4x1_v_bz_TNT": "gemm",
    "nvjet_sm90_tst_128x80_64x8_1x2_h_bz_splitK_TNT": "gemm",
    "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, __nv_bfloat16>": "gemm",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>": "gemm",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128": "attention",
    "triton_poi_fused__unsafe_view_mul_silu_1": "other",
    "triton_red_fused__fused_rms_norm__unsafe_view_add_0": "other",
    "void at::native::index_elementwise_kernel<128, 4, at::native::index_copy>": "other",
}


@mark.parametrize("name", sorted(H200_KERNELS))
def test_kernels_fall_in_the_class_their_name_says(name: str) -> None:
    assert prefill_kernels.kernel_class(name) == H200_KERNELS[name]


def test_kernel_summary_gives_each_class_its_ms_per_call() -> None:
    gemm, attention, other = "nvjet_a_TNT", "flash_fprop", "triton_poi_add"
    events = [
        {"cat": "kernel", "name": gemm, "dur": 1000.0},
        {"cat": "kernel", "name": gemm, "dur": 1000.0},
        {"cat": "kernel", "name": "void gemv2T_kernel", "dur": 500.0},
        {"cat": "kernel", "name": attention, "dur": 200.0},
        {"cat": "kernel", "name": other, "dur": 100.0},
        {"cat": "kernel", "name": other, "dur": 50.0},
        {"cat": "cpu_op", "name": "aten::mm", "dur": 9999.0},  # host time: not a kernel
        {"cat": "kernel", "name": "no duration"},  # an instant event: nothing to add
    ]
    summary = prefill_kernels.kernel_summary(events, calls=2)
    # two calls: (1000 + 1000 + 500) / 2 µs of GEMMs = 1.25 ms a call; 0.1 ms attention; (100 + 50) / 2 = 0.075 ms
    assert summary["ms"] == approx({"gemm": 1.25, "attention": 0.1, "other": 0.075})
    assert summary["kernels_ms"] == approx(1.425)
    assert summary["kernels_per_call"] == 3
    assert [k["name"] for k in summary["top"]] == [gemm, "void gemv2T_kernel", attention, other]
    assert summary["top"][0]["ms"] == approx(1.0)


def test_a_tiny_run_on_the_cpu_writes_each_familys_rows_and_floor(tmp_path: Path) -> None:
    prefill_kernels.main(["--tiny", "--device", "cpu", "--families", "llava-1.5", "--quick",
                          "--results-dir", str(tmp_path)])  # fmt: skip
    (path,) = tmp_path.glob("*-prefill-kernels.json")
    (family,) = json.loads(path.read_text(encoding="utf-8"))["families"]
    assert family["family"] == "llava-1.5" and family["K"] == family["N"] // 9
    assert family["visual_rows"] == family["K"] and family["text_rows"] > 0  # LLaVA-1.5 feeds its K rows as they are
    assert family["wall_ms"] > 0 and family["floor"]["floor_ms"] > 0
    assert family["x_floor"]["wall"] == approx(family["wall_ms"] / family["floor"]["floor_ms"])
    assert family["kernels"]["kernels_per_call"] == 0 and family["graph"] is None  # no GPU kernels on the CPU


def test_the_replayed_prefill_is_the_graph_of_the_last_calls_shape() -> None:
    graph = object()
    loop = SimpleNamespace(last_shape=(1, 96), prefills={(1, 96): SimpleNamespace(graph=graph),
                                                         (1, 2896): SimpleNamespace(graph=object())})  # fmt: skip
    assert prefill_kernels.replayed_prefill(SimpleNamespace(_greedy_graphs=loop)) is graph
    assert prefill_kernels.replayed_prefill(SimpleNamespace(_greedy_graphs=None)) is None  # no static loop made
    fresh = SimpleNamespace(last_shape=None, prefills={})
    assert prefill_kernels.replayed_prefill(SimpleNamespace(_greedy_graphs=fresh)) is None  # made, never run
    eager = SimpleNamespace(last_shape=(1, 96), prefills={(1, 96): SimpleNamespace(graph=None)})
    assert prefill_kernels.replayed_prefill(SimpleNamespace(_greedy_graphs=eager)) is None  # run step by step


def test_docs_block_gives_each_family_its_times_over_the_floor() -> None:
    kernels = {"kernels_ms": 7.5, "kernels_per_call": 663.0, "ms": {"gemm": 6.0, "attention": 0.25, "other": 1.25}}
    graph = {"replay_ms": 7.8, "outside_ms": 1.2}
    replayed = {"family": "qwen3-vl", "K": 113, "visual_rows": 113, "text_rows": 39, "floor": {"floor_ms": 3.0},
                "wall_ms": 9.0, "kernels": kernels, "graph": graph}  # fmt: skip
    eager = {**replayed, "family": "qwen3.5", "text_rows": 141, "wall_ms": 60.0, "graph": None}
    failed = {"family": "gemma3", "error": "its process exited with code 1"}
    results = {"source": {"commit": "0123456789abcdef", "dirty": True}, "environment": {"card": "NVIDIA H200"},
               "profiled_calls": 2, "reps": 20, "families": [replayed, eager, failed]}  # fmt: skip
    block = prefill_kernels.render_markdown(results, "x.json")
    assert ("| qwen3-vl | 113 | 152 | 3.00 | 9.00 (3.00) | 7.80 (2.60) | 1.20 | 7.50 (2.50) | 6.00 (2.00) | 0.25 | "
            "1.25 | 663 |") in block  # fmt: skip
    assert "| qwen3.5 | 113 | 254 | 3.00 | 60.00 (20.00) | — | — | 7.50 (2.50) |" in block
    assert "gemma3" not in block  # a family whose process failed has no row
    assert block.rstrip().endswith("commit 0123456789 with uncommitted changes).")


def test_docs_hold_the_newest_result_as_rendered() -> None:
    newest = prefill_kernels.newest_result()
    assert newest is not None, "no committed prefill-kernels result"
    block = prefill_kernels.render_markdown(json.loads(newest.read_text(encoding="utf-8")), newest.name)
    text = (prefill_kernels.ROOT / prefill_kernels.DOC_FILE).read_text(encoding="utf-8")
    assert prefill_kernels.BEGIN + "\n" + block + prefill_kernels.END in text, (
        "run python -m benchmarks.prefill_kernels --docs"
    )
