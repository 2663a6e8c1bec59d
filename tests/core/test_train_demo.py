"""scripts/train_demo: its merge augmentation (against a hand-built case and a per-token loop), its logged answer
accuracy (a hand-built case), its stop on Ctrl-C (one line, exit code 130, no traceback), its draw of a step's bucket
of token geometry (the pool's shares of scenes), and per trained backbone: the world's image sizes grouped by token
geometry (hand-computed token counts), a step lowers the loss with gradients reaching tower, projector, language model
(and Qwen3-VL's deepstack mergers), the rows it feeds for scenes of two sizes equal the adapter's own inference inputs
(ids, positions, deepstack rows), and a checkpoint of a run on the world's mix of sizes resumed gives the parameters
of an uninterrupted run (the two Qwen families)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from benchmarks.demo_world import TRAIN_SPLIT, load_photos
from care_core.backbones.families import DemoBackbone, backbone_family, register_family, unregister_family
from care_core.synthetic import IMAGE_SIZES, make_scene
from scripts.train_demo import cli, loop
from scripts.train_demo.buckets import IGNORED, pick_bucket, position_bins
from scripts.train_demo.loop import (
    Batch,
    answer_accuracy,
    draw_batch,
    fit,
    forward,
    losses,
    merge_into_kept,
    model_inputs,
    optimiser,
)

TRAINED = [
    "tiny-llava",
    "tiny-llava-next",
    "tiny-qwen2.5-vl",
    "tiny-qwen3-vl",
    "tiny-llava-onevision",
    "tiny-internvl3",
    "tiny-qwen3.5",
    "tiny-gemma3",
]
#: per demo, its token count N at each of the world's image sizes, by the processors' rules: tiny-llava crops every
#: size to one 336 px view (24 x 24 patches); Qwen2.5-VL rounds each side to a multiple of 28 px (14 px patches
#: merged 2 x 2), Qwen3-VL and Qwen3.5 to 32 px (16 px patches; 336 / 32 = 10.5 rounds to 10); InternVL3 cuts the
#: 448 px tiles of the closest aspect ratio, plus a thumbnail when there are several, 256 tokens each; Gemma 3 squashes
#: every size to one 896 px view pooled to 16 x 16
TOKENS_AT = {
    "tiny-llava": dict.fromkeys(IMAGE_SIZES, 576),
    "tiny-qwen2.5-vl": {(336, 336): 12 * 12, (448, 448): 16 * 16, (672, 672): 24 * 24, (336, 504): 12 * 18,
                        (504, 336): 18 * 12, (384, 512): 14 * 18, (480, 360): 17 * 13, (336, 672): 12 * 24},
    "tiny-qwen3-vl": {(336, 336): 10 * 10, (448, 448): 14 * 14, (672, 672): 21 * 21, (336, 504): 10 * 16,
                      (504, 336): 16 * 10, (384, 512): 12 * 16, (480, 360): 15 * 11, (336, 672): 10 * 21},
    "tiny-qwen3.5": {(336, 336): 10 * 10, (448, 448): 14 * 14, (672, 672): 21 * 21, (336, 504): 10 * 16,
                     (504, 336): 16 * 10, (384, 512): 12 * 16, (480, 360): 15 * 11, (336, 672): 10 * 21},
    "tiny-gemma3": dict.fromkeys(IMAGE_SIZES, 256),
    "tiny-internvl3": {(336, 336): 256, (448, 448): 256, (672, 672): (4 + 1) * 256, (336, 504): (6 + 1) * 256,
                       (504, 336): (6 + 1) * 256, (384, 512): (12 + 1) * 256, (480, 360): (12 + 1) * 256,
                       (336, 672): (2 + 1) * 256},
}  # fmt: skip
#: per demo, the sizes that share a bucket (one geometry: same token layout, same processor output); the others have
#: one bucket per size
SHARED = {"tiny-llava": [list(dict.fromkeys(IMAGE_SIZES))], "tiny-internvl3": [[(336, 336), (448, 448)]],
          "tiny-gemma3": [list(dict.fromkeys(IMAGE_SIZES))]}  # fmt: skip
#: the sizes of the training split's scenes 0 and 1 (the tests' pool)
SCENE_SIZES = ((336, 672), (448, 448))


def test_dropped_tokens_join_their_nearest_kept_token() -> None:
    # tokens 0 and 2 kept; 1 points like 0, 3 like 2: rows are the means of {0, 1} and {2, 3}
    hidden = torch.tensor([[[1.0, 0.0], [3.0, 0.1], [0.0, 1.0], [0.2, 5.0]]])
    rows = merge_into_kept(hidden, torch.tensor([[0, 2]]))
    assert torch.allclose(rows, torch.tensor([[[2.0, 0.05], [0.1, 3.0]]]))
    # kept order is the row order (shuffled subsets stay shuffled)
    assert torch.allclose(merge_into_kept(hidden, torch.tensor([[2, 0]])), rows.flip(1))


def test_matches_a_per_token_loop() -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 40, 8, generator=g, dtype=torch.float64)
    order = torch.stack([torch.randperm(40, generator=g)[:7] for _ in range(3)])
    rows = merge_into_kept(hidden, order)
    for b in range(3):
        members: list[list[int]] = [[int(i)] for i in order[b]]
        kept = torch.nn.functional.normalize(hidden[b, order[b]], dim=-1)
        for t in range(40):
            if t in order[b].tolist():
                continue
            members[int((kept @ torch.nn.functional.normalize(hidden[b, t], dim=0)).argmax())].append(t)
        for j, group in enumerate(members):
            assert torch.allclose(rows[b, j], hidden[b, group].mean(0), atol=1e-12)
    assert sum(len(m) for m in members) == 40


def test_an_answer_counts_as_right_only_when_every_answer_token_is() -> None:
    # two answers of three tokens after one prompt token; the second answer's first token is wrong, and so is the
    # first sample's prompt position (not an answer token): 5 of 6 answer tokens right, 1 of 2 answers
    text = torch.tensor([[4, 1, 2, 3], [4, 2, 1, 3]])
    target = torch.tensor([[False, True, True, True]] * 2)
    predicted = torch.tensor([[0, 1, 2, 3], [4, 0, 1, 3]])
    logits = torch.nn.functional.one_hot(predicted, 5).float()
    assert float(answer_accuracy(logits, text, target)) == 0.5
    assert float(answer_accuracy(torch.nn.functional.one_hot(text, 5).float(), text, target)) == 1.0


def test_a_step_draws_its_bucket_by_the_pools_share_of_scenes() -> None:
    # scenes 1 : 0 : 3: a uniform draw u < 1/4 picks bucket 0, any other bucket 2 (bucket 1 holds no scene)
    gen, uniform = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    drawn = [pick_bucket(gen, [1, 0, 3]) for _ in range(12)]
    assert drawn == [0 if float(torch.rand((), generator=uniform)) < 0.25 else 2 for _ in range(12)]
    assert set(drawn) == {0, 2}
    # over 9,000 draws the buckets of 6 : 2 : 1 scenes come about 6,000, 2,000 and 1,000 times (within 4 sigma)
    gen = torch.Generator().manual_seed(0)
    counts = Counter(pick_bucket(gen, [6, 2, 1]) for _ in range(9000))
    for bucket, share in enumerate((6 / 9, 2 / 9, 1 / 9)):
        assert abs(counts[bucket] - 9000 * share) < 4 * math.sqrt(9000 * share * (1 - share)), counts


def test_base_view_position_targets_ignore_the_other_views_tokens() -> None:
    # rows (y) and columns (x) as fractions of the image: classes floor(24 * p), clamped to 0..23
    positions = torch.tensor([[0.0, 0.99], [0.5, 0.26], [0.75, 0.1], [1.0, 0.5]])
    crops = SimpleNamespace(positions=positions, views=torch.tensor([0, 0, 1, 1]))
    every = [[0, 12, 18, 23], [23, 6, 2, 12]]
    assert position_bins(crops).tolist() == every
    assert position_bins(crops, "base-view").tolist() == [[0, 12, IGNORED, IGNORED], [23, 6, IGNORED, IGNORED]]
    one_view = SimpleNamespace(positions=positions, views=None)  # a single view (LLaVA-1.5, the Qwen grids)
    assert position_bins(one_view, "base-view").tolist() == every
    no_base = SimpleNamespace(positions=positions, views=torch.ones(4, dtype=torch.long))  # nothing would be asked
    assert position_bins(no_base, "base-view").tolist() == every


def test_ctrl_c_in_training_stops_with_one_line_and_130(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def prepare(args: Any, run: Any, drawn: Any = None) -> tuple[Any, Any]:
        run.log("pool: 8 scenes")  # set-up done, log written
        return None, None

    def fit(*args: Any) -> float:
        raise KeyboardInterrupt  # Ctrl-C during the steps

    monkeypatch.setattr(cli, "prepare", prepare)
    monkeypatch.setattr(cli, "fit", fit)
    code = cli.main(["--out", str(tmp_path), "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 130
    assert err.splitlines() == [f"interrupted; saved so far: {tmp_path / 'log.txt'}"]
    assert "pool: 8 scenes" in (tmp_path / "log.txt").read_text()
    assert not (tmp_path / "model").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
@pytest.mark.parametrize("replicas", ["1", "2"])
def test_cuda_where_none_is_visible_is_one_line_and_exit_2_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], replicas: str
) -> None:
    code = cli.main(["--out", str(tmp_path / "run"), "--device", "cuda", "--replicas", replicas])
    assert code == 2
    assert capsys.readouterr().err.splitlines() == ["error: --device cuda: no CUDA device here (use --device cpu)"]
    assert not (tmp_path / "run").exists()


def test_replicas_share_one_pool_and_each_trains_the_run_alone(tmp_path: Path) -> None:
    """``--replicas 2`` on the CPU (bit-reproducible there): both forked runs give the weights of the same command
    without replicas, each in its own folder with its own log and summary, from one drawing of the pool."""
    # float sums depend on the threads: every run on the same two, whatever the host's cores (torch caps an
    # OMP_NUM_THREADS at the cores it sees, an explicit count it does not: the old env-based match broke on 16 cores)
    options = ["--backbone", "tiny-llava", "--scenes", "2", "--workers", "1", "--batch", "2", "--steps", "2",
               "--device", "cpu", "--skip-eval", "--threads", "2"]  # fmt: skip
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}

    def train(out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "scripts.train_demo", "--out", str(out), *options, *extra]
        return subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)

    both, alone = train(tmp_path / "both", "--replicas", "2"), train(tmp_path / "alone")
    assert both.returncode == 0 and alone.returncode == 0, both.stderr + alone.stderr
    assert [line for line in both.stdout.splitlines() if "exit code" in line] == [
        f"{tmp_path / 'both' / f'run-{k}'}: exit code 0" for k in (0, 1)
    ]
    expected = json.loads((tmp_path / "alone" / "tiny-llava.json").read_text())["sha256"]
    for k in (0, 1):
        run = tmp_path / "both" / f"run-{k}"
        summary = json.loads((run / "tiny-llava.json").read_text())
        assert (summary["sha256"], summary["replica"]) == (expected, f"{k + 1} of 2")
        assert "drawn once for 2 runs" in (run / "log.txt").read_text()
        assert (run / "model" / "model.safetensors").is_file()


@pytest.mark.parametrize("failing", [None, 0])
def test_sequential_replicas_run_one_after_another_and_stop_at_a_failed_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], failing: int | None
) -> None:
    events = tmp_path / "events"

    def child(args: Any, argv: Any, k: int, drawn: Any) -> None:  # a forked run: says when it starts and ends
        try:
            with open(events, "a") as sink:
                sink.write(f"start {k}\n")
            time.sleep(0.2)  # at once, the other runs would start meanwhile
            with open(events, "a") as sink:
                sink.write(f"end {k}\n")
        finally:  # never back into pytest's frames in the forked process
            os._exit(1 if k == failing else 0)

    monkeypatch.setattr(cli, "build", lambda args, run: (None, SimpleNamespace(image_processor=None), [], {}))
    monkeypatch.setattr(cli, "draw", lambda *args: None)
    monkeypatch.setattr(cli, "_child", child)
    monkeypatch.setattr(torch, "set_num_threads", lambda threads: None)  # the parent's one thread: not this process's
    args = cli.parse(["--out", str(tmp_path / "runs"), "--replicas", "3", "--sequential", "--device", "cpu"])
    code = cli.replicas(args, None)
    ran = 3 if failing is None else failing + 1
    assert events.read_text().split("\n")[:-1] == [f"{when} {k}" for k in range(ran) for when in ("start", "end")]
    assert code == (0 if failing is None else 1)
    said = capsys.readouterr()
    assert (said.out + said.err).count("exit code") == ran


def test_sequential_needs_replicas(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as stop:
        cli.parse(["--out", str(tmp_path), "--sequential"])
    assert stop.value.code == 2
    assert "--sequential orders the runs of --replicas N" in capsys.readouterr().err


def test_a_registered_familys_demo_with_a_weights_file_is_trainable(tmp_path: Path) -> None:
    """The trainable demos are the records' demos with a weights file: a family registered at run time included."""
    builders = "care_core.backbones.llava_1_5.demo"
    demo = DemoBackbone("tiny-test-copy", 1, "test-llava-copy", f"{builders}:build_trained_tiny_llava",
                        "a test's copy of tiny-llava", weights="tiny-test-copy.safetensors")  # fmt: skip
    untrained = DemoBackbone("tiny-test-copy-random", 1, "test-llava-copy",
                             f"{builders}:build_tiny_llava", "random weights")  # fmt: skip
    family = register_family(dataclasses.replace(
        backbone_family("llava-1.5"), name="test-llava-copy", display="Test LLaVA copy",
        model_types=("test_llava_copy",), lmms_eval_model="care_test_copy", demos=(demo, untrained), rank=999,
    ))  # fmt: skip
    try:
        assert "tiny-test-copy" in cli.trainable() and "tiny-test-copy-random" not in cli.trainable()
        assert cli.parse(["--backbone", "tiny-test-copy", "--out", str(tmp_path)]).backbone == "tiny-test-copy"
    finally:
        unregister_family(family.name)
    assert "tiny-test-copy" not in cli.trainable()
    assert set(TRAINED) <= set(cli.trainable())


# ------------------------------------------------------------------------------ one backbone, a few scenes, CPU
def _args(name: str, out: Path, *extra: str) -> argparse.Namespace:
    return cli.parse(["--backbone", name, "--out", str(out), "--batch", "2", "--scenes", "2", "--workers", "1",
                      "--device", "cpu", "--steps", "4", "--checkpoint-every", "2", *extra])  # fmt: skip


@pytest.fixture(scope="module", params=TRAINED)
def prepared(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Any]:
    out = tmp_path_factory.mktemp(request.param.replace(".", "-"))
    args = _args(request.param, out)
    parts, data = cli.prepare(args, cli.Run(out))
    return args, parts, data


def test_the_world_sizes_are_grouped_by_token_geometry(prepared: Any) -> None:
    args, parts, data = prepared
    assert args.size is None  # the default: the world's mix
    sizes = [size for geometry in parts.buckets for size in geometry.sizes]
    assert sorted(sizes) == sorted(set(IMAGE_SIZES))  # every size in exactly one bucket
    tokens_at = {size: geometry.n for geometry in parts.buckets for size in geometry.sizes}
    if args.backbone in TOKENS_AT:
        assert tokens_at == TOKENS_AT[args.backbone]
    shared = SHARED.get(args.backbone, [])
    alone = [[size] for size in tokens_at if all(size not in group for group in shared)]
    assert sorted(geometry.sizes for geometry in parts.buckets) == sorted(shared + alone)
    # the pool's 2 scenes (336x672, 448x448) each in its size's bucket, one tensor per bucket
    bucket_of = {size: i for i, geometry in enumerate(parts.buckets) for size in geometry.sizes}
    expected = [0] * len(parts.buckets)
    for size in SCENE_SIZES:
        expected[bucket_of[size]] += 1
    assert data.scenes == expected
    assert [len(pixels) for pixels in data.pixels] == expected
    assert [tuple(labels.shape[1:]) for labels, n in zip(data.labels, expected, strict=True) if n] == [
        (2, geometry.n) for geometry, n in zip(parts.buckets, expected, strict=True) if n
    ]


def test_one_size_gives_one_bucket(tmp_path: Path) -> None:
    _, _, geometries, centres = cli.build(_args("tiny-qwen2.5-vl", tmp_path, "--size", "336x336"), cli.Run(tmp_path))
    assert [(g.sizes, g.n) for g in geometries] == [([(336, 336)], 144)]
    assert list(centres) == [(336, 336)]


def _one(parts: Any, data: Any, question: int, order: torch.Tensor | None) -> Batch:
    """A batch of one question with all tokens (``order`` None) or the kept tokens ``order`` (1, K)."""
    _, text, answer = data.qas[question]
    bucket = data.bucket_of[question]
    feed = parts.buckets[bucket].feed
    ids = feed.layout(text).tail + data.answers[answer]
    target = torch.zeros(1, len(ids), dtype=torch.bool)
    target[0, -len(data.answers[answer]) :] = True
    no = torch.zeros(1, dtype=torch.bool)
    k = feed.n if order is None else int(order.shape[1])
    return Batch(torch.tensor([question]), no, no, k, order, False, [text], torch.tensor([ids]), target,
                 torch.tensor([len(ids)]), bucket)  # fmt: skip


@pytest.mark.parametrize("reduced", [False, True], ids=["all-tokens", "shuffled-subset"])
@pytest.mark.parametrize("scene_index", [0, 1], ids=["336x672", "448x448"])
def test_training_feeds_what_the_adapter_feeds_at_inference(prepared: Any, scene_index: int, reduced: bool) -> None:
    args, parts, data = prepared
    adapter = parts.adapter
    index = next(i for i, (scene_of, _, _) in enumerate(data.qas) if scene_of == scene_index)
    _, question, _ = data.qas[index]
    scene = make_scene(TRAIN_SPLIT, scene_index, size=args.size, photos=load_photos())
    assert (scene.image.height, scene.image.width) == SCENE_SIZES[scene_index]
    tokens = adapter.encode_image(scene.image)  # the inference path: processor, tower under no_grad
    assert tokens.num_tokens == parts.buckets[data.bucket_of[index]].n
    order = torch.randperm(tokens.num_tokens, generator=torch.Generator().manual_seed(1))[:40] if reduced else None
    with torch.no_grad():
        ours, _, _ = model_inputs(parts, data, _one(parts, data, index, None if order is None else order[None]))
        projected = adapter.projector(tokens.features if order is None else tokens.features[order])
        theirs = adapter._lm_inputs(question, tokens, projected, order)
        expected = adapter._prompt_embeddings(theirs)[0]
        # rows as input embeddings, or (deepstack families) placeholders + encoder outputs as at inference
        fed = ours["inputs_embeds"][0] if "inputs_embeds" in ours else adapter._prompt_embeddings(ours)[0]
    length = expected.shape[0]
    assert ours["attention_mask"][0].sum() > length  # the answer follows the prompt
    torch.testing.assert_close(fed[:length], expected, atol=2e-4, rtol=1e-3)
    if "input_ids" in ours:
        assert torch.equal(ours["input_ids"][0, :length], theirs["input_ids"][0])
        assert torch.equal(ours["mm_token_type_ids"][0, :length], theirs["mm_token_type_ids"][0])
        levels = ours["mm_encoder_outputs"]["image"].deepstack_features
        expected_levels = theirs["mm_encoder_outputs"]["image"].deepstack_features
        assert len(levels) == len(expected_levels) == adapter.deepstack_levels
        for level, expected_level in zip(levels, expected_levels, strict=True):  # each row: its own token's
            torch.testing.assert_close(level[0], expected_level[0], atol=2e-4, rtol=1e-3)
    if "position_ids" in theirs:
        assert torch.equal(ours["position_ids"][:, 0, :length], theirs["position_ids"][:, 0])
    else:
        assert "position_ids" not in ours
    if "token_type_ids" in theirs:  # Gemma 3: the rows marked as one bidirectional block, the text and answer not
        assert torch.equal(ours["token_type_ids"][0, :length], theirs["token_type_ids"][0])
        assert not ours["token_type_ids"][0, length:].any()
    else:
        assert "token_type_ids" not in ours


def _batch(parts: Any, data: Any, questions: list[int]) -> Batch:
    """A batch of ``questions`` (of one bucket) with all tokens, right-padded as :func:`draw_batch` pads it."""
    bucket = data.bucket_of[questions[0]]
    feed = parts.buckets[bucket].feed
    seqs = [feed.layout(data.qas[q][1]).tail + data.answers[data.qas[q][2]] for q in questions]
    width = max(len(ids) for ids in seqs)
    text = torch.full((len(questions), width), parts.pad, dtype=torch.long)
    target = torch.zeros(len(questions), width, dtype=torch.bool)
    for row, (q, ids) in enumerate(zip(questions, seqs, strict=True)):
        text[row, : len(ids)] = torch.tensor(ids)
        target[row, len(ids) - len(data.answers[data.qas[q][2]]) : len(ids)] = True
    no = torch.zeros(len(questions), dtype=torch.bool)
    return Batch(torch.tensor(questions), no, no, feed.n, None, False, [data.qas[q][1] for q in questions], text,
                 target, torch.tensor([len(ids) for ids in seqs]), bucket)  # fmt: skip


def _own_answer_logits(adapter: Any, tokens: Any, question: str, answer: list[int]) -> torch.Tensor:
    """(A, V) logits that predict ``answer``'s A ids from the model's own forward on the adapter's inference prompt
    (all tokens) followed by the answer, alone: no padding; positions after the prompt one more per token."""
    with torch.no_grad():
        inputs = adapter._lm_inputs(question, tokens, adapter.projector(tokens.features), None)
        length, count = int(inputs["input_ids"].shape[1]), len(answer)
        for key, value in list(inputs.items()):
            if torch.is_tensor(value) and value.shape[-1] == length and key != "position_ids":
                fill = (
                    torch.tensor([answer])
                    if key == "input_ids"
                    else torch.full((1, count), int(key == "attention_mask"))
                )
                inputs[key] = torch.cat([value, fill.to(value)], dim=-1)
        if "position_ids" in inputs:  # (4, 1, L): the text and (t, h, w) rows, each one more per answer token
            positions = inputs["position_ids"]
            inputs["position_ids"] = torch.cat([positions, positions[..., -1:] + torch.arange(1, count + 1)], dim=-1)
        logits = adapter.model(**inputs, use_cache=False).logits[0]
    return logits[length - 1 : length - 1 + count]


#: the families whose padded training batch is checked against the model's own forward of each question alone: the
#: hybrid Gated DeltaNet decoder (right padding, causal in every layer) and Gemma 3's bidirectional image block
OWN_FORWARD = ("tiny-qwen3.5", "tiny-gemma3")


def test_a_padded_training_batch_gives_each_questions_own_answer_logits_and_loss(prepared: Any) -> None:
    args, parts, data = prepared
    if args.backbone not in OWN_FORWARD:
        pytest.skip("checked through its inference inputs (test_training_feeds_what_the_adapter_feeds_at_inference)")
    adapter = parts.adapter
    lengths: dict[int, int] = {}  # tail + answer length -> a question of scene 1 with it
    for i, (scene_of, question, answer) in enumerate(data.qas):
        if scene_of == 1:
            lengths.setdefault(
                len(parts.buckets[data.bucket_of[i]].feed.layout(question).tail) + len(data.answers[answer]), i
            )
    assert len(lengths) >= 2  # two questions of different lengths: the shorter one is padded
    questions = [lengths[min(lengths)], lengths[max(lengths)]]
    b = _batch(parts, data, questions)
    with torch.no_grad():
        logits, _ = forward(parts, data, b)
        loss = torch.nn.functional.cross_entropy(logits[b.target], b.text[b.target])
    tokens = adapter.encode_image(make_scene(TRAIN_SPLIT, 1, size=args.size, photos=load_photos()).image)
    own = [_own_answer_logits(adapter, tokens, data.qas[q][1], data.answers[data.qas[q][2]]) for q in questions]
    for row, expected in enumerate(own):
        torch.testing.assert_close(logits[row][b.target[row]], expected, atol=2e-4, rtol=1e-3)
    expected_loss = torch.nn.functional.cross_entropy(torch.cat(own), b.text[b.target])
    torch.testing.assert_close(loss, expected_loss, atol=1e-4, rtol=1e-4)


def test_warm_up_steps_draw_only_the_warm_sizes_bucket(prepared: Any) -> None:
    args, parts, data = prepared
    if len(data.scenes) == 1:
        pytest.skip("every size shares one bucket (tiny-llava): nothing to restrict")
    warm = argparse.Namespace(**{**vars(args), "warm_size": (448, 448), "warm_share": 0.5, "steps": 40})
    bucket = next(i for i, geometry in enumerate(parts.buckets) if (448, 448) in geometry.sizes)
    gen = torch.Generator().manual_seed(0)
    drawn = [draw_batch(warm, step, gen, data, parts).bucket for step in range(40)]
    assert set(drawn[:20]) == {bucket}  # the first half: the warm size only
    assert len(set(drawn[20:])) == 2  # then the pool's mix (its two scenes' buckets)


def test_position_share_sets_the_share_of_position_questions_in_the_batches(prepared: Any) -> None:
    args, parts, data = prepared
    gen = torch.Generator().manual_seed(0)
    about_position = ("on the left or the right?", "at the top or the bottom?")  # the world's two position questions
    mixed = [i for i, q in enumerate(data.questions) if 0 < len(data.position_questions[i]) < len(q)]
    assert mixed  # a bucket with both kinds (a pool of two scenes may also have one without position questions)
    for share in (0.2, 0.8):
        drawn = argparse.Namespace(**{**vars(args), "position_share": share, "batch": 50})
        batches = [draw_batch(drawn, step, gen, data, parts) for step in range(16)]
        asked = [q for b in batches if b.bucket in mixed for q in b.questions]
        assert len(asked) >= 300
        measured = sum(q.endswith(about_position) for q in asked) / len(asked)
        assert abs(measured - share) < 0.1, (share, measured)  # 300 draws or more: 0.1 is over four standard deviations
        for b in batches:  # every question from the step's bucket
            assert all(data.bucket_of[int(i)] == b.bucket for i in b.index)


def test_a_step_reaches_every_part_and_lowers_the_loss(prepared: Any) -> None:
    args, parts, data = prepared
    opt, _ = optimiser(args, parts)
    # a seed whose step draws the pool's bucket of the fewest tokens (the test's cost)
    cheapest = min((i for i, n in enumerate(data.scenes) if n), key=lambda i: parts.buckets[i].n)
    seed = next(s for s in range(100) if pick_bucket(torch.Generator().manual_seed(s), data.scenes) == cheapest)
    b = draw_batch(args, 0, torch.Generator().manual_seed(seed), data, parts)
    assert b.bucket == cheapest
    assert {data.bucket_of[i] for i in b.index.tolist()} == {b.bucket}  # the batch's scenes share its geometry
    adapter = parts.adapter
    inner = adapter.model.model
    tower = inner.visual if hasattr(inner, "visual") else inner.vision_tower
    layers = adapter._language_model.layers
    attention = next(layer for layer in layers if hasattr(layer, "self_attn"))  # Qwen3.5: layer 3 (0-2 linear)
    watched = {"tower": next(tower.parameters()), "projector": next(adapter.projector.parameters()),
               "language model": attention.self_attn.q_proj.weight}  # fmt: skip
    for layer in layers[:1]:  # Qwen3.5: a Gated DeltaNet layer, the first the rows go through
        if hasattr(layer, "linear_attn"):
            watched["gated deltanet"] = layer.linear_attn.in_proj_qkv.weight
    for level, merger in enumerate(getattr(tower, "deepstack_merger_list", [])):  # Qwen3-VL: rows added in the LM
        watched[f"deepstack merger {level}"] = merger.linear_fc2.weight
    seen: list[float] = []
    for _ in range(3):
        logits, dense = forward(parts, data, b)
        loss = torch.nn.functional.cross_entropy(logits[b.target], b.text[b.target]) + losses(parts, data, b, dense)
        opt.zero_grad()
        loss.backward()
        if not seen:
            for part, weight in watched.items():
                assert weight.grad is not None and weight.grad.abs().sum() > 0, part
        opt.step()
        seen.append(float(loss.detach()))
    assert seen[-1] < seen[0]


# multimodal-rope positions, token subsets, the world's mix (a bucket drawn per step) or one size: the whole generic
# path; Qwen3-VL adds the deepstack rows
@pytest.mark.parametrize(("name", "size"), [("tiny-qwen2.5-vl", "mixed"), ("tiny-qwen3-vl", "384x384")])
def test_resuming_a_checkpoint_gives_the_uninterrupted_parameters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, size: str
) -> None:
    buckets: list[int] = []

    def drawn(*args: Any) -> Batch:
        b = draw_batch(*args)
        buckets.append(b.bucket)
        return b

    monkeypatch.setattr(loop, "draw_batch", drawn)

    def run(out: Path, stop_after: int | None, *extra: str) -> dict[str, torch.Tensor]:
        out.mkdir(exist_ok=True)
        args = _args(name, out, "--size", size, *extra)
        parts, data = cli.prepare(args, cli.Run(out))
        done = [0]

        def advance(steps: int = 1) -> None:
            done[0] += steps
            if stop_after is not None and done[0] > stop_after:
                raise KeyboardInterrupt  # killed in the step after the checkpoint

        with contextlib.suppress(KeyboardInterrupt):
            fit(args, lambda line: None, advance, parts, data)
        return {k: v.clone() for k, v in parts.model.state_dict().items()}

    whole = run(tmp_path / "whole", None)  # 4 steps
    assert len(set(buckets)) == (2 if size == "mixed" else 1)  # the mix: the steps switch geometry
    run(tmp_path / "split", 2)  # a checkpoint after 2 steps, killed in the third
    resumed = run(tmp_path / "split", None, "--resume", str(tmp_path / "split"))
    assert buckets[4:] == buckets[:3] + buckets[2:4]  # the same buckets, step for step
    assert whole.keys() == resumed.keys()
    for key, value in whole.items():
        assert torch.equal(value, resumed[key]), key


def test_vision_attention_packed_sets_the_qwen_tower_and_refuses_other_towers(tmp_path: Path) -> None:
    from care_core.backbones.packed_attention import PACKED_ATTENTION

    model, _, _, _ = cli.build(_args("tiny-qwen2.5-vl", tmp_path, "--vision-attention", "packed"), cli.Run(tmp_path))
    assert model.config.vision_config._attn_implementation == PACKED_ATTENTION
    assert model.config.text_config._attn_implementation == "sdpa"
    with pytest.raises(cli.UsageError, match=r"^--vision-attention packed: llava: .* Qwen3-VL towers only"):
        cli.build(_args("tiny-llava", tmp_path, "--vision-attention", "packed"), cli.Run(tmp_path))


def test_a_run_whose_weights_turn_nan_stops_and_keeps_the_last_finite_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    made = loop.optimiser

    def poisoned(args: Any, parts: Any) -> Any:
        opt, params = made(args, parts)
        step, calls = opt.step, [0]

        def poisoning_step(*a: Any, **k: Any) -> Any:
            out = step(*a, **k)
            calls[0] += 1
            if calls[0] == 3:  # the third step leaves a NaN weight (as a non-finite gradient through AdamW would)
                with torch.no_grad():
                    params[0].view(-1)[0] = float("nan")
            return out

        opt.step = poisoning_step
        return opt, params

    monkeypatch.setattr(loop, "optimiser", poisoned)
    argv = ["--backbone", "tiny-llava", "--out", str(tmp_path), "--batch", "2", "--scenes", "2", "--workers", "1",
            "--device", "cpu", "--steps", "4", "--checkpoint-every", "2", "--skip-eval"]  # fmt: skip
    code = cli.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert err[-1] == ("error: training diverged: some weights are NaN or infinite after step 4; the checkpoint of "
                       "step 2 is kept")  # fmt: skip
    state = torch.load(tmp_path / loop.CHECKPOINT, map_location="cpu", weights_only=False)
    assert state["step"] == 2
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())
    assert not (tmp_path / "tiny-llava.safetensors").exists()  # nothing diverged was saved to ship
    assert "training diverged" in (tmp_path / "log.txt").read_text()


def test_a_step_with_a_non_finite_gradient_leaves_weights_and_optimiser_untouched() -> None:
    weight = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = torch.optim.AdamW([weight], lr=0.1)
    assert loop.update(opt, [weight], (weight**2).sum())  # a finite step moves the weights
    after_one = weight.detach().clone()
    assert not torch.equal(after_one, torch.tensor([1.0, -2.0]))
    moments = {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[weight].items()}
    for bad in (float("nan"), float("inf")):
        assert not loop.update(opt, [weight], (weight * bad).sum())
        assert torch.equal(weight.detach(), after_one)
        assert weight.grad is None
        assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(moments[k])) for k, v in opt.state[weight].items())
    assert loop.update(opt, [weight], (weight**2).sum())  # and the run goes on
    assert float(opt.state[weight]["step"]) == 2.0
