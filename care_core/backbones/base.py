"""The one interface every backbone adapter implements.

Adapters are the only code that knows a model family's module paths: methods, the core
maths and the CLI see only :class:`ImageTokens` and :class:`VLMAdapter`.

The reduced-token path. ``language_model_logits`` and ``generate`` take the projected rows handed to the
language model, ``projected`` (K, d_t), plus ``kept``: a (K,) long tensor holding, for every row, the index
(0..N-1) of the visual token it belongs to, or -1 for a row tied to no token (a summary or merged row such as
PruMerge's extra row). ``kept=None`` means rows 0..K-1 are tokens 0..K-1 in order (so, with K = N, all tokens).
What a backbone does with ``kept``:

* LLaVA-1.5: nothing (its language model has 1-D positions; rows are fed in the order given).
* LLaVA-NeXT: rows are fed in the order given, without ``image_newline`` rows; only when the rows are exactly
  all N tokens in packed order (``kept`` None with K = N, or ``kept == arange(N)``) is the model's own full
  sequence rebuilt, newline rows included, so K = N reproduces the standard path.
* LLaVA-OneVision: as LLaVA-NeXT (K rows as given, never pooled); all N tokens in packed order rebuild the model's
  own sequence through its ``pack_image_features``, its bilinear pooling of large grids included.
* Qwen2.5-VL: every row gets the multimodal-rope (t, h, w) position of its token in the full sequence (the
  text after the image keeps its original positions); rows with -1 get the position of the last image
  token (the bottom-right merged patch), so they sit at the end of the image in rope space.
* Qwen3-VL: positions as Qwen2.5-VL; every DeepStack level gets the same K rows in the same order (row r: token
  ``kept[r]``'s deepstack rows; rows with -1: zero rows, nothing added).

:meth:`VLMAdapter.visual_tokens_fed` says how many visual rows the language model then really receives.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from PIL import Image

from ..errors import ImageError, MethodError
from ..generation import Generation
from ..vocabulary import PROBES
from .families import backbone_family


@dataclass
class ImageTokens:
    """Visual tokens of one image, before the projector, with their geometry."""

    features: torch.Tensor  # (N, d_v) pre-projector tokens V, in the order the model uses
    positions: torch.Tensor  # (N, 2) normalised (row, col) centres p in [0, 1], original-image frame
    boxes: torch.Tensor  # (N, 4) each token's pixel footprint [x0, y0, x1, y1] in the original image
    image_size: tuple[int, int]  # (height, width) of the original image
    seen_box: tuple[float, float, float, float]  # [x0, y0, x1, y1] of the original image the tokens cover
    grid: tuple[int, int] | None = None  # (rows, cols) when the tokens form one raster grid
    model_inputs: dict[str, Any] = field(default_factory=dict)  # processor outputs, kept to feed the LM
    views: torch.Tensor | None = None  # (N,) long, anyres families only: 0 = base-view token, 1 = high-resolution

    @property
    def num_tokens(self) -> int:
        return int(self.features.shape[0])


def check_kept(kept: torch.Tensor | None, rows: int, num_tokens: int) -> torch.Tensor | None:
    """``kept`` as a long tensor after checking it against K rows and N tokens (None stays None).

    A host tensor is checked whole. A device tensor stays where it is and only its shape and dtype are checked here:
    reading its values would wait for all the work queued before it (on a GPU, the reduction that made it), so its
    range is the caller's to read after it has queued its own work (:func:`queue_kept_bounds`)."""
    if kept is None:
        if rows > num_tokens:
            raise ValueError(f"{rows} projected rows but only {num_tokens} visual tokens; pass kept")
        return None
    kept = torch.as_tensor(kept)  # integer tensors never carry gradients: nothing to detach
    if kept.dim() != 1 or kept.shape[0] != rows:
        raise ValueError(f"kept must be ({rows},) (one entry per projected row); got {tuple(kept.shape)}")
    if kept.is_floating_point() or kept.dtype == torch.bool:
        raise ValueError(f"kept must hold integer token indices, got {kept.dtype}")
    kept = kept.long()
    if kept.device.type == "cpu" and kept.numel() and not _in_range(int(kept.min()), int(kept.max()), num_tokens):
        raise ValueError(_range_message(num_tokens))
    return kept


def _in_range(low: int, high: int, num_tokens: int) -> bool:
    return low >= -1 and high < num_tokens  # -1: a row tied to no token


def _range_message(num_tokens: int) -> str:
    return f"kept holds indices outside -1..{num_tokens - 1}"


@dataclass(frozen=True)
class KeptBounds:
    """Every device ``kept``'s (min, max), copied to the host behind the work queued when they were asked for
    (:func:`queue_kept_bounds`): read after the caller's own wait for the device (its answers), by when the copy has
    landed, so the check adds no round trip to the device after the answer."""

    host: torch.Tensor  # (samples, 2) lowest and highest index per device kept (pinned on CUDA)
    num_tokens: tuple[int, ...]  # each sample's N
    ready: Any = None  # a CUDA event recorded after the copy (None: the copy was a blocking one)

    def problem(self) -> str | None:
        """The first sample's out-of-range ``kept`` (one line), or None."""
        if self.ready is not None:
            self.ready.synchronize()  # done already where the caller waited for later work on the stream
        for n, (low, high) in zip(self.num_tokens, self.host.tolist(), strict=True):
            if not _in_range(low, high, n):
                return _range_message(n)
        return None


def queue_kept_bounds(kept: Sequence[torch.Tensor | None], num_tokens: Sequence[int]) -> KeptBounds | None:
    """The range :func:`check_kept` leaves to its caller for device tensors, queued: every sample's bounds in one copy
    to the host that waits for nothing (host tensors were checked whole already; None where no kept is on a device)."""
    on_device = [(k, n) for k, n in zip(kept, num_tokens, strict=True)
                 if k is not None and k.device.type != "cpu" and k.numel()]  # fmt: skip
    if not on_device:
        return None
    device = on_device[0][0].device
    bounds = torch.stack([torch.stack(torch.aminmax(k)).to(device) for k, _ in on_device])
    counts = tuple(n for _, n in on_device)
    if device.type != "cuda":
        return KeptBounds(bounds.cpu(), counts)
    host = torch.empty(bounds.shape, dtype=bounds.dtype, pin_memory=True)
    host.copy_(bounds, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(device))
    return KeptBounds(host, counts, ready)


class KeptRangeCheck:
    """The device ``kept``s' range check of one call: queued at most once (:meth:`queue`, behind the device work
    queued so far: a caller that queues it right after launching its prefill keeps it off the host's path to that
    launch), read by :meth:`problem`, which queues it first where nobody did."""

    def __init__(self, kept: Sequence[torch.Tensor | None], num_tokens: Sequence[int]) -> None:
        self._kept, self._num_tokens = kept, num_tokens
        self._bounds: KeptBounds | None = None
        self._queued = False

    def queue(self) -> None:
        """Queue the bounds' copy to the host (once; later calls do nothing)."""
        if not self._queued:
            self._bounds, self._queued = queue_kept_bounds(self._kept, self._num_tokens), True

    def problem(self) -> str | None:
        """The first sample's out-of-range ``kept`` (one line), or None (:meth:`KeptBounds.problem`)."""
        self.queue()
        return None if self._bounds is None else self._bounds.problem()


def is_all_tokens(kept: torch.Tensor | None, rows: int, num_tokens: int) -> bool:
    """True when the rows are exactly tokens 0..N-1 in order."""
    if rows != num_tokens:
        return False
    return kept is None or bool(torch.equal(kept, torch.arange(num_tokens, device=kept.device)))


def first_parameter(module: torch.nn.Module) -> torch.Tensor:
    """``next(module.parameters())``: the module's own first parameter, else the first of its children's in order,
    depth first (StopIteration where it has none), by a plain walk: a fifth of the generators' host time, and the
    device and dtype are read several times per request."""
    found = _first_parameter(module)
    if found is None:
        raise StopIteration
    return found


def _first_parameter(module: torch.nn.Module) -> torch.Tensor | None:
    for parameter in module._parameters.values():
        if parameter is not None:
            return parameter
    for child in module._modules.values():
        found = None if child is None else _first_parameter(child)
        if found is not None:
            return found
    return None


def check_batch(*columns: Sequence[Any]) -> None:
    """ValueError unless ``generate_batch``'s questions, images, rows and kept have one entry per sample."""
    lengths = {len(column) for column in columns}
    if len(lengths) > 1:
        raise ValueError(f"generate_batch needs one question, image, rows and kept per sample; got {sorted(lengths)}")


class VLMAdapter(ABC):
    """A loaded vision-language model seen through the few operations token reduction needs."""

    family: str  # the name of its record in care_core.backbones.families, e.g. "llava-1.5"
    name: str  # what the user asked for: a demo name, a folder or a repo id
    is_demo: bool  # True for the embedded demo backbones (by name, or through a folder with a demo marker)
    model: Any  # a transformers PreTrainedModel: its attributes are dynamic, so typed loosely
    processor: Any
    #: one line for the user when the backbone is a demo (trained on synthetic shapes, or random weights); None for
    #: real models. Set by the loader.
    demo_note: str | None = None
    _notices: list[str] | None = None
    #: probe name -> how this backbone builds it, where that differs from a single-grid CLIP tower
    probe_notes: ClassVar[dict[str, str]] = {}
    #: the largest aspect ratio (long side over short side) the family's image processor takes; None: any
    max_aspect_ratio: ClassVar[float | None] = None

    @property
    def notices(self) -> list[str]:
        """One-line notices from loading (e.g. a damaged cached demo restored); the CLI shows them on stderr."""
        if self._notices is None:
            self._notices = []
        return self._notices

    @property
    def display(self) -> str:
        """The family's display name (e.g. "Qwen2.5-VL"), from its registry record."""
        return backbone_family(self.family).display

    @property
    def device(self) -> torch.device:
        return first_parameter(self.model).device

    @property
    def dtype(self) -> torch.dtype:
        return first_parameter(self.model).dtype

    @property
    def capabilities(self) -> frozenset[str]:
        """The probes (keys of ``care_core.vocabulary.PROBES``) this backbone can provide."""
        return frozenset(PROBES)

    def why_probe_missing(self, probe: str) -> str:
        """Why ``probe`` is not in :attr:`capabilities` (a short clause, e.g. "Qwen2.5-VL has no CLS token")."""
        return f"the {self.family} backbone does not compute it"

    def check_probes(self, names: Iterable[str], method: str | None = None) -> None:
        """MethodError (one line) if any of ``names`` is unknown or not offered by this backbone.

        Commands call it with a method's ``needs`` before any work, so the method refuses up front.
        """
        wanted = list(dict.fromkeys(names))
        unknown = [n for n in wanted if n not in PROBES]
        if unknown:
            raise MethodError(f"unknown probe(s) {unknown}; known: {sorted(PROBES)}")
        missing = [n for n in PROBES if n in wanted and n not in self.capabilities]
        if not missing:
            return
        listed = ", ".join(missing)
        reason = self.why_probe_missing(missing[0])
        if method:
            raise MethodError(
                f"method {method!r} cannot run on {self.name}: it needs {listed}, "
                f"which the {self.family} backbone does not provide ({reason})"
            )
        verb = "is" if len(missing) == 1 else "are"
        raise MethodError(f"{self.name}: {reason}; {listed} {verb} not available")

    def check_image(self, image: Image.Image, name: str | None = None) -> None:
        """ImageError (one line, naming ``name``, default the image's size) for an image the family's image processor
        refuses; every path into the processor calls it first, and commands call it with the file's name."""
        limit = self.max_aspect_ratio
        width, height = image.size
        ratio = max(width, height) / max(1, min(width, height))
        if limit is not None and ratio > limit:
            raise ImageError(f"{name or 'image'} ({width}×{height} px): aspect ratio {ratio:.6g}:1 exceeds "
                             f"{self.display}'s limit of {limit:g}:1 (its image processor refuses wider or taller "
                             "images); crop or pad it")  # fmt: skip

    def visual_tokens_fed(self, tokens: ImageTokens, rows: int, kept: torch.Tensor | None = None) -> int:
        """How many visual rows the language model receives for ``rows`` projected rows (see module doc)."""
        return int(rows)

    @property
    @abstractmethod
    def projector(self) -> torch.nn.Module:
        """The multimodal projector M: (n, d_v) -> (n, d_t), applied per token."""

    @abstractmethod
    def encode_image(self, image: Image.Image) -> ImageTokens:
        """Run the processor and the vision tower; return the pre-projector tokens and geometry."""

    def encode_images(self, images: Sequence[Image.Image]) -> list[ImageTokens]:
        """:meth:`encode_image` for several images; per image exactly what it gives alone. Adapters run the
        vision tower once for the whole batch where the backbone allows."""
        return [self.encode_image(image) for image in images]

    @abstractmethod
    def question_embeddings(self, question: str) -> torch.Tensor:
        """(T, d_t) input-embedding rows of the question's non-special tokens (QuestionError if T = 0)."""

    @abstractmethod
    def language_model_logits(
        self, question: str, tokens: ImageTokens, projected: torch.Tensor, kept: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Prefill logits (L, vocab) of the prompt with `projected` (K, d_t) as its only visual tokens.

        ``kept`` (K,) long: the token index of each row, -1 for rows tied to no token; None = tokens 0..K-1.
        """

    @abstractmethod
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
        """Greedy answer of the language model fed `projected` (K, d_t) as its visual tokens (``kept`` as above):
        its text, token ids, how it was decoded and why not from graphs (:class:`~care_core.generation.Generation`).

        ``cuda_graph``: None = replay CUDA graphs over a static KV cache where :meth:`graph_generation_reason`
        allows, else the eager path; True = graphs or GenerationError; False = eager.
        """

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
        """:meth:`generate` for several samples (one question, image, rows and ``kept`` each, K may differ): per
        sample the answer it gets alone, whatever its batch mates. One sample at a time unless an adapter batches."""
        check_batch(questions, tokens, projected, kept)
        return [
            self.generate(q, t, p, max_new_tokens=max_new_tokens, kept=k, cuda_graph=cuda_graph)
            for q, t, p, k in zip(questions, tokens, projected, kept, strict=True)
        ]

    def graph_generation_reason(self, length: int | None = None) -> str | None:
        """Why :meth:`generate` would not replay CUDA graphs here (one line), or None when it would."""
        return f"the {self.family} adapter generates eagerly only"

    def release_decoding_cache(self) -> None:
        """Drop what decoding keeps between calls (a static KV cache and its CUDA graphs), so that the next calls
        hold only the memory they need (a cache sized for all N tokens outlives a switch to K of them). Nothing
        here: this base class keeps no cache."""
        return None

    @abstractmethod
    def probe_inputs(self, tokens: ImageTokens, names: Iterable[str], question: str | None = None) -> dict[str, Any]:
        """Exactly the requested probes (keys of ``care_core.vocabulary.PROBES``) for the image of ``tokens``.

        Vision probes requested together share one vision-tower pass; ``"question"`` needs ``question``
        (QuestionError otherwise); ``"language_model"`` is a ``LanguageModelProbe`` on the prompt with
        ``question`` (a default question when None) and all N visual tokens. Unknown names, and names not
        in :attr:`capabilities`, raise MethodError. The model is left as it was found (no hooks, same
        attention implementation).
        """
