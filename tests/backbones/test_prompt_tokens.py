"""The prompt with K image placeholders: what the tokenizer gives for the whole text with K placeholders written out,
on every family's tokenizer and on a SentencePiece-style (Metaspace) one, whose prefix-space rule is the usual
suspect; the tokens come from one tokenisation per question."""

from __future__ import annotations

from typing import Any

import pytest
import torch

QUESTIONS = ["What is in the image?", "  Is there a  dog?\n", "Wie viele Äpfel?"]


def written_out(adapter: Any, question: str, k: int) -> torch.Tensor:
    """The independent path: the prompt text with the image's K placeholders spelled out, tokenised whole."""
    head, tail = adapter.prompt(question).split(adapter.image_token, 1)
    return adapter.tokenizer(head + adapter._image_text(k) + tail, return_tensors="pt")["input_ids"]


@pytest.mark.parametrize("k", [1, 7, 300])
def test_k_placeholders_are_the_tokens_of_the_written_out_prompt(demos: dict[str, Any], k: int) -> None:
    for name, adapter in demos.items():
        for question in QUESTIONS:
            enc = adapter._encode_prompt(question, k)
            expected = written_out(adapter, question, k)
            assert torch.equal(enc["input_ids"].cpu(), expected), (name, question, k)
            assert torch.equal(enc["attention_mask"].cpu(), torch.ones_like(expected))
            assert int((enc["input_ids"] == adapter.image_token_id).sum()) == k


def test_the_prompt_ids_are_kept_per_question_and_placeholders(demos: dict[str, Any]) -> None:
    for name, adapter in demos.items():
        first, at = adapter._placeholder_ids(QUESTIONS[1], 7)
        again, again_at = adapter._placeholder_ids(QUESTIONS[1], 7)
        assert again is first and again_at == at, name  # kept: no tokens built or copied to the device again
        other, _ = adapter._placeholder_ids(QUESTIONS[1], 8)
        assert torch.equal(other.cpu(), written_out(adapter, QUESTIONS[1], 8)), name
        assert torch.equal(again.cpu(), written_out(adapter, QUESTIONS[1], 7)), name
        assert int(first[0, at]) == adapter.image_token_id and int(first[0, at - 1]) != adapter.image_token_id


@pytest.mark.parametrize("scheme", ["always", "first"])
def test_a_metaspace_tokenizer_gives_the_same_tokens(demo: Any, scheme: str) -> None:
    """A SentencePiece-like tokenizer (Metaspace pre-tokenizer, "▁" word prefix) with ``<image>`` as an added token."""
    import copy

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    letters = sorted(set("".join(QUESTIONS) + "USERASSISTANT:<>image\n ▁"))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(letters)}}
    merges = [("▁", "I"), ("▁", "W")]
    vocab.update({"▁I": len(vocab), "▁W": len(vocab) + 1})
    core = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.add_tokens(["<image>"], special_tokens=True)
    adapter = copy.copy(demo)
    adapter._prompt_cache, adapter._device_ids = {}, {}  # not the demo's: its prompts had another tokenizer
    adapter.processor = copy.copy(demo.processor)
    adapter.processor.tokenizer = tok
    adapter.image_token_id = tok.convert_tokens_to_ids("<image>")
    for question in QUESTIONS:
        for k in (1, 5):
            ids = adapter._encode_prompt(question, k)["input_ids"].cpu()
            assert torch.equal(ids, written_out(adapter, question, k))
