"""`care reduce` end to end on the embedded demo backbone, and every bad input it must refuse cleanly."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors import safe_open

from care_core import CaReConfig


def test_ratio_011_gives_63_of_576(care, photo: Path) -> None:
    run = care("reduce", photo, "--ratio", "0.11", "--json")
    assert run.code == 0, run.err
    summary = run.json()
    assert (summary["N"], summary["K"]) == (576, 63)
    assert summary["backbone"]["demo"] is True
    assert "trained on synthetic shapes" in summary["backbone"]["note"]
    anchors = summary["anchors"]
    assert anchors == sorted(anchors) and len(set(anchors)) == 63
    assert sorted(summary["anchor_order"]) == anchors
    assert set(summary["signals"]).isdisjoint(anchors)
    assert summary["num_signals"] == len(summary["signals"])
    assert math.isclose(summary["signal_share"], len(summary["signals"]) / (576 - 63))
    for stage in ("load", "features", "scoring", "anchors", "calibration", "total"):
        assert summary["timings_ms"][stage] >= 0
    assert summary["config"] == CaReConfig().to_dict()


def test_human_output_says_demo_backbone(care, photo: Path) -> None:
    run = care("reduce", photo, "--keep", "64")
    assert run.code == 0, run.err
    assert "demo backbone: tiny model trained on synthetic shapes" in " ".join(run.out.split())
    assert "K = 64" in run.out and "N = 576" in run.out
    assert "scoring" in run.out and "calibration" in run.out


def test_same_seed_same_output_other_seed_differs(care, photo: Path) -> None:
    first = care("reduce", photo, "--keep", "40", "--seed", "7", "--json").json()
    second = care("reduce", photo, "--keep", "40", "--seed", "7", "--json").json()
    other = care("reduce", photo, "--keep", "40", "--seed", "8", "--json").json()
    assert first["anchor_order"] == second["anchor_order"] and first["signals"] == second["signals"]
    assert first["config"]["seed"] == 7 and other["config"]["seed"] == 8


def test_every_hyperparameter_is_an_option(care, photo: Path) -> None:
    run = care(
        "reduce", photo, "--keep", "20", "--json", "--h", "0.001", "--m", "8", "--lambda", "0.3", "--eta", "0.2",
        "--theta-s", "0.3", "--theta-c", "0.5", "--alpha", "0.2", "--sigma-p", "0.3", "--tau-g", "0.05",
        "--tau-c", "0.2", "--tau-s", "0.1", "--eps", "1e-7", "--seed", "3", "--engine", "fd",
        "--matmul-precision", "float32", "--kernel", "torch",
    )  # fmt: skip
    assert run.code == 0, run.err
    assert run.json()["config"] == {
        "h": 0.001, "m": 8, "lam": 0.3, "eta": 0.2, "theta_s": 0.3, "theta_c": 0.5, "alpha": 0.2, "sigma_p": 0.3,
        "tau_g": 0.05, "tau_c": 0.2, "tau_s": 0.1, "eps": 1e-7, "seed": 3, "engine": "fd",
        "matmul_precision": "float32", "kernel": "torch",
    }  # fmt: skip
    assert set(CaReConfig.field_names()) == set(run.json()["config"])


def test_out_file_reloads_and_agrees_with_summary(care, photo: Path, tmp_path: Path) -> None:
    out = tmp_path / "red.safetensors"
    summary = care("reduce", photo, "--ratio", "0.11", "--out", out, "--json").json()
    assert summary["out"] == str(out)
    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
        t = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    assert t["anchors"].tolist() == summary["anchors"]
    assert t["anchor_order"].tolist() == summary["anchor_order"]
    assert t["signals"].tolist() == summary["signals"]
    assert t["calibrated_tokens"].shape[0] == t["projected_tokens"].shape[0] == 63
    assert t["psi_bar"].shape == (576,) and t["positions"].shape == (576, 2) and t["boxes"].shape == (576, 4)
    assert float(t["psi_bar"].min()) >= 0 and float(t["psi_bar"].max()) <= 1
    assert json.loads(meta["config"]) == summary["config"]
    assert json.loads(meta["backbone"])["demo"] is True
    assert (int(meta["N"]), int(meta["K"])) == (576, 63)
    assert "torch" in json.loads(meta["versions"])
    # Calibration keeps each anchor's norm (Eq. 9), so the saved tokens are not the raw features.
    assert torch.all(t["calibrated_tokens"].norm(dim=1) > 0)


def test_out_is_never_over_an_input_or_an_existing_file(care, photo: Path, tmp_path: Path) -> None:
    original = photo.read_bytes()
    run = care("reduce", photo, "--keep", "8", "--out", photo)
    assert run.code == 2 and "input" in run.err
    assert photo.read_bytes() == original
    existing = tmp_path / "keep.safetensors"
    existing.write_bytes(b"precious")
    run = care("reduce", photo, "--keep", "8", "--out", existing)
    assert run.code == 2 and "--force" in run.err
    assert existing.read_bytes() == b"precious"
    run = care("reduce", photo, "--keep", "8", "--out", existing, "--force", "--json")
    assert run.code == 0, run.err
    assert existing.read_bytes() != b"precious"
    run = care("reduce", photo, "--keep", "8", "--out", tmp_path / "missing" / "x.safetensors")
    assert run.code == 2 and "does not exist" in run.err


def test_question_adds_csr(care, photo: Path) -> None:
    summary = care("reduce", photo, "--keep", "64", "--question", "What is in the image?", "--json").json()
    assert 0 <= summary["csr"] <= 100
    full = care("reduce", photo, "--ratio", "1", "--question", "What is in the image?", "--json").json()
    assert full["K"] == 576 and full["csr"] == pytest.approx(100, abs=1e-3)


def _bad_files(tmp_path: Path, photo: Path) -> dict[str, Path]:
    text = tmp_path / "notes.png"
    text.write_text("not an image")
    empty = tmp_path / "empty.jpg"
    empty.write_bytes(b"")
    truncated = tmp_path / "cut.jpg"
    data = photo.read_bytes()
    truncated.write_bytes(data[: len(data) // 3])
    return {"missing": tmp_path / "nope.jpg", "text": text, "empty": empty, "truncated": truncated,
            "folder": tmp_path}  # fmt: skip


@pytest.mark.parametrize("case", ["missing", "text", "empty", "truncated", "folder"])
def test_bad_images_are_one_line_errors(care, photo: Path, tmp_path: Path, case: str) -> None:
    path = _bad_files(tmp_path, photo)[case]
    run = care("reduce", path, "--keep", "8")
    assert run.code == 2
    assert run.err.startswith("error:") and len(run.err.strip().splitlines()) == 1, run.err
    assert "Traceback" not in run.err and run.out == ""


def test_decompression_bomb_is_refused(care, photo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    big = tmp_path / "big.png"
    Image.new("L", (400, 400)).save(big)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 160,000 pixels is > 2 x the limit
    run = care("reduce", big, "--keep", "8")
    assert run.code == 2 and "decompression bombs" in run.err and len(run.err.strip().splitlines()) == 1
    assert "set CARE_MAX_IMAGE_PIXELS=160000" in run.err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--ratio", "0"], "ratio"),
        (["--ratio", "-0.2"], "ratio"),
        (["--ratio", "1.5"], "ratio"),
        (["--ratio", "nan"], "ratio"),
        (["--ratio", "abc"], "ratio"),
        (["--ratio", "0.1", "--keep", "5"], "not both"),
        ([], "budget"),
        (["--keep", "577"], "577"),
        (["--keep", "0"], "keep"),
        (["--keep", "8", "--engine", "magic"], "engine"),
        (["--keep", "8", "--m", "0"], "m must"),
        (["--keep", "8", "--tau-s", "0"], "--tau-s must be > 0"),
        (["--keep", "8", "--model", "llava-hf/llava-1.5-7b-hf"], "local Hugging Face cache"),
        (["--keep", "8", "--model", "tiny-lava"], "tiny-llava"),
        (["--keep", "8", "--question", "  "], "question"),
        (["--keep", "8", "--device", "tpu"], "device"),
        (["--keep", "8", "--dtype", "float8"], "dtype"),
    ],
)
def test_bad_options_are_one_line_errors(care, photo: Path, args: list[str], needle: str) -> None:
    run = care("reduce", photo, *args)
    assert run.code == 2, run.out
    assert run.err.startswith("error:") and len(run.err.strip().splitlines()) == 1, run.err
    assert needle.lower() in run.err.lower()


def test_model_folder_errors(care, photo: Path, tmp_path: Path) -> None:
    not_model = tmp_path / "empty_folder"
    not_model.mkdir()
    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"x")
    for target, needle in ((not_model, "not a model folder"), (a_file, "is a file")):
        run = care("reduce", photo, "--keep", "8", "--model", target)
        assert run.code == 2 and needle in run.err, run.err
        assert len(run.err.strip().splitlines()) == 1


def test_console_module_runs_without_traceback(photo: Path, tmp_path: Path) -> None:
    ok = subprocess.run([sys.executable, "-m", "care_cli", "reduce", str(photo), "--keep", "16", "--json"],
                        capture_output=True, text=True, timeout=300)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["K"] == 16
    bad = subprocess.run([sys.executable, "-m", "care_cli", "reduce", str(tmp_path / "none.png"), "--keep", "1"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith("error:") and len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("backbone", ["tiny-llava", "tiny-llava-next", "tiny-qwen2.5-vl"])
def test_generate_answers_with_all_and_reduced_tokens(care, photo: Path, backbone: str) -> None:
    # one timed round after the warm-up: the answers and their fields are the point here, not stable medians
    run = care("reduce", photo, "--model", backbone, "--question", "What is in the image?", "--generate",
               "--max-new-tokens", "4", "--keep", "32", "--repeats", "1", "--json")  # fmt: skip
    assert run.code == 0, run.err
    summary = run.json()
    answers = summary["answers"]
    assert answers["question"] == "What is in the image?" and answers["max_new_tokens"] == 4
    assert answers["full"]["repeats"] == answers["reduced"]["repeats"] == 1
    assert answers["full"]["visual_tokens"] >= summary["N"] and answers["reduced"]["visual_tokens"] == 32
    for label in ("full", "reduced"):
        assert isinstance(answers[label]["answer"], str)
        assert answers[label]["prefill_ms"] > 0 and answers[label]["total_ms"] > 0
        assert answers[label]["first_token_ms"] > 0 and answers[label]["decoding"] in ("eager", "cuda-graph")
        assert answers[label]["first_token_from_features_ms"] > 0
    full, reduced = answers["full"], answers["reduced"]
    ratio = full["first_token_from_features_ms"] / reduced["first_token_from_features_ms"]
    assert answers["speedup_first_token"] == pytest.approx(ratio)


def test_cuda_graph_options(care, photo: Path) -> None:
    run = care("reduce", photo, "--keep", "16", "--cuda-graphs")
    assert run.code == 2 and "add --generate" in run.err and len(run.err.strip().splitlines()) == 1
    if not torch.cuda.is_available():  # the CPU demo: asking for graphs is a one-line error, not a fallback
        run = care("reduce", photo, "--keep", "16", "--generate", "--cuda-graphs")
        assert run.code == 2 and "CUDA graphs need a CUDA device" in run.err
        assert len(run.err.strip().splitlines()) == 1
    run = care("reduce", photo, "--keep", "16", "--generate", "--no-cuda-graphs", "--max-new-tokens", "2", "--repeats",
               "1", "--json")  # fmt: skip
    assert run.code == 0, run.err
    answers = run.json()["answers"]
    assert answers["full"]["decoding"] == answers["reduced"]["decoding"] == "eager"
    assert answers["cuda_graphs_off"] == "--no-cuda-graphs"  # says why they were off


def test_generate_human_output(care, photo: Path) -> None:
    run = care("reduce", photo, "--question", "What is in the image?", "--generate", "--max-new-tokens", "3",
               "--keep", "16")  # fmt: skip
    assert run.code == 0, run.err
    assert "Answers to" in run.out and "(reduced)" in run.out and "(full)" in run.out


def test_method_needing_cls_refuses_on_qwen(care, photo: Path) -> None:
    run = care("reduce", photo, "--model", "tiny-qwen2.5-vl", "--method", "visionzip", "--keep", "16")
    assert run.code == 2 and "CLS" in run.err and len(run.err.strip().splitlines()) == 1


def test_uncached_real_ids_give_the_same_clean_error(care, photo: Path) -> None:
    for repo in ("llava-hf/llava-v1.6-vicuna-7b-hf", "Qwen/Qwen2.5-VL-7B-Instruct"):
        run = care("reduce", photo, "--keep", "8", "--model", repo)
        assert run.code == 2 and "local Hugging Face cache" in run.err and f"hf download {repo}" in run.err


def test_hyperparameters_reach_the_ablations(care, photo: Path) -> None:
    """`--alpha` reaches prca+simple-calib (it used to reach only `care`); an ignored one changes nothing."""
    runs = {
        alpha: care("reduce", photo, "--keep", "32", "--method", "prca+simple-calib", "--alpha", alpha, "--json")
        for alpha in ("0.15", "0.3")
    }
    for run in runs.values():
        assert run.code == 0, run.err
    default, changed = runs["0.15"].json(), runs["0.3"].json()
    assert default["anchors"] == changed["anchors"]  # alpha acts after the anchors (Eq. 9)
    assert default["config"]["alpha"] == 0.15 and changed["config"]["alpha"] == 0.3
    assert "alpha" in changed["hyperparameters_used"]
    assert default["csr"] is None
    with_q = [care("reduce", photo, "--keep", "32", "--method", "prca+simple-calib", "--alpha", a, "-q", "What is it?",
                   "--json").json()["csr"] for a in ("0.15", "0.3")]  # fmt: skip
    assert with_q[0] != with_q[1]  # the calibrated tokens, and so what survives, changed
    ignored = care("reduce", photo, "--keep", "32", "--method", "prca+simple-calib", "--theta-c", "0.5", "-q",
                   "What is it?", "--json").json()["csr"]  # fmt: skip
    assert ignored == with_q[0]  # the ungated ablation reads no theta_c


def test_an_image_wider_than_the_qwen_limit_is_one_line_naming_it(care, tmp_path: Path) -> None:
    thin = tmp_path / "thin.png"
    Image.new("RGB", (3000, 10), (200, 30, 30)).save(thin)  # 300:1; Qwen's image processor takes up to 200:1
    run = care("reduce", thin, "--keep", "8", "--model", "tiny-qwen2.5-vl")
    assert run.code == 2 and run.out == ""
    assert run.err == (f"error: {thin} (3000×10 px): aspect ratio 300:1 exceeds Qwen2.5-VL's limit of 200:1 (its "
                       "image processor refuses wider or taller images); crop or pad it\n")  # fmt: skip


def test_kept_says_which_rows_stand_for_no_patch(care, photo: Path) -> None:
    """VisionZip keeps K rows of which one (CLS, ``token_index`` -1) is at no patch: the summary says so beside the
    patch list, whose count is then K - 1."""
    summary = care("reduce", photo, "--method", "visionzip", "--keep", "64", "--json").json()
    rows = summary["token_index"]
    patchless = sum(1 for index in rows if index < 0)
    assert len(rows) == 64 and patchless == 1 and len(set(rows) - {-1}) == len(summary["anchors"])
    out = " ".join(care("reduce", photo, "--method", "visionzip", "--keep", "64").out.replace("│", " ").split())
    patches = len(summary["anchors"])
    assert f"K = 64 (11.1% of N): {patches} patches + {patchless} row at no patch (a CLS or merged token)" in out
    assert f"(the first 24 of {patches};" in out
    plain = " ".join(care("reduce", photo, "--keep", "64").out.replace("│", " ").split())
    assert "K = 64 (11.1% of N) anchors" in plain  # every row at its own patch: nothing to add
