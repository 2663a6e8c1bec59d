"""Drop-in token reduction for code that calls transformers itself (docs/design/generation.md §Drop-in).

``with reduce_visual_tokens(model, processor=processor, method="care", keep=160): model.generate(**inputs)``:
inside the block the model's ``generate`` (the path of ``model.generate(**inputs)`` and of
``transformers.pipeline("image-text-to-text")``) encodes each sample's image from the processor's outputs,
reduces its N visual tokens to K with the method, and generates from the K projected rows; the sequences it
returns start with the caller's own ``input_ids``, so ``out[:, inputs["input_ids"].shape[1]:]`` is the answer.
Per sample, the new tokens are what ``ReductionPipeline`` gives for the same image, prompt and budget.

Only ``generate`` is wrapped: a bare forward with ``pixel_values`` runs unreduced (its logits must line up with
the caller's ``input_ids`` and labels, which a shorter sequence would break). Leaving the block restores the
model exactly: the instance ``generate`` is deleted, the scorer cached on the projector removed and the CUDA graphs of
CaRe's single-image reductions (a call with one image on CUDA: captured when a shape and budget come back, replayed
after; none with ``cuda_graph=False``) freed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from care_core.budget import Budget, Ratio, budgets_from
from care_core.config import CaReConfig
from care_core.errors import BudgetError, CareError, MethodError, ModelLoadError
from care_core.vocabulary import DEFAULT_QUESTION

if TYPE_CHECKING:
    import torch

    from care_core.backbones.base import ImageTokens
    from care_core.backbones.chat_adapter import ChatAdapter
    from care_core.methods.base import Method, MethodResult
    from care_core.pipeline import ReductionPipeline

#: processor outputs the drop-in does not reduce (one image per sample only)
_VIDEO_KEYS = ("pixel_values_videos", "video_grid_thw")
#: ``_lm_inputs`` keys the drop-in builds itself for the caller's prompt; any other per-token input the adapter
#: builds (Gemma 3's ``token_type_ids``) is carried over by :func:`_image_run_inputs`
_BUILT_KEYS = frozenset({"input_ids", "attention_mask", "mm_encoder_outputs", "mm_token_type_ids", "position_ids"})


@dataclass
class VisualTokenReduction:
    """The context manager of :func:`reduce_visual_tokens`: the model, its adapter, the method, the budget and
    whether reductions may replay from CUDA graphs (``cuda_graph``: False never)."""

    model: Any
    adapter: ChatAdapter
    method: Method
    budget: Budget
    config: CaReConfig
    cuda_graph: bool | None = None
    #: the method's result per sample of the latest reduced generate call (kept token indices, scores, ...)
    results: list[MethodResult] = field(default_factory=list, init=False)
    _pipeline: ReductionPipeline = field(init=False, repr=False)
    _projector_attributes: set[str] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        from care_core.pipeline import ReductionPipeline

        self._pipeline = ReductionPipeline(self.adapter, [self.method], self.config)  # MethodError if not served

    def __enter__(self) -> VisualTokenReduction:
        if "generate" in vars(self.model):
            raise CareError("already has its own generate (is another reduction active on it?)", parameter="model")
        original = self.model.generate  # the class's method, bound to the model

        def generate(*args: Any, **kwargs: Any) -> Any:
            return self._generate(original, *args, **kwargs)

        self._projector_attributes = set(vars(self.adapter.projector))
        self.model.generate = generate
        return self

    def __exit__(self, *exc_info: object) -> None:
        vars(self.model).pop("generate", None)
        # the CUDA graphs of single-image reductions (and their memory pool) live only as long as the block
        self._pipeline.reduction_graphs.release()
        if self._projector_attributes is not None:  # e.g. the scorer Scorer.for_projector keeps on the projector
            projector = self.adapter.projector
            for name in set(vars(projector)) - self._projector_attributes:
                delattr(projector, name)
            self._projector_attributes = None

    def _generate(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``original(**kwargs)`` with each sample's image tokens reduced; the returned sequences begin with the
        caller's ``input_ids``. Calls without ``pixel_values`` (text only) pass through unchanged."""
        import torch

        if "inputs" in kwargs and "input_ids" not in kwargs:  # generate's own name for its first argument
            kwargs["input_ids"] = kwargs.pop("inputs")
        if args:
            if len(args) > 1 or "input_ids" in kwargs:
                raise CareError("pass the processor's outputs by keyword: model.generate(**inputs)", parameter="model")
            kwargs["input_ids"] = args[0]
        if kwargs.get("pixel_values") is None:
            return original(**kwargs)
        user_ids = kwargs["input_ids"]
        with torch.no_grad():
            reduced = self.reduced_inputs(kwargs)
        out = original(**reduced)
        return _with_prompt(out, user_ids, int(reduced["input_ids"].shape[1]))

    def reduced_inputs(self, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The keyword arguments of the model's own ``generate`` with every image reduced: K_i placeholders per
        sample (left-padded), ``mm_encoder_outputs`` instead of pixels and, for multimodal-rope models, the
        kept rows' positions from the unreduced sequence."""
        import torch

        for key in _VIDEO_KEYS:
            if kwargs.get(key) is not None:
                raise CareError("video inputs are not supported by the drop-in (images only)", parameter="model")
        # the caller's ids and mask read to the host once: the per-sample spans, questions, sequences and positions
        # below are host work there, not device reads (each a wait on the queued work) and small launches per sample
        ids = kwargs["input_ids"].cpu()
        mask = kwargs.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask.cpu()
        processed = {key: kwargs[key] for key in _image_keys(self.adapter) if kwargs.get(key) is not None}
        sizes = _image_sizes(self.adapter, processed)
        if len(sizes) != ids.shape[0]:
            raise CareError(
                f"the drop-in needs exactly one image per sample; got {len(sizes)} images for {ids.shape[0]} "
                "prompts (several images in one prompt are not supported)",
                parameter="model",
            )
        spans = [_image_span(self.adapter, ids[b][mask[b].bool()], b) for b in range(ids.shape[0])]
        tokens = self.adapter.encode_processed(processed, sizes)
        encoded, kept, extras = self._reduce(tokens, ids, mask, spans)
        positions = self._rope_positions(kwargs, ids, mask) if self._multimodal_rope else None
        return self._batch(kwargs, ids, mask, spans, tokens, encoded, kept, extras, positions)

    @property
    def _multimodal_rope(self) -> bool:
        return hasattr(self.model.model, "get_rope_index")

    def _reduce(
        self,
        tokens: list[ImageTokens],
        ids: torch.Tensor,
        mask: torch.Tensor,
        spans: list[tuple[int, int]],
    ) -> tuple[list[dict[str, Any]], list[torch.Tensor], list[dict[str, torch.Tensor]]]:
        """Per sample: the adapter's ``mm_encoder_outputs`` (the rows the language model gets, with any extra
        per-row inputs such as Qwen3-VL's deepstack rows), ``kept`` (token index per row, -1 for none) and the
        adapter's other per-token inputs on its image rows (:func:`_image_run_inputs`)."""
        adapter, pipe = self.adapter, self._pipeline
        for b, (one, (start, end)) in enumerate(zip(tokens, spans, strict=True)):
            fed = adapter.visual_tokens_fed(one, one.num_tokens)
            if end - start != fed:
                raise CareError(
                    f"sample {b} has {end - start} image placeholders but its image gives {fed} visual rows; "
                    "make the prompts and images with this model's processor",
                    parameter="model",
                )
        asks = bool(pipe.needs & {"question", "language_model"})
        questions = [self._question(ids[b][mask[b].bool()], spans[b]) if asks else None for b in range(len(tokens))]
        inputs = [
            pipe.method_inputs(one, q, cuda_graph=self.cuda_graph) for one, q in zip(tokens, questions, strict=True)
        ]
        keeps = [self.budget.resolve(one.num_tokens) for one in tokens]
        results = self.results = self.method.batch(inputs, keeps)

        rows, extras = [], []
        for one, result in zip(tokens, results, strict=True):
            projected = adapter.projector(result.tokens.to(adapter.dtype))
            # the rows the language model receives (LLaVA-NeXT at K = N: its own sequence with newline rows)
            lm = adapter._lm_inputs("?", one, projected, result.token_index)
            rows.append(lm["mm_encoder_outputs"])
            extras.append(_image_run_inputs(lm, int(adapter.image_token_id)))
        return rows, _on_host([result.token_index for result in results]), extras

    def _question(self, real_ids: torch.Tensor, span: tuple[int, int]) -> str:
        """The question a method reads: the text after the image with the adapter's own prompt around the question
        taken off (so a prompt from ``adapter.prompt(q)`` gives ``q``, as ReductionPipeline has it); for a prompt
        in another form, its whole text without image placeholders and special tokens."""
        import torch

        tokenizer, marker = self.adapter.tokenizer, "CAREQUESTIONMARK"
        after = tokenizer.decode(real_ids[span[1] :].tolist(), skip_special_tokens=False)
        template = self.adapter.prompt(marker).split(self.adapter.image_token, 1)[1]
        before_question, after_question = template.split(marker, 1)
        fits = len(after) >= len(before_question) + len(after_question)
        if fits and after.startswith(before_question) and after.endswith(after_question):
            question = after[len(before_question) : len(after) - len(after_question)]
            if question.strip():
                return question
        text_ids = torch.cat([real_ids[: span[0]], real_ids[span[1] :]]).tolist()
        text = tokenizer.decode(text_ids, skip_special_tokens=True).strip()
        return text or DEFAULT_QUESTION

    def _rope_positions(self, kwargs: Mapping[str, Any], ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(3, B, L) multimodal-rope positions of the caller's unreduced batch (the model's ``get_rope_index``)."""
        image_token_id = self.adapter.image_token_id
        types = kwargs.get("mm_token_type_ids")
        types = (ids == image_token_id).long() * mask.long() if types is None else types.to(ids.device)
        grid = kwargs.get("image_grid_thw")
        # where ids are (the host): get_rope_index walks every sample in Python and reads its values
        positions, _ = self.model.model.get_rope_index(
            ids, types, image_grid_thw=None if grid is None else grid.to(ids.device), attention_mask=mask
        )
        return positions  # type: ignore[no-any-return]

    def _batch(
        self,
        kwargs: Mapping[str, Any],
        ids: torch.Tensor,
        mask: torch.Tensor,
        spans: list[tuple[int, int]],
        tokens: list[ImageTokens],
        encoded: list[dict[str, Any]],
        kept: list[torch.Tensor],
        extras: list[dict[str, torch.Tensor]],
        positions: torch.Tensor | None,
    ) -> dict[str, Any]:
        """The reduced batch: per sample its real tokens with K_i placeholders (and, for multimodal rope, its
        ``mm_token_type_ids`` and ``position_ids`` (4, 1, L_i): a text row, then the kept rows' t, h, w; the
        adapter's other per-token inputs: its values on the K_i placeholders, 0 on text), joined left-padded by the
        adapters' own :func:`collate_left_padded`; the caller's other arguments as given (those the samples carry
        replaced: the caller's are as long as its unreduced prompt)."""
        import torch

        from care_core.backbones.chat_adapter import collate_left_padded, visual_rows

        image_token_id = int(self.adapter.image_token_id)
        samples = []
        for b, ((start, end), one, outputs, k) in enumerate(zip(spans, tokens, encoded, kept, strict=True)):
            real = ids[b][mask[b].bool()]
            rows = int(visual_rows(outputs["image"]).shape[0])
            image = torch.full((rows,), image_token_id, dtype=ids.dtype, device=ids.device)
            sample_ids = torch.cat([real[:start], image, real[end:]])[None]
            sample: dict[str, Any] = {
                "input_ids": sample_ids,
                "attention_mask": torch.ones_like(sample_ids, dtype=mask.dtype),
            }
            for key, run in extras[b].items():  # text 0, the adapter's values on the K_i placeholders
                run, lead = run.to(ids.device), run.shape[:-1]
                sample[key] = torch.cat(
                    [run.new_zeros((*lead, start)), run, run.new_zeros((*lead, len(real) - end))], -1
                )
            sample["mm_encoder_outputs"] = outputs
            if positions is not None or kwargs.get("mm_token_type_ids") is not None:
                sample["mm_token_type_ids"] = (sample_ids == image_token_id).long()
            if positions is not None:  # rows tied to no token (-1) sit at the last image token's position
                full = positions[:, b][:, mask[b].bool().to(positions.device)]
                select = torch.where(k < 0, torch.full_like(k, one.num_tokens - 1), k).to(full.device)
                image_positions = full[:, start:end].index_select(1, select)
                rope = torch.cat([full[:, :start], image_positions, full[:, end:]], dim=1)
                text_row = torch.arange(rope.shape[1], dtype=rope.dtype, device=rope.device)
                sample["position_ids"] = torch.cat([text_row[None], rope], dim=0)[:, None]  # (4, 1, L_i)
            samples.append(sample)
        out = {key: value for key, value in kwargs.items() if key not in _consumed_keys(self.adapter)}
        device = kwargs["input_ids"].device  # the sequences were put together where ids are (the host): moved once
        out.update({key: value if key == "mm_encoder_outputs" else value.to(device)
                    for key, value in collate_left_padded(samples, self.adapter._pad_token_id).items()})  # fmt: skip
        return out


def reduce_visual_tokens(
    model: Any,
    *,
    method: str | Method = "care",
    keep: int | None = None,
    ratio: Ratio | None = None,
    config: CaReConfig | None = None,
    processor: Any = None,
    cuda_graph: bool | None = None,
) -> VisualTokenReduction:
    """A context manager inside which ``model.generate`` (and a ``transformers.pipeline`` built on ``model``)
    reduces each sample's visual tokens with ``method`` to ``keep`` tokens or the fraction ``ratio`` of them.

    ``model``: a loaded ``*ForConditionalGeneration`` of any registered family whose adapter serves the drop-in (its
    ``config.model_type`` names the family; ``care methods NAME`` lists the families, docs/design/backbones.md which
    adapters refuse the drop-in);
    ``processor``: its processor (the tokenizer and image processor the inputs were made with); ``method``: a
    registered name or a :class:`~care_core.methods.base.Method`; ``config``: CaRe's hyperparameters;
    ``cuda_graph``: False keeps every reduction eager, None and True let a one-image call on CUDA replay CaRe's
    reduction from a CUDA graph (decoding is the model's own ``generate`` either way). One image per sample. Bad
    arguments raise a one-line CareError here, before the block runs.
    """
    from care_core.backbones.chat_adapter import ChatAdapter
    from care_core.backbones.loading import adapter_for_model
    from care_core.pipeline import build_methods

    budgets = budgets_from([] if ratio is None else [ratio], [] if keep is None else [keep])
    if ratio is not None and keep is not None:
        raise BudgetError("give exactly one of {ratio} (fraction kept) and {keep} (number of tokens kept)")
    if cuda_graph is not None and not isinstance(cuda_graph, bool):
        raise CareError(f"must be True, False or None, got {cuda_graph!r}", parameter="cuda_graph")
    config = config or CaReConfig()
    methods = build_methods([method], config)  # MethodError for an unknown name, before the model is looked at
    if len(methods) != 1:
        raise MethodError("give one method", parameter="method")
    adapter = adapter_for_model(model, processor)
    if not isinstance(adapter, ChatAdapter):  # the drop-in edits a chat model's placeholder sequence
        raise ModelLoadError(f"the {adapter.family} adapter cannot serve the drop-in", parameter="model")
    if adapter.dropin_refusal is not None:
        raise ModelLoadError(f"the drop-in cannot serve {adapter.family}: {adapter.dropin_refusal}")
    return VisualTokenReduction(model, adapter, next(iter(methods.values())), budgets[0], config, cuda_graph)


def _image_keys(adapter: ChatAdapter) -> list[str]:
    """The image processor's output names (e.g. ``pixel_values``, ``image_sizes``, ``image_grid_thw``)."""
    names = getattr(adapter.processor.image_processor, "model_input_names", None) or ["pixel_values"]
    return [str(name) for name in names]


def _consumed_keys(adapter: ChatAdapter) -> set[str]:
    """Caller arguments the reduced batch replaces."""
    return {*_image_keys(adapter), "input_ids", "attention_mask", "mm_token_type_ids", "position_ids"}


def _image_run_inputs(lm_inputs: Mapping[str, Any], image_token_id: int) -> dict[str, torch.Tensor]:
    """The per-token inputs of an adapter's prompt (``_lm_inputs``, batch 1) other than those the drop-in builds,
    each cut to its image placeholders, so they can go onto the caller's prompt around the same K rows. Such an
    input must be 0 on text (as token types are): one that is not cannot be moved to another prompt's text."""
    ids = lm_inputs["input_ids"]
    image = ids[0] == image_token_id
    runs: dict[str, torch.Tensor] = {}
    for key, value in lm_inputs.items():
        if key in _BUILT_KEYS or not hasattr(value, "shape") or value.shape[-1:] != ids.shape[-1:]:
            continue
        if bool(value[..., ~image].any()):
            raise CareError(
                f"the drop-in cannot carry the adapter's {key} (it is set on text tokens)", parameter="model"
            )
        runs[key] = value[..., image]
    return runs


def _image_sizes(adapter: ChatAdapter, processed: Mapping[str, Any]) -> list[tuple[int, int]]:
    """Each image's (height, width): the original size where the processor keeps it (LLaVA-NeXT's
    ``image_sizes``), else the processed size (LLaVA-1.5, Qwen2.5-VL: their token positions do not depend on it)."""
    if processed.get("image_sizes") is not None:
        return [(int(h), int(w)) for h, w in processed["image_sizes"].tolist()]
    if processed.get("image_grid_thw") is not None:
        patch = int(adapter.model.config.vision_config.patch_size)
        return [(int(h) * patch, int(w) * patch) for _, h, w in processed["image_grid_thw"].tolist()]
    pixels = processed["pixel_values"]
    return [(int(pixels.shape[-2]), int(pixels.shape[-1]))] * int(pixels.shape[0])


def _image_span(adapter: ChatAdapter, real_ids: torch.Tensor, sample: int) -> tuple[int, int]:
    """[start, end) of the one run of image placeholders among a sample's unpadded ids."""
    where = (real_ids == adapter.image_token_id).nonzero().flatten()
    if where.numel() == 0:
        raise CareError(f"sample {sample} has no image placeholder; one image per sample", parameter="model")
    start, end = int(where[0]), int(where[-1]) + 1
    if end - start != where.numel():
        raise CareError(f"sample {sample} has several images; the drop-in takes one per sample", parameter="model")
    return start, end


def _on_host(indices: list[torch.Tensor]) -> list[torch.Tensor]:
    """``indices`` (1-D, on one device) copied to the host in one read rather than one per tensor."""
    import torch

    return list(torch.cat(indices).cpu().split([int(index.shape[0]) for index in indices]))


def _with_prompt(out: Any, user_ids: torch.Tensor, reduced_length: int) -> Any:
    """``out`` (a tensor or a generate output with ``sequences``) with the reduced prompt replaced by the caller's
    ``input_ids`` (repeated where generate returned several sequences per prompt)."""
    import torch

    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    repeats = max(1, int(sequences.shape[0]) // int(user_ids.shape[0]))
    prompt = user_ids.repeat_interleave(repeats, dim=0).to(sequences.device)
    restored = torch.cat([prompt, sequences[:, reduced_length:]], dim=1)
    if isinstance(out, torch.Tensor):
        return restored
    out.sequences = restored
    return out
