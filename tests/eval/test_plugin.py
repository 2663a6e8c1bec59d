"""The lmms-eval models: entry point, the reduced-token path (exactly K visual tokens), every demo backbone."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lmms_eval")

from care_core.backbones import load_backbone
from care_core.backbones.families import (
    BackboneFamily,
    backbone_family,
    family_names,
    register_family,
    unregister_family,
)
from care_core.errors import MethodError
from care_core.integrations import lmms_eval as plugin
from care_core.integrations.settings import EvalSpec, ModelArgsError

from .conftest import POPE, ROOT


@pytest.fixture(scope="module")
def llava() -> Any:
    return load_backbone("tiny-llava", device="cpu")


class Spy:
    """Counts the image placeholders of every prompt the language model decodes from (its real input)."""

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter
        self.counts: list[int] = []
        self.rows: list[int] = []
        self._greedy = adapter._greedy

    def __call__(self, inputs: dict[str, Any], max_new_tokens: int) -> str:
        self.counts.append(int((inputs["input_ids"] == self.adapter.image_token_id).sum()))
        self.rows.append(int(inputs["mm_encoder_outputs"]["image"].pooler_output[0].shape[0]))
        return self._greedy(inputs, max_new_tokens)


@pytest.fixture
def spy(llava: Any) -> Iterator[Spy]:
    watcher = Spy(llava)
    llava._greedy = watcher
    yield watcher
    del llava._greedy


def evaluate(lm: Any, limit: int = 2) -> dict[str, Any]:
    from lmms_eval.evaluator import simple_evaluate

    selection = plugin.select_tasks([str(POPE)])
    return simple_evaluate(model=lm, tasks=selection.names, task_manager=plugin.task_manager(selection), limit=limit,
                           verbosity="ERROR", bootstrap_iters=0)  # fmt: skip


def test_entry_point_registers_every_model_id() -> None:
    from lmms_eval import models

    assert models.get_model("care") is plugin.CareLMM
    assert models.get_model("care_vtr") is plugin.CareLMM
    llava = models.get_model("care_llava")
    assert llava is models.get_model("care_llava_next") is models.get_model("care_llava_onevision")
    assert llava is plugin.model_class("care_llava")
    assert llava.families == ("llava-1.5", "llava-next", "llava-onevision")
    assert models.get_model("care_qwen2_5_vl").families == ("qwen2.5-vl",)
    assert models.get_model("care_qwen3_vl").families == ("qwen3-vl",)
    assert models.get_model("care_qwen3_5").families == ("qwen3.5",)
    assert models.get_model("care_gemma3").families == ("gemma3",)
    internvl = models.get_model("care_internvl")
    assert internvl is models.get_model("care_internvl3") and internvl.families == ("internvl3",)
    assert all(issubclass(models.get_model(m), plugin.CareLMM) for m in ("care_llava", "care_internvl"))
    assert {m.model_id for m in plugin.manifests()} == {
        "care",
        "care_llava",
        "care_qwen2_5_vl",
        "care_qwen3_vl",
        "care_qwen3_5",
        "care_internvl",
        "care_gemma3",
    }


@pytest.fixture
def copied_family() -> Iterator[BackboneFamily]:
    """A family registered at run time: LLaVA-1.5's record under new names, its own lmms-eval id and alias."""
    family = register_family(dataclasses.replace(
        backbone_family("llava-1.5"), name="test-llava-copy", display="Test LLaVA copy",
        model_types=("test_llava_copy",), lmms_eval_model="care_test_copy",
        lmms_eval_aliases=("care_test_copy_alias",), demos=(), rank=999,
    ))  # fmt: skip
    yield family
    if family.name in family_names():
        unregister_family(family.name)


def test_a_family_registered_at_run_time_gets_its_own_lmms_eval_model(
    copied_family: BackboneFamily, llava: Any
) -> None:
    from lmms_eval.models.registry_v2 import ModelRegistryV2

    cls = plugin.model_class("care_test_copy")
    assert issubclass(cls, plugin.CareLMM) and cls.model_id == "care_test_copy"
    assert cls.families == ("test-llava-copy",) and plugin.model_class("care_test_copy_alias") is cls
    manifest = next(m for m in plugin.manifests() if m.model_id == "care_test_copy")
    assert manifest.aliases == ("care_test_copy_alias",)
    registry = ModelRegistryV2()  # lmms-eval's own resolution of the manifests: "module.attribute", imported
    for one in plugin.manifests():
        registry.register_manifest(one)
    assert registry.get_model_class("care_test_copy_alias") is cls
    assert registry.get_model_class("care_llava") is plugin.model_class("care_llava_next")
    spec = EvalSpec(pretrained="tiny-llava", method="care", keep=8)
    with pytest.raises(ModelArgsError, match=r"'care_test_copy' serves test-llava-copy.*model id 'care_llava'"):
        cls.from_spec(spec, llava)


def test_an_unregistered_family_has_no_lmms_eval_model(copied_family: BackboneFamily) -> None:
    plugin.model_class("care_test_copy")
    unregister_family(copied_family.name)
    with pytest.raises(ModelArgsError, match="unknown care model 'care_test_copy'"):
        plugin.model_class("care_test_copy")
    assert "care_test_copy" not in {m.model_id for m in plugin.manifests()}
    with pytest.raises(AttributeError):
        plugin.care_test_copy  # noqa: B018


@pytest.mark.parametrize(("method", "keep"), [("care", 64), ("visionzip", 32)])
def test_reduced_runs_feed_exactly_k_visual_tokens(llava: Any, spy: Spy, method: str, keep: int) -> None:
    lm = plugin.CareLMM.from_spec(EvalSpec(pretrained="tiny-llava", method=method, keep=keep), llava)
    results = evaluate(lm)
    assert spy.counts == [keep, keep] and spy.rows == [keep, keep]
    assert [r.visual_tokens for r in lm.records] == [keep, keep]
    assert [r.num_tokens for r in lm.records] == [576, 576]
    assert "pope_accuracy" in plugin.task_metrics(results, "care_pope_examples")
    assert list(plugin.sample_answers(results, "care_pope_examples").values()) == [r.answer for r in lm.records]


def test_unreduced_run_feeds_all_tokens(llava: Any, spy: Spy) -> None:
    lm = plugin.CareLMM.from_spec(EvalSpec(pretrained="tiny-llava", method=None), llava)
    evaluate(lm, limit=1)
    assert spy.counts == [576] and [r.visual_tokens for r in lm.records] == [576]


def test_the_language_model_sees_the_projected_rows_care_reduce_keeps(llava: Any) -> None:
    """The rows fed to the language model equal the projector applied to the tokens that the core function
    care_reduce keeps for the same image (an independent path: no pipeline, no plugin)."""
    from PIL import Image

    from care_core import CaReConfig, care_reduce

    fed: list[Any] = []
    greedy = llava._greedy

    def capture(inputs: dict[str, Any], max_new_tokens: int) -> Any:
        fed.append(inputs["mm_encoder_outputs"]["image"].pooler_output[0].detach().clone())
        return greedy(inputs, max_new_tokens)

    with Image.open(ROOT / "examples" / "chelsea.jpg") as picture:
        image = picture.convert("RGB")
    llava._greedy = capture
    try:
        lm = plugin.CareLMM.from_spec(EvalSpec(pretrained="tiny-llava", method="care", keep=48), llava)
        lm.answer(image, "Is there a cat in the image?", max_new_tokens=2)
    finally:
        del llava._greedy
    tokens = llava.encode_image(image)
    with torch.no_grad():
        reduced = care_reduce(tokens.features, llava.projector, tokens.positions, keep=48, config=CaReConfig())
        expected = llava.projector(reduced.tokens)
    assert len(fed) == 1 and fed[0].shape == (48, expected.shape[1])
    torch.testing.assert_close(fed[0].to(expected.dtype), expected, rtol=1e-4, atol=1e-5)


def test_a_request_without_a_task_name_says_what_to_pass(llava: Any) -> None:
    """lmms-eval --tasks FOLDER (no --include_path) loads the task without its name: no KeyError, a hint."""
    from types import SimpleNamespace

    lm = plugin.CareLMM.from_spec(EvalSpec(pretrained="tiny-llava", method=None), llava)
    lm.task_dict = {}
    request = SimpleNamespace(args=("question", {}, lambda doc: [], 0, None, "test"))
    with pytest.raises(plugin.EvalTaskError, match=r"include path \S+care_shapes_examples, task care_shapes_examples"):
        lm.generate_until([request])


def test_quiet_restores_what_it_changes(capsys: pytest.CaptureFixture[str]) -> None:
    """A user's loguru sink keeps working, lmms-eval's bars and datasets' switches are put back."""
    import datasets
    import lmms_eval.evaluator as evaluator
    from loguru import logger

    seen: list[str] = []
    sink = logger.add(seen.append, level="INFO", format="{message}")
    bars, verbosity, tqdm_before = (datasets.utils.are_progress_bars_disabled(), datasets.logging.get_verbosity(),
                                    evaluator.tqdm)  # fmt: skip
    try:
        with plugin.quiet():
            assert evaluator.tqdm is not tqdm_before
            logger.info("inside")  # not lmms-eval's: still reaches the user's sink
        logger.info("after")
    finally:
        logger.remove(sink)
    assert [line.strip() for line in seen] == ["inside", "after"]
    assert evaluator.tqdm is tqdm_before
    assert datasets.utils.are_progress_bars_disabled() == bars and datasets.logging.get_verbosity() == verbosity


def test_after_the_aggregation_imports_lmms_evals_first_aggregation_imports_nothing() -> None:
    """In a fresh process (this one may have imported them already): what lmms-eval's first aggregation would
    import inside a setting's clock is imported by import_lmms_eval_aggregation."""
    code = (
        "import sys\n"
        "from care_core.integrations import lmms_eval as plugin\n"
        "from lmms_eval.api.metrics import stderr_for_metric\n"
        "plugin.import_lmms_eval_aggregation()\n"
        "before = set(sys.modules)\n"
        "stderr_for_metric(len, plugin.BOOTSTRAP_ITERS)\n"
        "print(sorted(set(sys.modules) - before)[:20])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert done.stdout.strip() == "[]", done.stdout[-2000:]


def test_a_settings_clock_starts_after_the_aggregation_imports(llava: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import lmms_eval.evaluator as evaluator

    from care_core.batch_sizes import BatchSize
    from care_core.runs import Processes, World

    events: list[str] = []

    class Seen(Exception):
        """Raised by the stand-in evaluation once the order is recorded: no answer is computed."""

    class Clock:
        @staticmethod
        def perf_counter() -> float:
            events.append("clock")
            return 0.0

    def evaluate(**_: Any) -> None:
        events.append("evaluate")
        raise Seen

    monkeypatch.setattr(plugin, "import_lmms_eval_aggregation", lambda: events.append("imports"))
    monkeypatch.setattr(plugin, "time", Clock)
    monkeypatch.setattr(evaluator, "simple_evaluate", evaluate)
    selection = plugin.select_tasks([str(POPE)])
    with pytest.raises(Seen):
        plugin.evaluate_setting(EvalSpec(pretrained="tiny-llava", method=None), llava, selection,
                                plugin.task_manager(selection), Processes(World(0, 1, 0)), batch_size=BatchSize(2),
                                limit=2, cache=None, stamp="test")  # fmt: skip
    assert events == ["imports", "clock", "evaluate"]


def test_warm_up_answers_through_the_reduced_path_and_records_nothing(llava: Any, spy: Spy) -> None:
    lm = plugin.CareLMM.from_spec(EvalSpec(pretrained="tiny-llava", method="care", keep=40), llava)
    lm.warm_up()
    assert spy.counts == [40] and lm.records == []


def test_warm_up_picture_grows_until_a_keep_budget_fits_where_n_grows_with_the_image() -> None:
    qwen = load_backbone("tiny-qwen3-vl", device="cpu")  # 32 px a token: a 672 px picture has 21 x 21 = 441 tokens
    lm = plugin.CareLMM.from_spec(EvalSpec(pretrained="tiny-qwen3-vl", method="care", keep=442), qwen)
    assert lm._warm_up_picture().size == (1344, 1344)  # 42 x 42 = 1764 tokens >= 442; 672 px would fail the run
    lm.warm_up()
    assert lm.records == []
    fits = plugin.CareLMM.from_spec(EvalSpec(pretrained="tiny-qwen3-vl", method="care", keep=441), qwen)
    assert fits._warm_up_picture().size == (672, 672)


def test_model_args_are_checked_before_loading() -> None:
    with pytest.raises(ModelArgsError, match="unknown key 'kep'"):
        plugin.CareLMM(pretrained="tiny-llava", method="care", kep=64)
    with pytest.raises(ModelArgsError, match="needs exactly one budget"):
        plugin.CareLMM(pretrained="tiny-llava", method="care")


def test_model_ids_check_the_backbone_family(llava: Any) -> None:
    spec = EvalSpec(pretrained="tiny-llava", method="care", keep=8)
    with pytest.raises(ModelArgsError, match=r"care_qwen2_5_vl.*llava-1\.5 model.*model id 'care_llava'"):
        plugin.model_class("care_qwen2_5_vl").from_spec(spec, llava)
    assert plugin.model_class("care_llava_next").from_spec(spec, llava).adapter is llava


def test_loglikelihood_tasks_are_refused_in_one_line(llava: Any) -> None:
    lm = plugin.CareLMM.from_spec(EvalSpec(pretrained="tiny-llava", method=None), llava)
    with pytest.raises(plugin.EvalTaskError, match="generate_until tasks only"):
        lm.loglikelihood([])


def test_helpers() -> None:
    assert plugin.cut_at_stop("yes.\nQ: next", ["\nQ:", "</s>"]) == "yes."
    assert plugin.cut_at_stop("no", "\n") == "no"
    assert plugin.cut_at_stop("no", None) == "no"
    with pytest.raises(plugin.EvalTaskError, match="no such task folder"):
        plugin.select_tasks(["examples/tasks/nope"])
    selection = plugin.select_tasks([str(POPE / "care_pope_examples.yaml"), str(POPE)])
    assert selection.names == ["care_pope_examples"] and selection.include_paths == [str(POPE)]


@pytest.mark.parametrize(("model", "keep", "rows"), [("tiny-llava-next", 16, 2928), ("tiny-qwen2.5-vl", 16, 324),
                                                    ("tiny-llava-onevision", 16, 729 + 54 * 55)])  # fmt: skip
def test_every_demo_backbone_evaluates(model: str, keep: int, rows: int) -> None:
    adapter = load_backbone(model, device="cpu")
    counted: list[int] = []
    greedy = adapter._greedy

    def spy(inputs: dict[str, Any], max_new_tokens: int) -> str:
        counted.append(int((inputs["input_ids"] == adapter.image_token_id).sum()))
        return greedy(inputs, max_new_tokens)

    adapter._greedy = spy
    for method, size, fed in ((None, None, rows), ("care", keep, keep)):
        lm = plugin.CareLMM.from_spec(EvalSpec(pretrained=model, method=method, keep=size), adapter)
        results = evaluate(lm, limit=1)
        assert "pope_accuracy" in plugin.task_metrics(results, "care_pope_examples")
        assert [r.visual_tokens for r in lm.records] == [fed]
    assert counted == [rows, keep]
    if model in ("tiny-qwen2.5-vl", "tiny-llava-onevision"):  # no CLS token
        with pytest.raises(MethodError, match="visionzip"):
            plugin.check_methods([EvalSpec(pretrained=model, method="visionzip", keep=8)], adapter)


def test_lmms_eval_cli_runs_the_plugin(tmp_path: Path) -> None:
    """lmms-eval's own command line finds the model through the entry point and evaluates the shipped task."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "lmms_eval", "--model", "care", "--model_args",
               "pretrained=tiny-llava,method=visionzip,keep=64,device=cpu", "--tasks", "care_pope_examples",
               "--include_path", str(POPE), "--limit", "3", "--output_path", str(tmp_path), "--batch_size", "2",
               "--log_samples"]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    found = glob.glob(str(tmp_path / "*" / "*_results.json"))  # its exit code is 0 even on errors
    assert found, done.stdout[-2000:] + done.stderr[-2000:]
    results = json.loads(Path(found[0]).read_text())
    assert "pope_accuracy,none" in results["results"]["care_pope_examples"]
    assert results["config"]["model_args"].startswith("pretrained=tiny-llava,method=visionzip,keep=64")
    assert results["config"]["batch_sizes"] == [2]  # the CLI's text "2", answered in batches of 2
