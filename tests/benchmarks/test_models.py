"""The benchmark models' stand-in tokenizers: the POPE-style task's prompts get the row counts the real checkpoints'
tokenizer gives them (read with the Llama 2 tokenizer itself, not with this code), or one row per byte."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from benchmarks.bench_eval_gpu import task_rows
from benchmarks.models import build_llava, build_llava_next

# text rows (with <s>, without the image) of the 12 task prompts under the Llama 2 tokenizer (Vicuna v1.5's), counted
# with llama-tokenizer-js 1.2.2 on 2026-11-27: the same under both chat templates; the spoon question takes 30
LLAMA_2_TEXT_ROWS = [29, 29, 29, 29, 29, 30, 29, 29, 29, 29, 29, 29]
POST_PROMPT = "\nAnswer the question using a single word or phrase."  # the task YAML's post_prompt


def _text_rows(processor: Any) -> tuple[list[int], list[str]]:
    counts, texts = [], []
    image = processor.tokenizer.convert_tokens_to_ids("<image>")
    for row in task_rows():
        question = {"type": "text", "text": row["question"] + POST_PROMPT}
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
