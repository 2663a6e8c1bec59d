"""What one training step feeds a backbone, taken from its adapter: the tower pass with gradients
(``adapter.batch_features``; Qwen3-VL's ``adapter.batch_tokens`` also gives its deepstack rows), the projector, the
visual rows the language model receives (``adapter.fed_rows``: LLaVA-NeXT's and LLaVA-OneVision's newline rows), for
multimodal rope the rows' positions (``adapter.row_positions``) and, for Qwen3-VL, each row's deepstack rows
(``adapter.fed_deepstack``, handed to the model as its inference does, ``adapter.deepstack_outputs``); the prompt's
ids and positions are the adapter's own inference inputs (``_lm_inputs``) for a reference image of one token geometry
(one feed per bucket of the pool, :mod:`.buckets`). Gemma 3 also marks the visual rows with ``token_type_ids``, from
which its model makes them one bidirectional attention block (:meth:`Feed.token_types`).

A batch is a right-padded sequence ``prompt head | R visual rows | question tail + answer`` per sample; every sample
of a step shares the head, the image geometry (its bucket's) and K, so the rows sit at the same place in every row of
the batch. Right padding is safe for every family, Qwen3.5's Gated DeltaNet layers included: each layer is causal,
so no answer position reads a pad (the model zeroes padded rows before its linear layers, all after the answers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Layout:
    """One question's prompt as the adapter feeds it with all N tokens: ids around the R visual rows, and (multimodal
    rope) the (t, h, w) positions of the head, the image tokens and the tail."""

    head: list[int]
    tail: list[int]
    head_positions: torch.Tensor | None = None  # (3, h)
    image_positions: torch.Tensor | None = None  # (3, N)
    tail_positions: torch.Tensor | None = None  # (3, t)
    marks_image: bool = False  # the adapter's inputs carry token_type_ids (1 on the visual rows)


class Feed:
    """One backbone's training feed for one bucket (see the module docstring); ``reference``: the adapter's
    ImageTokens of an image of the bucket's first size, whose geometry every image of the bucket shares."""

    def __init__(self, adapter: Any, reference: Any) -> None:
        self.adapter = adapter
        self.reference = reference
        self.n = reference.num_tokens
        self.eos = int(adapter.tokenizer.eos_token_id)
        self._layouts: dict[str, Layout] = {}

    @property
    def rope(self) -> bool:
        """True when the model takes explicit multimodal-rope positions (Qwen)."""
        return self.layout("What is this?").image_positions is not None

    def layout(self, question: str) -> Layout:
        """The adapter's all-token prompt for ``question`` split around its visual rows (cached per question)."""
        if question in self._layouts:
            return self._layouts[question]
        adapter = self.adapter
        width = adapter.model.get_input_embeddings().weight.shape[1]
        rows = torch.zeros(self.n, width, dtype=adapter.dtype, device=adapter.device)
        with torch.no_grad():
            inputs = adapter._lm_inputs(question, self.reference, rows, None)
        ids = inputs["input_ids"][0].tolist()
        at = [i for i, token in enumerate(ids) if token == adapter.image_token_id]
        start, end = at[0], at[-1] + 1
        first = next(iter(self._layouts.values()), None)
        if first is not None and first.head != ids[:start]:  # a batch shares the head: the rows sit at one place
            raise RuntimeError(f"the prompt before the image differs between questions ({question!r})")
        marks = "token_type_ids" in inputs
        layout = Layout(ids[:start], ids[end:], marks_image=marks)
        if "position_ids" in inputs:
            mrope = inputs["position_ids"][1:, 0].cpu()  # (3, L): row 0 is the text row
            layout = Layout(ids[:start], ids[end:], mrope[:, :start], mrope[:, start:end], mrope[:, end:], marks)
        self._layouts[question] = layout
        return layout

    def answer(self, answer: str) -> list[int]:
        """The answer's ids as the model says it after the prompt: `` answer`` and the end token."""
        return [*self.adapter.tokenizer(" " + answer, add_special_tokens=False)["input_ids"], self.eos]

    @property
    def marks_image(self) -> bool:
        """True when the adapter marks its image rows with ``token_type_ids`` (Gemma 3: the model makes them one
        bidirectional attention block)."""
        layout = self.layout("What is this?")
        return layout.marks_image

    def token_types(self, batch: int, head: int, count: int, length: int, device: torch.device) -> torch.Tensor:
        """(B, L) ``token_type_ids`` as the adapter gives them: 1 on the ``count`` visual rows after the ``head``
        ids, 0 on the text and padding (the rows sit at the same place in every row of the batch)."""
        types = torch.zeros(batch, length, dtype=torch.long, device=device)
        types[:, head : head + count] = 1
        return types

    @property
    def deepstack(self) -> bool:
        """True when the language model also takes deepstack rows per visual row (Qwen3-VL)."""
        return hasattr(self.adapter, "fed_deepstack")

    def features(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, N, d_v) pre-projector features of normalised processor outputs and, for Qwen3-VL, the (levels, B, N,
        d_t) deepstack rows of the same tower pass (else None), with gradients."""
        if self.deepstack:
            features, deepstack = self.adapter.batch_tokens(pixels, self.reference)
            return features, deepstack
        return self.adapter.batch_features(pixels, self.reference), None

    def visual_inputs(
        self, head: torch.Tensor, rows: torch.Tensor, text: torch.Tensor, deepstack: torch.Tensor,
        order: torch.Tensor | None,
    ) -> dict[str, Any]:  # fmt: skip
        """The model's ids and encoder outputs for a family with deepstack rows, as its inference feeds them: ``head``
        ids, R image placeholders, ``text`` ids; the R rows and each row's deepstack rows (its token's, ``order``)."""
        adapter = self.adapter
        batch, count = int(rows.shape[0]), int(rows.shape[1])
        image = torch.full((batch, count), adapter.image_token_id, dtype=text.dtype, device=text.device)
        ids = torch.cat([head, image, text], dim=1)
        levels = adapter.fed_deepstack(deepstack, order, count)
        return {"input_ids": ids, "mm_token_type_ids": (ids == adapter.image_token_id).long(),
                "mm_encoder_outputs": adapter.deepstack_outputs(rows, levels)}  # fmt: skip

    def rows(self, projected: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
        """(B, R, d_t) rows the language model receives: all tokens (``order`` None, the family's own rows added)
        or K kept rows in the order given (``order`` (B, K), K < N)."""
        kept = None if order is None else order[0]
        return self.adapter.fed_rows(self.reference, projected, kept)

    def positions(self, questions: list[str], order: torch.Tensor | None, width: int) -> torch.Tensor:
        """(3, B, h + R + width) multimodal-rope positions: the head's, the rows' (their tokens', through the
        adapter's ``row_positions``), then the tail's and, after the tail, one more per answer token (the model's
        rule for text after the image, as in generation)."""
        head = self.layout(questions[0])
        image = head.image_positions
        assert image is not None and head.head_positions is not None
        batch = len(questions)
        kept = torch.arange(self.n).expand(batch, -1) if order is None else order.cpu()
        rows = self.adapter.row_positions(image, kept)
        text = torch.empty(3, batch, width, dtype=image.dtype)
        for b, question in enumerate(questions):
            tail = self.layout(question).tail_positions
            assert tail is not None
            text[:, b, : tail.shape[1]] = tail
            after = tail[:, -1:] + torch.arange(1, width - tail.shape[1] + 1, dtype=tail.dtype)
            text[:, b, tail.shape[1] :] = after
        return torch.cat([head.head_positions[:, None].expand(-1, batch, -1), rows, text], dim=2)
