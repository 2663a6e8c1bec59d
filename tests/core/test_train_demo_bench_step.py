"""scripts/train_demo/bench_step: which bucket its warm-up phase times, its option errors, and a quick run's rows
(and the scratch folder it leaves behind: none)."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from scripts.train_demo import bench_step as bench


def test_the_warm_up_phase_times_the_bucket_of_fewest_tokens_at_step_0() -> None:
    buckets = [SimpleNamespace(n=1280, sizes=[(672, 672)]), SimpleNamespace(n=256, sizes=[(336, 336), (448, 448)]),
               SimpleNamespace(n=3328, sizes=[(384, 512)])]  # fmt: skip
    args = argparse.Namespace(steps=1000, warm_size=None, warm_share=0.0)
    assert bench._phase(args, SimpleNamespace(buckets=buckets), "warm-up") == 0
    assert (args.warm_size, args.warm_share) == ((336, 336), 0.99)
    # the mix: every bucket again, in the middle of the run (after the first 30%, where token subsets begin)
    assert bench._phase(args, SimpleNamespace(buckets=buckets), "mix") == 500
    assert (args.warm_size, args.warm_share) == (None, 0.0)


@pytest.mark.parametrize(
    ("option", "value"), [("--backbones", "tiny-llava,nope"), ("--batches", "0"), ("--pools", "disk")]
)
def test_a_bad_option_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], option: str, value: str) -> None:
    with pytest.raises(SystemExit) as stop:
        bench.parse([option, value])
    assert stop.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {option}")


def test_a_quick_run_times_each_phase_of_each_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scratch = tmp_path / "tmp"  # the system's temporary folder for this run: the training run's folder goes there
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    bench.main(["--quick", "--device", "cpu", "--backbones", "tiny-qwen2.5-vl", "--pools", "device",
                "--results-dir", str(tmp_path)])  # fmt: skip
    (written,) = tmp_path.glob("*-cpu-bench_train_step.json")
    rows = json.loads(written.read_text())["rows"]
    assert [(r["backbone"], r["batch"], r["pool"], r["phase"]) for r in rows] == [
        ("tiny-qwen2.5-vl", 2, "device", phase) for phase in bench.PHASES
    ]
    for r in rows:  # samples per second is the batch over the seconds a step took; no GPU, no peak memory
        assert r["s_per_step"] > 0 and r["peak_gpu_gb"] is None
        assert r["samples_per_s"] == pytest.approx(2 / r["s_per_step"], rel=0.01, abs=0.1)
    assert list(scratch.glob("care-train-step-*")) == []  # the training run's scratch folder was removed
