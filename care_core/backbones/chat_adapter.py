"""What the Hugging Face chat-VLM adapters share: RGB conversion, the prompt, question embeddings, the
placeholder-expanded prompt ids and greedy decoding through ``mm_encoder_outputs``, one sample or a batch."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
from PIL import Image

from .._memo import Memos, TensorState, recall, tensor_state
from ..batch_sizes import free_memory, is_out_of_memory
from ..errors import GenerationError, ModelLoadError, QuestionError, one_line
from ..generation import Decoding, Generation
from ..images import to_rgb
from ..vocabulary import DEFAULT_QUESTION
from ._hf import quiet_transformers
from .base import ImageTokens, KeptRangeCheck, VLMAdapter, check_batch, check_kept
from .families import import_path
from .geometry import GEOMETRY_CACHE_SIZE
from .module_attrs import input_embeddings, submodule, tensor_attr, typed_attr
from .preprocess_pool import ProcessorPool, process_image, usable_cores
from .probes import VISION_PROBES, LanguageModelRun, attention_implementation
from .static_generation import (
    StaticGreedy,
    StaticPrompt,
    eos_ids,
    length_reason,
    sliding_window,
    unsupported_reason,
)


def mm_encoder_outputs(rows: torch.Tensor) -> dict[str, Any]:
    """``{"image": BaseModelOutputWithPooling(pooler_output=[rows])}``: pre-encoded visual rows for one image."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    return {"image": BaseModelOutputWithPooling(pooler_output=[rows])}  # type: ignore[arg-type]  # one per image


@dataclass(frozen=True, eq=False)
class PromptParts:
    """One sample's prompt as the adapter puts it together (:meth:`ChatAdapter._prompt_parts`), before it takes either
    decoder's form: the model's keyword arguments (:meth:`ChatAdapter._model_inputs`: ``model.generate``, the forward)
    or the static loop's :class:`StaticPrompt` (:meth:`ChatAdapter._loop_prompt`). Each is made from these parts
    alone, so neither pays for the other's pieces (transformers' encoder-output containers, the attention mask, the
    token types, the text row of the positions)."""

    input_ids: torch.Tensor  # (1, L) on the model's device
    start: int  # the first image placeholder: the R placeholders are input_ids[0, start : start + R], one run
    rows: torch.Tensor  # (R, d_t) the visual rows the language model receives, in the placeholders' order
    tokens: ImageTokens  # the image the rows come from
    kept: torch.Tensor | None  # each projected row's token (as check_kept returns it)
    question: str  # the question the prompt asks (the static loop's text rows are kept per question)
    positions: torch.Tensor | None = None  # (3, L) multimodal-rope (t, h, w) positions on the model's device
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # further model inputs (Gemma 3's token types)

    def carried(self) -> dict[str, torch.Tensor]:
        """The model inputs these parts carry as they are: ``input_ids`` and :attr:`extras` (what
        :meth:`ChatAdapter._graph_reason` looks at; the others are made from the parts, and the static loop takes
        them: :attr:`ChatAdapter.static_inputs`)."""
        return {"input_ids": self.input_ids, **self.extras}


def collate_left_padded(samples: Sequence[dict[str, Any]], pad_token_id: int) -> dict[str, Any]:
    """One ``model.generate`` batch from per-sample prompt inputs (batch 1 each, as ``_lm_inputs`` gives them).

    Every tensor is a sequence along its last dimension and a batch along the one before (``input_ids`` (1, L),
    ``position_ids`` (4, 1, L), ...): each is left-padded to the longest prompt (``input_ids`` with
    ``pad_token_id``, everything else -- attention mask, token types, positions -- with 0) and the samples
    stacked along that batch dimension. ``mm_encoder_outputs``: per modality one container of the samples' type
    (:func:`joined_encoder_outputs`) listing their rows in sample order (the placeholders' order in the batch).
    """
    if len(samples) == 1:  # nothing to pad or join
        return dict(samples[0])
    longest = max(int(sample["input_ids"].shape[-1]) for sample in samples)
    batch: dict[str, Any] = {}
    for key in samples[0]:
        values = [sample[key] for sample in samples]
        if key == "mm_encoder_outputs":
            batch[key] = {kind: joined_encoder_outputs([value[kind] for value in values]) for kind in values[0]}
        else:
            fill = pad_token_id if key == "input_ids" else 0
            batch[key] = torch.cat([_left_padded(value, longest, fill) for value in values], dim=-2)
    return batch


def joined_encoder_outputs(outputs: Sequence[Any]) -> Any:
    """One encoder-output container (the type of ``outputs[0]``, a transformers ``ModelOutput``) for a batch: each
    field that lists rows per image (``pooler_output``) is the samples' lists joined in order; a field that lists
    such lists per level (Qwen3-VL's ``deepstack_features``) is joined level by level; a tensor field is
    concatenated along its first dimension."""
    first = outputs[0]
    fields: dict[str, Any] = {}
    for name, value in first.items():
        parts = [output[name] for output in outputs]
        if isinstance(value, torch.Tensor):  # one tensor for all images (rows along dimension 0)
            fields[name] = torch.cat(parts)
        elif value and isinstance(value[0], (list, tuple)):
            fields[name] = [[r for part in parts for r in part[level]] for level in range(len(value))]
        else:
            fields[name] = [r for part in parts for r in part]
    return type(first)(**fields)


def visual_rows(output: Any) -> torch.Tensor:
    """A prompt's visual rows (K, d_t) from its ``mm_encoder_outputs["image"]``: the one tensor, or the images'
    tensors concatenated."""
    rows = output.pooler_output
    return rows if isinstance(rows, torch.Tensor) else torch.cat(list(rows))


def _left_padded(value: torch.Tensor, length: int, fill: int) -> torch.Tensor:
    """``value`` with ``fill`` prepended along its last dimension up to ``length``."""
    missing = length - int(value.shape[-1])
    if not missing:
        return value
    return torch.cat([value.new_full((*value.shape[:-1], missing), fill), value], dim=-1)


def cut_after_end(ids: Sequence[int], ends: frozenset[int]) -> tuple[int, ...]:
    """``ids`` up to and including the first of ``ends`` (all of them where none occurs)."""
    for at, token in enumerate(ids):
        if token in ends:
            return tuple(int(i) for i in ids[: at + 1])
    return tuple(int(i) for i in ids)


_A = TypeVar("_A", bound="ChatAdapter")

#: most threads :meth:`ChatAdapter.preprocess` runs the image processor on
MAX_PREPROCESS_WORKERS = 8
#: questions whose prompt tokens an adapter keeps (a benchmark asks a few hundred distinct ones)
PROMPT_CACHE_SIZE = 4096
#: (question, placeholders, device) whose prompt ids an adapter keeps on the device: a data set's questions at its
#: budgets, each (1, L) ids (L up to ~16k: 128 KB at most, 32 MB in all)
DEVICE_PROMPT_CACHE_SIZE = 256
#: questions whose text rows' input embeddings an adapter keeps on the device for the static loop, each (L - K, d_t)
#: (a chat prompt's tens of text rows: under a megabyte at d_t = 4096 in bf16)
DEVICE_TEXT_CACHE_SIZE = 64


def preprocess_workers(images: int) -> int:
    """Threads for preprocessing ``images`` images: one per image, at most one per CPU core this process may use
    (:func:`~care_core.backbones.preprocess_pool.usable_cores`) and at most :data:`MAX_PREPROCESS_WORKERS`."""
    return max(1, min(images, usable_cores(), MAX_PREPROCESS_WORKERS))


def preprocess_images(
    image_processor: Any, images: Sequence[Image.Image], *, workers: int | None = None
) -> list[dict[str, Any]]:
    """``image_processor``'s output for each RGB image alone (``return_tensors="pt"``), in order: one call per image
    on ``workers`` threads (default :func:`preprocess_workers`; the processor's resizing and normalising release the
    GIL). What :meth:`ChatAdapter.preprocess` collates, and what the GPU benchmark times."""
    from concurrent.futures import ThreadPoolExecutor

    def one(image: Image.Image) -> dict[str, Any]:
        return process_image(image_processor, image)

    threads = preprocess_workers(len(images)) if workers is None else max(1, min(int(workers), len(images)))
    with quiet_transformers():  # warnings and log levels are process-wide: set once, around the threads
        if threads <= 1:
            return [one(image) for image in images]
        with ThreadPoolExecutor(max_workers=threads) as pool:
            return list(pool.map(one, images))


class ChatAdapter(VLMAdapter):
    """Shared text side of the adapters, and the one base class of every family's adapter.

    A family's adapter derives from this class directly, never from another family's adapter; what it shares with
    other families it takes from the part modules (:mod:`~care_core.backbones.llava_modules`,
    :mod:`~care_core.backbones.anyres`, :mod:`~care_core.backbones.qwen_vl`, :mod:`~care_core.backbones.mrope`) by
    calling or assigning their functions. It sets ``image_token`` / ``image_token_id`` (:meth:`_set_image_token`) and
    ``FALLBACK_PROMPT`` (used when neither the processor nor the tokenizer has a chat template), and implements
    :attr:`_language_model` (the decoder whose ``layers[i].self_attn`` the language-model probe hooks) and, where it
    offers vision probes, :meth:`_vision_probes`. A family that adds visual rows of its own (LLaVA-NeXT's newline
    rows) overrides :meth:`fed_rows`; one whose language model takes more than input embeddings (Qwen's positions and
    DeepStack rows) overrides :meth:`_prompt_parts` (what the prompt is), :meth:`_model_inputs` and
    :meth:`_loop_prompt` (its two forms) and :attr:`static_inputs`.
    """

    FALLBACK_PROMPT = "USER: {image}\n{question} ASSISTANT:"
    #: the class that loads this family: a transformers name ("LlavaForConditionalGeneration") or, for a model class
    #: defined outside transformers (a plug-in's), a "module:Class" path
    model_class: str
    #: "module:Class" of an image-only processor to load instead of AutoProcessor's (which would need torchvision for
    #: the family's video part); None: AutoProcessor
    image_only_processor: ClassVar[str | None] = None
    _greedy_graphs: Any = None  # the StaticGreedy of generate's CUDA-graph path (made on first use)
    _graph_failure: str | None = None  # why a capture failed on this backbone (graphs are off from then on)
    # (model, unsupported_reason(model), sliding_window(model)): the walk over every decoder layer and the config
    # reads, once per model instead of per sample
    _static_form: tuple[Any, str | None, int | None] | None = None
    _pool: Any = None  # the ProcessorPool of processor_pool (made on first use)
    image_token: str
    image_token_id: int
    #: why :func:`care_core.dropin.reduce_visual_tokens` cannot serve this family (None: it can)
    dropin_refusal: str | None = None
    #: the :meth:`_lm_inputs` keys whose values :meth:`_loop_prompt` carries into the static loop (from the parts); a
    #: prompt with others, such as :attr:`PromptParts.extras` beyond them, decodes through ``model.generate``
    static_inputs: ClassVar[frozenset[str]] = frozenset({"input_ids", "attention_mask", "mm_encoder_outputs"})

    def __init__(self, model: torch.nn.Module, processor: Any, *, name: str, is_demo: bool = False) -> None:
        """What every family keeps: the model, its processor, the name and whether it is a demo, and the memos of
        pure per-input work (prompt ids per question, token geometry per image size). Each family's constructor
        calls this first, then checks the model and processor in its own order."""
        self.model = model
        self.processor = processor
        self.name = name
        self.is_demo = is_demo
        #: question -> prompt ids with one placeholder, and its place
        self._prompt_cache: dict[str, tuple[torch.Tensor, int]] = {}
        #: (question, placeholders, device) -> (1, L) prompt ids there, never written by their readers
        self._device_ids: dict[tuple[str, int, str], torch.Tensor] = {}
        #: (question, embedding table's state) -> the prompt's text rows' embeddings there
        self._device_text: dict[tuple[str, TensorState], torch.Tensor] = {}
        #: per kind, image size key -> token geometry (worked out in Python per image; each kind at most
        #: GEOMETRY_CACHE_SIZE image sizes)
        self._geometry_cache = Memos(GEOMETRY_CACHE_SIZE)

    @staticmethod
    def _check_processor(processor: Any, name: str) -> None:
        """ModelLoadError when ``processor`` lacks its tokenizer or image processor (an incomplete model folder)."""
        for attr in ("tokenizer", "image_processor"):
            if getattr(processor, attr, None) is None:
                raise ModelLoadError(f"{name}: the processor has no {attr}; the model folder is incomplete")

    @classmethod
    def _load_processor(cls, folder: Path) -> Any:
        """The folder's processor (tokenizer + image processor); offline. Families whose transformers processor needs
        a video processor (torchvision) name an image-only one in :attr:`image_only_processor`."""
        if cls.image_only_processor is not None:
            return import_path(cls.image_only_processor).from_pretrained(str(folder), local_files_only=True)
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(str(folder), local_files_only=True)

    @classmethod
    def from_folder(
        cls: type[_A],
        folder: Path,
        *,
        name: str,
        is_demo: bool = False,
        device: torch.device,
        dtype: torch.dtype | str,
    ) -> _A:
        """Load model + processor from a local folder (never the network). Model errors propagate raw."""
        import transformers

        kwargs: dict[str, Any] = {"local_files_only": True, "dtype": dtype}
        if device.type != "cpu":
            kwargs["device_map"] = device
        with quiet_transformers():
            try:
                processor = cls._load_processor(folder)
            except Exception as exc:
                detail = one_line(exc).split(". ")[0]
                raise ModelLoadError(
                    f"cannot load the processor (tokenizer, image processor config) from {folder}: "
                    f"{type(exc).__name__}: {detail}"
                ) from exc
            loader = import_path(cls.model_class) if ":" in cls.model_class else getattr(transformers, cls.model_class)
            model = loader.from_pretrained(str(folder), **kwargs)
            model = model.to(device).eval()
            model.requires_grad_(False)
        return cls(model, processor, name=name, is_demo=is_demo)  # type: ignore[call-arg]  # the subclasses' constructor

    @property
    def tokenizer(self) -> Any:
        return self.processor.tokenizer

    def _set_image_token(self, image_token_id: int | None) -> None:
        if image_token_id is None:
            raise ModelLoadError(f"{self.name}: the model config has no image token id")
        self.image_token_id = int(image_token_id)
        image_token = self.tokenizer.convert_ids_to_tokens(self.image_token_id)
        if not isinstance(image_token, str) or not image_token:
            raise ModelLoadError(f"{self.name}: the tokenizer has no token for image_token_id {image_token_id}")
        self.image_token = image_token

    # ------------------------------------------------------------------ vision
    def encode_image(self, image: Image.Image) -> ImageTokens:
        """Pre-projector tokens of ``image`` and their geometry: the batch of one of :meth:`encode_images`."""
        return self.encode_images([image])[0]

    def encode_images(self, images: Sequence[Image.Image]) -> list[ImageTokens]:
        """:meth:`preprocess` then :meth:`encode_processed`: the vision tower once for all the images."""
        rgb = [to_rgb(image) for image in images]
        return self.encode_processed(self.preprocess(rgb), [(image.height, image.width) for image in rgb])

    def process_image(self, image: Image.Image) -> dict[str, Any]:
        """The image processor's outputs (CPU tensors) for one image, as for a list of one; touches no process-wide
        state, so worker threads may call it (wrap the calls in ``quiet_transformers()`` once, outside them).
        ImageError for an image the processor refuses (:meth:`check_image`)."""
        self.check_image(image)
        return process_image(self.processor.image_processor, image)

    def processor_pool(self) -> Any:
        """This adapter's :class:`~care_core.backbones.preprocess_pool.ProcessorPool` (started on first use, kept
        with the adapter): the image processor on worker processes, for data-set runs on a GPU."""
        if self._pool is None:
            self._pool = ProcessorPool(self.processor.image_processor)
        return self._pool

    def preprocess(self, images: Sequence[Image.Image]) -> dict[str, Any]:
        """The image processor's outputs for ``images``: one image per call on :func:`preprocess_workers` threads
        (:func:`preprocess_images`), then :meth:`collate`. Per image exactly the processor's output for it alone;
        ImageError for an image the processor refuses (:meth:`check_image`), before any is processed."""
        for image in images:
            self.check_image(image)
        return self.collate(preprocess_images(self.processor.image_processor, images))

    def collate(self, parts: list[dict[str, Any]]) -> dict[str, Any]:
        """One image processor output per image -> the batch output (what the processor gives for the list)."""
        raise NotImplementedError

    def encode_processed(self, processed: Mapping[str, Any], sizes: Sequence[tuple[int, int]]) -> list[ImageTokens]:
        """Pre-projector tokens of every image of ``processed`` (the image processor's batch outputs for images in
        order, as :meth:`preprocess` or the model's own processor returns them) from one vision-tower pass;
        ``sizes``: each image's original (height, width), which places the tokens in the image's frame."""
        raise NotImplementedError

    def batch_features(self, pixel_values: torch.Tensor, reference: ImageTokens) -> torch.Tensor:
        """(B, N, d_v) pre-projector features of B images that share ``reference``'s geometry (``pixel_values``: their
        processor outputs stacked along a new first dimension), from the family's own tower pass with gradients where
        enabled: what ``scripts/train_demo`` trains through. Families it does not train raise NotImplementedError."""
        raise NotImplementedError(f"the {self.family} adapter has no batched training features")

    # ------------------------------------------------------------------ text
    def question_embeddings(self, question: str) -> torch.Tensor:
        tok = self.tokenizer
        ids: list[int] = []
        if question.strip():
            ids = tok(question, add_special_tokens=False)["input_ids"]
        drop = {int(i) for i in tok.all_special_ids} | {self.image_token_id}
        keep = [int(i) for i in ids if int(i) not in drop]
        if not keep:
            raise QuestionError(f'question "{question}" has no tokens the language model can embed')
        emb = self.model.get_input_embeddings()
        with torch.no_grad():
            return emb(torch.tensor(keep, dtype=torch.long, device=emb.weight.device))

    def _clean_question(self, question: str) -> str:
        return question.replace(self.image_token, "")

    def prompt(self, question: str) -> str:
        """The model's chat prompt for one image + ``question`` (one image placeholder)."""
        question = self._clean_question(question)
        conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        for owner in (self.processor, self.tokenizer):
            if not getattr(owner, "chat_template", None):
                continue
            try:
                with quiet_transformers():
                    text = owner.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
            except Exception:
                continue
            if isinstance(text, list):
                text = text[0] if len(text) == 1 else None
            if isinstance(text, str) and text.count(self.image_token) == 1:
                return text
        return self.FALLBACK_PROMPT.format(image=self.image_token, question=question)

    def processor_prompt(self, question: str) -> str:
        """:meth:`prompt` as the model's own processor takes it (with one image each): the same text with the image
        placeholder the processor expands. The same string here; a family whose processor reads another token
        (Gemma 3's ``<start_of_image>``) says so in its adapter."""
        return self.prompt(question)

    def _image_text(self, k: int) -> str:
        """What stands for the image in the prompt's text: ``k`` placeholders (InternVL wraps them in ``<img>``)."""
        return self.image_token * k

    def _encode_prompt(self, question: str, k: int) -> dict[str, torch.Tensor]:
        """The prompt's ``input_ids`` and ``attention_mask`` with exactly ``k`` image placeholders (no processor
        expansion): the prompt with one placeholder tokenised once per question (kept, :data:`PROMPT_CACHE_SIZE`),
        its placeholder then repeated ``k`` times. That is the tokenisation of ``k`` placeholders: a tokenizer cuts
        the text at added tokens first, and the empty texts between placeholders give no tokens (tested on every
        family's tokenizer); tokenising thousands of placeholders per sample is what it saves."""
        full, _ = self._placeholder_ids(question, k)
        return {"input_ids": full, "attention_mask": torch.ones_like(full)}

    def _placeholder_ids(self, question: str, k: int) -> tuple[torch.Tensor, int]:
        """(1, L) ids of the prompt with ``k`` image placeholders on the model's device (:meth:`_prompt_ids_with`),
        kept there per (question, k) (:data:`DEVICE_PROMPT_CACHE_SIZE`), and the first placeholder's place (the
        ``k`` are one run from there). Every reader only reads them (embeddings, masks, positions)."""
        device = self.device
        # a fresh host tensor: a blocking copy would wait for all the GPU work queued before it
        ids = recall(self._device_ids, (question, k, str(device)),
                     lambda: self._prompt_ids_with(question, k).to(device, non_blocking=True),
                     DEVICE_PROMPT_CACHE_SIZE)  # fmt: skip
        return ids, self._prompt_ids(question)[1]

    def _prompt_ids_with(self, question: str, k: int) -> torch.Tensor:
        """(1, L) token ids (a fresh CPU tensor) of the prompt with ``k`` image placeholders where the one-placeholder
        prompt has its one (:meth:`_prompt_ids`)."""
        ids, at = self._prompt_ids(question)
        return torch.cat([ids[:at], ids.new_full((k,), self.image_token_id), ids[at + 1 :]])[None]

    def _prompt_ids(self, question: str) -> tuple[torch.Tensor, int]:
        """(L,) token ids (CPU) of the prompt with one image placeholder, and the placeholder's place; kept per
        question."""

        def tokenised() -> tuple[torch.Tensor, int]:
            head, tail = self.prompt(question).split(self.image_token, 1)
            ids = self.tokenizer(head + self._image_text(1) + tail, return_tensors="pt")["input_ids"][0]
            n = int((ids == self.image_token_id).sum())
            if n != 1:
                raise RuntimeError(f"the prompt with one image placeholder tokenised to {n} of them")
            return ids, int((ids == self.image_token_id).nonzero()[0])

        return recall(self._prompt_cache, question, tokenised, PROMPT_CACHE_SIZE)

    def _check_projected(self, projected: torch.Tensor) -> torch.Tensor:
        """``projected`` (K >= 1, d_t), detached, in the embedding table's dtype and device."""
        emb = tensor_attr(input_embeddings(self.model), "weight")
        hidden = int(emb.shape[1])
        if projected.dim() != 2 or projected.shape[0] < 1 or projected.shape[1] != hidden:
            raise ValueError(f"projected must be (K >= 1, {hidden}); got {tuple(projected.shape)}")
        return projected.detach().to(device=emb.device, dtype=emb.dtype)

    @property
    def _pad_token_id(self) -> int:
        tok = self.tokenizer
        return int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)

    def _greedy(self, inputs: dict[str, Any], max_new_tokens: int) -> list[tuple[int, ...]]:
        """Greedy decoding of a batch of prompts (``input_ids``, ``attention_mask`` and model extras, left-padded
        as :func:`collate_left_padded` gives them) through ``model.generate``; per row the new token ids, up to
        and including the first end token (the padding ``model.generate`` puts after it dropped)."""
        with torch.no_grad(), quiet_transformers():
            out = self.model.generate(
                **inputs,
                max_new_tokens=int(max_new_tokens),
                do_sample=False,
                num_beams=1,
                pad_token_id=self._pad_token_id,
            )
        ends = eos_ids(self.model)
        return [cut_after_end(row, ends) for row in out[:, inputs["input_ids"].shape[1] :].tolist()]

    # ------------------------------------------------------------------ language model
    def _lm_inputs(
        self,
        question: str,
        tokens: ImageTokens,
        projected: torch.Tensor,
        kept: torch.Tensor | None,
        *,
        probe: bool = False,
    ) -> dict[str, Any]:
        """Keyword arguments of ``self.model`` for the prompt with ``projected`` as its visual rows: always
        ``input_ids``, ``attention_mask`` and ``mm_encoder_outputs``, family extras as needed (:meth:`_model_inputs`
        of :meth:`_prompt_parts`, which says what ``probe`` does)."""
        return self._model_inputs(self._prompt_parts(question, tokens, projected, kept, probe=probe))

    def _prompt_parts(
        self,
        question: str,
        tokens: ImageTokens,
        projected: torch.Tensor,
        kept: torch.Tensor | None,
        *,
        probe: bool = False,
    ) -> PromptParts:
        """The prompt with ``projected`` as its visual rows, in parts, everything checked (the errors of
        :meth:`generate` for a bad ``projected``, ``kept`` or ``tokens`` come from here, before any decoding).

        ``probe=True``: the language-model probe's sequence (exactly one placeholder per row). This default: one
        placeholder per row of :meth:`fed_rows` (the K rows in the order given, plus any rows the family adds:
        LLaVA-NeXT's and OneVision's newline rows), for families whose language model has 1-D positions that follow
        the mask (LLaVA-1.5, LLaVA-NeXT, LLaVA-OneVision, InternVL3).
        """
        rows = self._check_projected(projected)
        kept = check_kept(kept, int(rows.shape[0]), tokens.num_tokens)
        if not probe:
            rows = self.fed_rows(tokens, rows, kept)
        ids, start = self._placeholder_ids(question, int(rows.shape[0]))
        return PromptParts(ids, start, rows, tokens, kept, question)

    def _model_inputs(self, parts: PromptParts) -> dict[str, Any]:
        """The model's keyword arguments for ``parts``: the ids, their all-ones attention mask, the parts' extras and
        the rows in the family's encoder-output container (:meth:`_encoder_outputs`)."""
        ids = parts.input_ids
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), **parts.extras,
                "mm_encoder_outputs": self._encoder_outputs(parts.rows, parts.tokens, parts.kept)}  # fmt: skip

    def fed_rows(self, tokens: ImageTokens, rows: torch.Tensor, kept: torch.Tensor | None) -> torch.Tensor:
        """The visual rows (..., R, d_t) the language model receives for projected rows (..., K, d_t) of an image with
        ``tokens``' geometry (``kept`` as in :meth:`language_model_logits`): the rows themselves, except where a
        family adds rows of its own (LLaVA-NeXT's newline rows)."""
        return rows

    def _encoder_outputs(self, rows: torch.Tensor, tokens: ImageTokens, kept: torch.Tensor | None) -> dict[str, Any]:
        """``mm_encoder_outputs`` for the K visual rows of one image, in the container the family's model takes
        (default: one image's rows listed; InternVL takes one tensor, Qwen3-VL adds its deepstack rows)."""
        return mm_encoder_outputs(rows)

    @property
    def _language_model(self) -> torch.nn.Module:
        raise NotImplementedError

    def language_model_logits(
        self, question: str, tokens: ImageTokens, projected: torch.Tensor, kept: torch.Tensor | None = None
    ) -> torch.Tensor:
        inputs = self._lm_inputs(question, tokens, projected, kept)
        self._raise_kept_problem(self._kept_check([kept], [tokens]))
        with torch.no_grad(), quiet_transformers():
            out = self.model(**inputs)
        return out.logits[0]

    def generate(
        self,
        question: str,
        tokens: ImageTokens,
        projected: torch.Tensor,
        max_new_tokens: int = 32,
        kept: torch.Tensor | None = None,
        *,
        cuda_graph: bool | None = None,
    ) -> Generation:
        """Greedy answer; ``cuda_graph``: None = replayed CUDA graphs over a static cache where
        :meth:`graph_generation_reason` finds nothing against them, else ``model.generate``; True = graphs or
        GenerationError; False = no graphs: the same static loop step by step where graphs would apply, else
        ``model.generate``. The result says which ran and why not graphs.
        A batch of one of :meth:`generate_batch`."""
        return self.generate_batch([question], [tokens], [projected], [kept], max_new_tokens, cuda_graph=cuda_graph)[0]

    def generate_batch(
        self,
        questions: Sequence[str],
        tokens: Sequence[ImageTokens],
        projected: Sequence[torch.Tensor],
        kept: Sequence[torch.Tensor | None],
        max_new_tokens: int = 32,
        *,
        cuda_graph: bool | None = None,
    ) -> list[Generation]:
        """:meth:`generate` for several samples in one decoding: graphs where every sample allows them (one
        :meth:`~care_core.backbones.static_generation.StaticGreedy.generate_batch`), else one batched
        ``model.generate`` over the left-padded prompts. Per sample the answer it gets alone (``elapsed_ms``:
        the batch's time); see docs/design/batches.md §Batched answers."""
        start = time.perf_counter()
        check_batch(questions, tokens, projected, kept)
        # device kept stays there: the prompts and the prefill are queued behind the reduction that made it, and its
        # range is copied back behind the prefill and read with the answers (check_kept): the host never waits for it
        parts = [self._prompt_parts(q, t, p, k) for q, t, p, k in zip(questions, tokens, projected, kept, strict=True)]
        check = self._kept_check(kept, tokens)
        if max_new_tokens < 1:
            self._raise_kept_problem(check)
            return [Generation("", (), "eager", "no new tokens were asked for") for _ in parts]
        if not parts:
            return []
        answers, decoding, reason = self._decode(parts, max_new_tokens, cuda_graph, check.queue)
        self._raise_kept_problem(check)
        elapsed_ms = (time.perf_counter() - start) * 1e3
        decode = self.tokenizer.decode
        return [
            Generation(
                decode(list(ids), skip_special_tokens=True).strip(), ids, decoding, reason, elapsed_ms=elapsed_ms
            )
            for ids in answers
        ]

    @staticmethod
    def _kept_check(kept: Sequence[torch.Tensor | None], tokens: Sequence[ImageTokens]) -> KeptRangeCheck:
        """The device ``kept``s' range check, not queued yet (:class:`~care_core.backbones.base.KeptRangeCheck`)."""
        return KeptRangeCheck([k if isinstance(k, torch.Tensor) else None for k in kept],
                              [t.num_tokens for t in tokens])  # fmt: skip

    @staticmethod
    def _raise_kept_problem(check: KeptRangeCheck) -> None:
        """ValueError (one line) when a device ``kept`` held indices out of range; the device work that used them
        clamped them (no device-side error), and its answers are dropped."""
        problem = check.problem()
        if problem is not None:
            raise ValueError(problem)

    def _decode(
        self, parts: list[PromptParts], max_new_tokens: int, cuda_graph: bool | None, after_prefill: Callable[[], None]
    ) -> tuple[list[tuple[int, ...]], Decoding, str | None]:
        """Every sample's new token ids, how they were decoded and why not from graphs (see :meth:`generate`): each
        prompt takes the static loop's form (:meth:`_loop_prompt`) or the model's (:meth:`_model_inputs`), never
        both. ``after_prefill``: host work to queue behind the prefill (the static loop runs it once the prefill is
        launched, overlapping it; ``model.generate`` gives no such point: it runs first)."""
        reason = (
            "turned off (cuda_graph=False)" if cuda_graph is False else self._batch_graph_reason(parts, max_new_tokens)
        )
        if reason is None:
            try:
                return self._static_ids(parts, max_new_tokens, after_prefill, replay=True), "cuda-graph", None
            except Exception as exc:  # a capture these modules do not allow: say so, decode eagerly from now on
                self._greedy_graphs = None  # its cache and graphs go (with an out-of-memory error, to make room)
                if is_out_of_memory(exc):  # not the modules' fault: the caller splits the batch (care_core.batch_sizes)
                    raise
                reason = self._graph_failure = f"capturing the decoder failed ({type(exc).__name__}: {one_line(exc)})"
                if cuda_graph:
                    raise GenerationError(f"cannot generate from CUDA graphs: {reason}") from exc
        elif cuda_graph:
            raise GenerationError(f"cannot generate from CUDA graphs: {reason}")
        elif cuda_graph is False and self._batch_graph_reason(parts, max_new_tokens) is None:
            return self._static_ids(parts, max_new_tokens, after_prefill, replay=False), "eager", reason
        after_prefill()
        inputs = [self._model_inputs(one) for one in parts]
        return self._greedy(collate_left_padded(inputs, self._pad_token_id), max_new_tokens), "eager", reason

    def _static_ids(
        self, parts: list[PromptParts], max_new_tokens: int, after_prefill: Callable[[], None], *, replay: bool
    ) -> list[tuple[int, ...]]:
        """Every sample's new token ids from the static loop (``replay`` False: step by step, no graphs; its lean
        layers launch about a third of transformers' kernels, which is what an eager forward waits on)."""
        with torch.no_grad():
            prompts = [self._loop_prompt(one) for one in parts]
            greedy = self._static_greedy()
            ids = greedy.generate_batch(prompts, max_new_tokens, replay=replay, after_prefill=after_prefill)
        return [tuple(i) for i in ids]

    def graph_generation_reason(self, length: int | None = None) -> str | None:
        """Why :meth:`generate` would not replay CUDA graphs on this backbone (one line), or None when it would.

        ``length``: prompt plus new tokens, where known.
        """
        if self.device.type != "cuda":
            return f"CUDA graphs need a CUDA device; {self.name} runs on {self.device.type}"
        if self._graph_failure is not None:
            return self._graph_failure
        form = self._static_form
        if form is None or form[0] is not self.model:
            form = self._static_form = (self.model, unsupported_reason(self.model), sliding_window(self.model))
        return form[1] or length_reason(form[2], length)

    def _graph_reason(self, inputs: Mapping[str, Any], max_new_tokens: int) -> str | None:
        """Why a prompt would not decode from graphs (None: it would): ``inputs``, the model's keyword arguments (or
        those :meth:`PromptParts.carried` lists), with a key beyond :attr:`static_inputs`, or
        :meth:`graph_generation_reason` at its length."""
        extra = sorted(set(inputs) - self.static_inputs)
        if extra:
            return f"the {self.family} prompt carries {', '.join(extra)} beside its embeddings"
        return self.graph_generation_reason(int(inputs["input_ids"].shape[1]) + max_new_tokens)

    def _batch_graph_reason(self, parts: list[PromptParts], max_new_tokens: int) -> str | None:
        """The first sample's reason against graphs (None when every sample allows them)."""
        reasons = (self._graph_reason(one.carried(), max_new_tokens) for one in parts)
        return next((r for r in reasons if r is not None), None)

    def release_decoding_cache(self) -> None:
        """Drop the static KV cache and the captured graphs; the next graph call captures anew."""
        if self._greedy_graphs is not None:
            self._greedy_graphs = None
            free_memory()

    def _static_greedy(self) -> Any:
        """The adapter's :class:`~care_core.backbones.static_generation.StaticGreedy` (made on first use)."""
        greedy = self._greedy_graphs
        if greedy is None or greedy.model is not self.model or greedy.stale:
            greedy = StaticGreedy(self.model, graphs=True)
            self._greedy_graphs = greedy
        return greedy

    def _loop_prompt(self, parts: PromptParts) -> StaticPrompt:
        """The static loop's prompt straight from ``parts`` (what the model's own inputs give, bit for bit): the
        question's text rows (:meth:`_text_rows`) with the rows inserted where their placeholders' run starts
        (``parts.start``; the loop writes them in one copy), and the parts' positions. Families whose loop takes
        more (Qwen3-VL's DeepStack rows) extend it."""
        return StaticPrompt(self._text_rows(parts.question), parts.positions, inserted=parts.rows, at=parts.start)

    def _text_rows(self, question: str) -> torch.Tensor:
        """The input embeddings (L - K, d_t) of the prompt's text rows (its one-placeholder ids but the placeholder,
        :meth:`_prompt_ids`) on the table's device: what every static-loop prompt of ``question`` holds around its
        visual rows, whatever the image. Kept per question and table state (:data:`DEVICE_TEXT_CACHE_SIZE`; a moved,
        cast or edited table gets its own): embedding the ids again at each request is a launch and tens of µs of
        host time before the prefill's. The input embeddings
        (:func:`~care_core.backbones.module_attrs.input_embeddings`) are the table the loop embeds new tokens with;
        the ids are embedded as they are, which no family whose text tokens lie beyond the table meets (Gemma 3's
        image token does; the static loop drives no such decoder)."""
        embeddings = input_embeddings(self.model)
        table = tensor_attr(embeddings, "weight")

        def embedded() -> torch.Tensor:
            ids, at = self._prompt_ids(question)
            # a fresh host tensor copied without waiting: a blocking copy would wait for all the GPU work queued
            # before it (a data set's batch asks a new question per sample, behind its reduction)
            text = torch.cat([ids[:at], ids[at + 1 :]]).to(table.device, non_blocking=True)
            with torch.no_grad():
                return embeddings(text)

        return recall(self._device_text, (question, tensor_state(table)), embedded, DEVICE_TEXT_CACHE_SIZE)

    def _prompt_embeddings(self, inputs: dict[str, Any]) -> torch.Tensor:
        """(1, L, d_t) input embeddings of a prompt from :meth:`_lm_inputs`, visual rows in its placeholders."""
        ids = inputs["input_ids"]
        visual = visual_rows(inputs["mm_encoder_outputs"]["image"])
        embeds = self.model.get_input_embeddings()(ids)
        mask = (ids == self.image_token_id).unsqueeze(-1).expand_as(embeds)
        return embeds.masked_scatter(mask, visual.to(embeds.dtype))

    # ------------------------------------------------------------------ probes
    def _vision_probes(self, tokens: ImageTokens, names: set[str]) -> dict[str, Any]:
        raise NotImplementedError

    def probe_inputs(self, tokens: ImageTokens, names: Iterable[str], question: str | None = None) -> dict[str, Any]:
        """The requested probes (see ``care_core.vocabulary.PROBES``) for the image of ``tokens``.

        Names outside :attr:`capabilities` raise MethodError (one line, naming the backbone and why).
        Vision probes come from one pass of the vision tower over ``tokens.model_inputs["pixel_values"]``,
        stopped as soon as the last hooked value is captured; the tower keeps its attention implementation
        (see :func:`~care_core.backbones.probes.clip_vision_probes` for shapes and dtypes). ``question`` is
        :meth:`question_embeddings`; ``language_model`` is a :class:`~care_core.backbones.probes.LanguageModelRun`
        on the prompt with ``question`` (or :data:`~care_core.vocabulary.DEFAULT_QUESTION`) and all N projected
        visual tokens, fed like :meth:`language_model_logits` (one placeholder per token: no LLaVA-NeXT newline rows).
        """
        wanted = list(dict.fromkeys(names))
        self.check_probes(wanted)
        if "question" in wanted and question is None:
            raise QuestionError("the 'question' probe needs a question")
        out: dict[str, Any] = {}
        vision = {n for n in wanted if n in VISION_PROBES}
        if vision:
            if tokens.model_inputs.get("pixel_values") is None:
                raise ValueError("tokens.model_inputs has no pixel_values; use ImageTokens from encode_image")
            out.update(self._vision_probes(tokens, vision))
        if "question" in wanted:
            out["question"] = self.question_embeddings(question)  # type: ignore[arg-type]  # None refused above
        if "language_model" in wanted:
            out["language_model"] = self.language_model_probe(tokens, question)
        return {n: out[n] for n in wanted}

    def language_model_probe(self, tokens: ImageTokens, question: str | None = None) -> LanguageModelRun:
        """A LanguageModelProbe on the prompt with ``question`` and all N projected visual tokens."""
        if question is None or not question.strip():
            question = DEFAULT_QUESTION
        with torch.no_grad():
            projected = self.projector(tokens.features)
        inputs = self._lm_inputs(question, tokens, projected, None, probe=True)
        model = self.model
        image_token_id = self.image_token_id
        ids = inputs["input_ids"]
        layers = typed_attr(self._language_model, "layers", torch.nn.ModuleList)

        def forward() -> Any:
            return model(**inputs, use_cache=False)

        def embeddings() -> torch.Tensor:
            return self._prompt_embeddings(inputs)[0]

        return LanguageModelRun(
            forward=forward,
            input_ids=ids,
            image_token_id=image_token_id,
            embeddings=embeddings,
            attention_modules=[submodule(layer, "self_attn") for layer in layers],
            eager=lambda: attention_implementation(model, {"text_config": "eager"}),
        )
