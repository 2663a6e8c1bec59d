"""The host-path benchmark's measures: its operator counter (counts written by hand), its stages on a tiny demo
(``generate`` as on a GPU, its loop without the prefill: no decoder layer runs, and the prompt's text rows come
kept), and its refusal of an unknown demo."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks import bench_host_path as bench

LAYER_OPS = {"mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu"}  # a decoder layer's matmuls


def test_the_counter_counts_each_dispatched_operator_by_name() -> None:
    ops = bench.counted(lambda: (torch.ones(3) + torch.ones(3)).view(3, 1).sum())
    assert ops == {"ones": 2, "add": 1, "view": 1, "sum": 1}


def test_every_stage_is_measured_and_generate_runs_no_decoder_layer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CARE_HOME", str(tmp_path))
    result = bench.bench_demo("tiny-internvl3", reps=1)
    stages = {row["stage"]: row for row in result["stages"]}
    assert list(stages) == [*bench.STAGES, "host total"]
    assert stages["host total"]["ops"] == sum(stages[s]["ops"] for s in bench.HOST_STAGES)
    assert all(stages[s]["host_ms"] > 0 for s in bench.STAGES)
    # the question's text rows are embedded at its first request and kept: a repeat puts the loop's prompt together
    # without an operator, and the loop writes it into its inputs with one cat
    assert all(stages[s]["ops"] > 0 for s in bench.STAGES if s != "static_prompt")
    assert stages["static_prompt"]["ops"] == 0
    for stage in ("generate", "static_loop"):  # the prefill (a graph replay on a GPU) left out, not model.generate
        assert not LAYER_OPS & set(stages[stage]["op_names"]), stage
        assert "embedding" not in stages[stage]["op_names"] and stages[stage]["op_names"]["cat"] == 1, stage


def test_an_unknown_demo_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        bench.main(["--demos", "tiny-qwen3-vl,tiny-llava"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --demos: tiny-llava not among")
