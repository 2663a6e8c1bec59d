"""The one interface every backbone adapter implements.

Adapters are the only code that knows a model family's module paths: methods, the core
maths and the CLI see only :class:`ImageTokens` and :class:`VLMAdapter`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image


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

    @property
    def num_tokens(self) -> int:
        return int(self.features.shape[0])


class VLMAdapter(ABC):
    """A loaded vision-language model seen through the few operations token reduction needs."""

    family: str  # e.g. "llava-1.5"
    name: str  # what the user asked for: a demo name, a folder or a repo id
    is_demo: bool  # True for the embedded random-weight demo backbones
    model: torch.nn.Module
    processor: Any

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    @abstractmethod
    def projector(self) -> torch.nn.Module:
        """The multimodal projector M: (n, d_v) -> (n, d_t), applied per token."""

    @abstractmethod
    def encode_image(self, image: Image.Image) -> ImageTokens:
        """Run the processor and the vision tower; return the pre-projector tokens and geometry."""

    @abstractmethod
    def question_embeddings(self, question: str) -> torch.Tensor:
        """(T, d_t) input-embedding rows of the question's non-special tokens (QuestionError if T = 0)."""

    @abstractmethod
    def language_model_logits(self, question: str, tokens: ImageTokens, projected: torch.Tensor) -> torch.Tensor:
        """Prefill logits (L, vocab) of the prompt with `projected` (K, d_t) as its only visual tokens."""

    @abstractmethod
    def generate(self, question: str, tokens: ImageTokens, projected: torch.Tensor, max_new_tokens: int = 32) -> str:
        """Greedy answer of the language model fed `projected` (K, d_t) as its visual tokens."""

    @abstractmethod
    def probe_inputs(self, tokens: ImageTokens, names: Iterable[str], question: str | None = None) -> dict[str, Any]:
        """Exactly the requested probes (keys of ``care_core.methods.base.PROBES``) for the image of ``tokens``.

        Vision probes requested together share one vision-tower pass; ``"question"`` needs ``question``
        (QuestionError otherwise); ``"language_model"`` is a ``LanguageModelProbe`` on the prompt with
        ``question`` (a default question when None) and all N visual tokens. Unknown names raise
        MethodError. The model is left as it was found (no hooks, same attention implementation).
        """
