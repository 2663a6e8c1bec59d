"""The drop-in context manager: inside it, transformers' own generate (and image-text-to-text pipeline) on a left-padded
batch gives, per sample, the tokens ReductionPipeline gives for the same image, prompt and budget; outside it the
model is exactly as it was."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from PIL import Image

import care_core
from care_core.backbones import ensure_demo, load_backbone
from care_core.backbones._hf import quiet_transformers
from care_core.backbones.families import (
    BackboneFamily,
    backbone_family,
    family_names,
    register_family,
    unregister_family,
)
from care_core.backbones.llava_1_5.adapter import LlavaAdapter
from care_core.budget import Budget
from care_core.errors import BudgetError, CareError, MethodError, ModelLoadError
from care_core.pipeline import ReductionPipeline

DEMOS = ("tiny-llava", "tiny-llava-next", "tiny-qwen2.5-vl", "tiny-qwen3-vl")
QUESTIONS = ("What is this?", "Which colour is the shape?", "Where is the circle?")
NEW_TOKENS = 5
KEEP = 9


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("dropin_home")
    ensure_demo("tiny-llava", home)
    return home


@pytest.fixture(scope="module")
def adapters(home: Path) -> dict[str, Any]:
    return {name: load_backbone(name, home=home) for name in DEMOS}


def images() -> list[Image.Image]:
    """Three images of different sizes (so LLaVA-NeXT and Qwen give different N per image)."""
    pixels = torch.Generator().manual_seed(0)
    noise = Image.fromarray(torch.randint(0, 256, (250, 250, 3), generator=pixels, dtype=torch.uint8).numpy())
    return [Image.new("RGB", (300, 200), (200, 30, 30)), Image.new("RGB", (200, 400), (20, 40, 220)), noise]


def batch(adapter: Any) -> dict[str, Any]:
    prompts = [adapter.prompt(q) for q in QUESTIONS]
    with quiet_transformers():
        inputs = adapter.processor(
            images=images(), text=prompts, return_tensors="pt", padding=True, padding_side="left"
        )
    return inputs.to(adapter.device)  # where the model is (a GPU machine's default device)


def pipeline_results(adapter: Any, budget: Budget, method: str = "care") -> list[Any]:
    return ReductionPipeline(adapter, [method]).run_batch(images(), list(QUESTIONS), [budget])


def reference_ids(adapter: Any, budget: Budget, method: str = "care") -> list[tuple[int, ...]]:
    """Per sample, the new token ids ReductionPipeline's answer has (its reduction, then the adapter's generate on
    the sample alone)."""
    out = []
    for result in pipeline_results(adapter, budget, method):
        run = result.runs[0]
        kept = run.result.token_index
        out.append(adapter.generate(QUESTIONS[len(out)], result.tokens, run.projected, NEW_TOKENS, kept).token_ids)
    return out


def model_state(model: Any) -> dict[str, Any]:
    """What the drop-in must leave as it found: instance attributes, tensors, hooks."""
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    attributes = {id(m): set(vars(m)) for m in model.modules()}
    return {"attributes": attributes, "hooks": hooks, "tensors": {k: v.clone() for k, v in model.state_dict().items()}}


def assert_unchanged(model: Any, before: dict[str, Any]) -> None:
    after = model_state(model)
    assert "generate" not in vars(model)
    assert after["attributes"] == before["attributes"]
    assert after["hooks"] == before["hooks"]
    assert after["tensors"].keys() == before["tensors"].keys()
    assert all(torch.equal(after["tensors"][k], v) for k, v in before["tensors"].items())


@pytest.mark.parametrize("name", DEMOS)
def test_generate_in_the_context_gives_each_sample_its_own_reduced_answer(adapters: dict[str, Any], name: str) -> None:
    adapter = adapters[name]
    inputs = batch(adapter)
    assert bool((inputs["attention_mask"][:, 0] == 0).any())  # left padding really happened
    with care_core.reduce_visual_tokens(adapter.model, processor=adapter.processor, keep=KEEP) as reduction:
        first = adapter.model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
        second = adapter.model.generate(
            **inputs, max_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True
        )
    prompt_length = inputs["input_ids"].shape[1]
    assert torch.equal(first[:, :prompt_length], inputs["input_ids"])  # the caller's prompt, so slicing works
    assert torch.equal(second.sequences, first)
    assert [r.num_tokens for r in reduction.results] == [KEEP] * len(QUESTIONS)
    expected = reference_ids(adapter, Budget.keep(KEEP))
    for row, ids in zip(first[:, prompt_length:].tolist(), expected, strict=True):
        assert tuple(row[: len(ids)]) == ids


@pytest.mark.parametrize("name", DEMOS)
def test_the_image_text_to_text_pipeline_is_reduced_in_the_context(adapters: dict[str, Any], name: str) -> None:
    from transformers import pipeline

    adapter = adapters[name]
    prompts = [adapter.prompt(q) for q in QUESTIONS]
    with quiet_transformers():
        pipe = pipeline("image-text-to-text", model=adapter.model, processor=adapter.processor)
        with care_core.reduce_visual_tokens(adapter.model, processor=adapter.processor, ratio=0.05):
            outputs = pipe(images=images(), text=prompts, max_new_tokens=NEW_TOKENS, return_tensors=True)
    # the pipeline makes one processor call for the list, padded on the tokenizer's side (right, for the demos);
    # the drop-in generates from left-padded real tokens and returns the pipeline's own padded prompt in front
    with quiet_transformers():
        prompt_ids = adapter.processor(images=images(), text=prompts, return_tensors="pt", padding=True)["input_ids"]
    expected = reference_ids(adapter, Budget.ratio(0.05))
    for b, (output, ids) in enumerate(zip(outputs, expected, strict=True)):
        sequence = (output[0] if isinstance(output, list) else output)["generated_token_ids"]
        assert torch.equal(sequence[: prompt_ids.shape[1]], prompt_ids[b])
        assert tuple(sequence[prompt_ids.shape[1] :].tolist())[: len(ids)] == ids


def test_a_method_that_reads_the_question_gets_the_prompts_question(adapters: dict[str, Any]) -> None:
    adapter = adapters["tiny-llava"]  # FastV's kept tokens differ between these questions on this demo
    with care_core.reduce_visual_tokens(adapter.model, processor=adapter.processor, method="fastv", keep=KEEP) as r:
        adapter.model.generate(**batch(adapter), max_new_tokens=1, do_sample=False)
    expected = pipeline_results(adapter, Budget.keep(KEEP), method="fastv")
    kept = [result.token_index.tolist() for result in r.results]
    assert kept == [result.runs[0].result.token_index.tolist() for result in expected]
    assert len({tuple(k) for k in kept}) > 1


@pytest.mark.parametrize("name", DEMOS)
def test_keeping_every_token_equals_plain_generate(adapters: dict[str, Any], name: str) -> None:
    adapter = adapters[name]
    inputs = batch(adapter)
    options = {"max_new_tokens": 3, "do_sample": False}
    with quiet_transformers():
        plain = adapter.model.generate(**inputs, **options)
        with care_core.reduce_visual_tokens(adapter.model, processor=adapter.processor, ratio=1.0):
            reduced = adapter.model.generate(**inputs, **options)
    assert torch.equal(reduced, plain)


def dropin_device_reads(adapter: Any, inputs: dict[str, Any]) -> int:
    """How many synchronising CUDA operations the drop-in's own code (care_core/dropin.py, not the method's or the
    adapter's) makes while it builds the reduced batch of ``inputs``."""
    import warnings

    reduction = care_core.reduce_visual_tokens(adapter.model, processor=adapter.processor, keep=KEEP)
    with reduction, warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            reduction.reduced_inputs(inputs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum(1 for w in caught if "synchroniz" in str(w.message) and w.filename.endswith("dropin.py"))


@pytest.mark.parametrize("name", ["tiny-llava-next", "tiny-qwen3-vl"])
def test_the_dropins_own_device_reads_do_not_grow_with_the_batch(adapters: dict[str, Any], name: str) -> None:
    adapter = adapters[name]
    if adapter.device.type != "cuda":
        pytest.skip("device reads are CUDA synchronisations")
    inputs = batch(adapter)
    with quiet_transformers():
        single = adapter.processor(images=images()[:1], text=[adapter.prompt(QUESTIONS[0])], return_tensors="pt")
    one = dict(single.to(adapter.device))
    # the caller's ids, mask (token types, image grid) and the kept indices: each read once, whatever the batch
    assert dropin_device_reads(adapter, inputs) == dropin_device_reads(adapter, one)


def test_text_only_calls_pass_through_unchanged(adapters: dict[str, Any]) -> None:
    adapter = adapters["tiny-llava"]
    text = adapter.tokenizer(["a red square", "the circle is"], return_tensors="pt", padding=True, padding_side="left")
    options = {"max_new_tokens": 3, "do_sample": False}
    with quiet_transformers():
        plain = adapter.model.generate(**text, **options)
        with care_core.reduce_visual_tokens(adapter.model, processor=adapter.processor, keep=KEEP) as reduction:
            inside = adapter.model.generate(**text, **options)
    assert torch.equal(inside, plain)
    assert reduction.results == []


def test_leaving_the_context_restores_the_model_also_after_an_exception(adapters: dict[str, Any]) -> None:
    adapter = adapters["tiny-llava"]
    before = model_state(adapter.model)
    with care_core.reduce_visual_tokens(adapter.model, processor=adapter.processor, keep=KEEP):
        assert "generate" in vars(adapter.model)
        adapter.model.generate(**batch(adapter), max_new_tokens=1, do_sample=False)
    assert_unchanged(adapter.model, before)
    with pytest.raises(KeyError), care_core.reduce_visual_tokens(adapter.model, processor=adapter.processor, keep=3):
        adapter.model.generate(**batch(adapter), max_new_tokens=1, do_sample=False)
        raise KeyError("inside the block")
    assert_unchanged(adapter.model, before)


def test_several_images_in_one_prompt_are_refused_in_one_line(adapters: dict[str, Any]) -> None:
    adapter = adapters["tiny-llava"]
    prompt = adapter.prompt("Compare them.").replace(adapter.image_token, adapter.image_token * 2)
    with quiet_transformers():
        inputs = adapter.processor(images=images()[:2], text=[prompt], return_tensors="pt")
    with (
        care_core.reduce_visual_tokens(adapter.model, processor=adapter.processor, keep=KEEP),
        pytest.raises(CareError, match="one image per sample") as caught,
    ):
        adapter.model.generate(**inputs, max_new_tokens=1)
    assert "\n" not in str(caught.value)


def test_bad_arguments_fail_in_one_line_before_the_block(adapters: dict[str, Any]) -> None:
    adapter = adapters["tiny-qwen2.5-vl"]
    model, processor = adapter.model, adapter.processor
    cases: list[tuple[type[CareError], dict[str, Any], str]] = [
        (BudgetError, {"keep": 5, "ratio": 0.1}, "exactly one of ratio"),
        (BudgetError, {}, "ratio or a keep"),
        (BudgetError, {"ratio": 1.5}, "ratio must be in"),
        (MethodError, {"keep": 5, "method": "no-such-method"}, "unknown method"),
        (MethodError, {"keep": 5, "method": "visionzip"}, "cannot run on"),
        (ModelLoadError, {"keep": 5, "processor": None}, "processor"),
        (CareError, {"keep": 5, "cuda_graph": "off"}, "cuda_graph must be True, False or None, got 'off'"),
        (CareError, {"keep": 5, "cuda_graph": 0}, "cuda_graph must be True, False or None, got 0"),
    ]
    for error, kwargs, message in cases:
        with pytest.raises(error, match=message) as caught:
            care_core.reduce_visual_tokens(model, **{"processor": processor, **kwargs})
        assert "\n" not in str(caught.value)
    other = SimpleNamespace(config=SimpleNamespace(model_type="bert"))
    with pytest.raises(ModelLoadError, match="model type 'bert'"):
        care_core.reduce_visual_tokens(other, processor=processor, keep=5)
    assert "generate" not in vars(model)


class CopiedLlavaAdapter(LlavaAdapter):
    """LLaVA-1.5's adapter for a family registered by a test (the record and its adapter name each other)."""

    family = "test-llava-copy"


@pytest.fixture
def copied_family() -> Iterator[BackboneFamily]:
    """LLaVA-1.5's record under new names, registered at run time with its own model type and adapter."""
    family = register_family(dataclasses.replace(
        backbone_family("llava-1.5"), name="test-llava-copy", display="Test LLaVA copy",
        model_types=("test_llava_copy",), adapter=f"{__name__}:CopiedLlavaAdapter", lmms_eval_model="care_test_copy",
        demos=(), rank=999,
    ))  # fmt: skip
    yield family
    if family.name in family_names():
        unregister_family(family.name)


def with_model_type(model: Any, model_type: str) -> Any:
    """A shallow copy of ``model`` (same modules and weights) whose config says ``model_type``."""
    config = copy.copy(model.config)
    config.model_type = model_type
    other = copy.copy(model)
    other.config = config
    return other


def test_a_registered_familys_model_type_is_served_and_others_refused_in_one_line(
    adapters: dict[str, Any], copied_family: BackboneFamily
) -> None:
    llava = adapters["tiny-llava"]
    inputs = batch(llava)
    model = with_model_type(llava.model, "test_llava_copy")
    with care_core.reduce_visual_tokens(model, processor=llava.processor, keep=KEEP) as reduction:
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert reduction.adapter.family == "test-llava-copy"
    with care_core.reduce_visual_tokens(llava.model, processor=llava.processor, keep=KEEP):
        expected = llava.model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(out, expected)  # the copied family's adapter reduces as LLaVA-1.5's does
    unregister_family(copied_family.name)
    with pytest.raises(ModelLoadError) as caught:
        care_core.reduce_visual_tokens(model, processor=llava.processor, keep=KEEP)
    message = str(caught.value)
    assert message.startswith("care cannot reduce the tokens of model type 'test_llava_copy' (supported: ")
    supported = message.removesuffix(")").split("(supported: ")[1].split(", ")
    assert "\n" not in message and "llava" in supported and "test_llava_copy" not in supported


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "dropin_generate.py"


def _example(*args: str) -> Any:
    import subprocess
    import sys

    return subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=600)


def test_the_example_asks_the_shapes_demo_about_its_shapes() -> None:
    """examples/shapes.png holds a cyan cross and a red triangle (examples/LICENSES.md): asked about it, the demo
    answers with the scene's words, with all tokens and with K of them."""
    run = _example("--keep", "32")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[:3] == ["shapes.png: What colour is the cross?", "  all tokens: ' cyan'", "  K = 32: ' cyan'"], lines
    assert "shapes.png: What shape is red?" in lines and "  all tokens: ' triangle'" in lines


def test_the_example_runs_unchanged_on_the_gemma3_demo() -> None:
    """Gemma 3's processor reads another image token than the adapter's placeholder and one list of images per
    prompt: the example takes both from the adapter (``processor_prompt``) and its per-prompt lists, no family test."""
    run = _example("--model", "tiny-gemma3-random", "--keep", "28")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert [line for line in lines if line.startswith("shapes.png: ")] == [
        "shapes.png: What colour is the cross?", "shapes.png: What shape is red?",
        "shapes.png: Is the red triangle at the top or the bottom?",
    ]  # fmt: skip
    assert sum(line.startswith("  K = 28: ") for line in lines) == 3  # random weights: the words mean nothing


def test_the_example_refuses_a_model_the_dropin_does_not_serve_in_one_line() -> None:
    run = _example("--model", "tiny-internvl3")
    assert run.returncode == 2 and run.stdout == "", run.stdout
    assert run.stderr.startswith("error: the drop-in cannot serve internvl3") and run.stderr.count("\n") == 1, (
        run.stderr
    )
