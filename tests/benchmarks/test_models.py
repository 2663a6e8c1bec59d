"""The benchmark models' stand-in tokenizers: the POPE-style task's prompts get the row counts the real checkpoints'
tokenizer gives them (read with the Llama 2 tokenizer itself, not with this code), or one row per byte."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import yaml

from benchmarks.bench_eval_gpu import TASK, task_rows
from benchmarks.models import build_llava, build_llava_next

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
