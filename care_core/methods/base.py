"""The one contract every token-reduction method implements, and what it returns.

A method is a small frozen dataclass (its hyperparameters as fields) with class-level metadata and
one ``__call__(inputs, keep) -> MethodResult``. Inputs a method needs beyond the features are named
in ``needs``; backbone adapters compute exactly those (see :data:`PROBES`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol

import torch

Category = Literal["selection", "merging", "calibration"]

# Named inputs a method may need, beyond features, projector and positions.
PROBES: dict[str, str] = {
    "cls_attention": "(H, 1+N) softmax attention of the CLS query over [CLS, patches] at the feature layer",
    "attention_logits": "(1+N, 1+N) head-mean pre-softmax attention logits at the feature layer",
    "keys": "(1+N, d_head) head-mean attention keys at the feature layer (row 0 = CLS)",
    "hidden_with_cls": "(1+N, d_v) feature-layer hidden states including the CLS row",
    "last_layer_qk": "(2, 1+N, d_v) q_proj / k_proj outputs of the vision tower's last layer",
    "question": "(T, d_t) input embeddings of the question's non-special tokens",
    "language_model": "a handle that runs the language model's first layers on the full sequence",
}


class LanguageModelProbe(Protocol):
    """Runs the language model's first layers on [prompt with all N visual tokens]."""

    def attentions(self, upto_layer: int) -> list[torch.Tensor]:
        """Softmax attentions (H, L, L) of layers 0..upto_layer on the full prompt."""
        ...

    @property
    def image_span(self) -> tuple[int, int]:
        """[start, end) of the N visual tokens in the prompt."""
        ...

    @property
    def text_span(self) -> tuple[int, int]:
        """[start, end) of the text tokens after the image (the question and the prompt's end)."""
        ...

    def input_embeddings(self) -> torch.Tensor:
        """(L, d_t) input embeddings of the full prompt."""
        ...


@dataclass
class MethodInputs:
    """Everything a method may look at for one image (only `features`, `projector`, `positions` always)."""

    features: torch.Tensor  # (N, d_v) pre-projector visual tokens V
    projector: Callable[[torch.Tensor], torch.Tensor]  # M: (n, d_v) -> (n, d_t)
    positions: torch.Tensor  # (N, 2) normalised (row, col) centres
    grid: tuple[int, int] | None = None  # (rows, cols) when the tokens are one raster grid
    probes: dict[str, Any] = field(default_factory=dict)  # keys of PROBES
    seed: int = 0

    @property
    def num_tokens(self) -> int:
        return int(self.features.shape[0])

    def probe(self, name: str, method: str) -> Any:
        from care_core.errors import MethodError

        if name not in self.probes or self.probes[name] is None:
            raise MethodError(f"method {method!r} needs {name!r} ({PROBES.get(name, '?')}), which was not provided")
        return self.probes[name]


@dataclass(frozen=True)
class MethodResult:
    """What a method keeps: output tokens, where they sit, and where the other tokens went."""

    tokens: torch.Tensor  # (K_out, d_v) pre-projector tokens, in the order handed to the language model
    token_index: torch.Tensor  # (K_out,) long: patch index of each output row; -1 for rows tied to no patch
    scores: torch.Tensor | None = None  # (N,) the method's per-token scores, where it has them
    assignment: torch.Tensor | None = None  # (N,) long: output row each input token went to, -1 = dropped
    signals: torch.Tensor | None = None  # (|R+|,) calibration methods: accepted signals, ascending
    info: dict[str, Any] = field(default_factory=dict)  # method-specific extras (selection order, …)

    @property
    def indices(self) -> torch.Tensor:
        """(K_p,) ascending, unique patch indices the output keeps or merges into."""
        idx = self.token_index[self.token_index >= 0]
        return torch.unique(idx)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])


class Method:
    """Base of every registered method: metadata on the class, hyperparameters as dataclass fields."""

    name: ClassVar[str]
    category: ClassVar[Category]
    needs: ClassVar[frozenset[str]] = frozenset()
    paper: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()

    def __call__(self, inputs: MethodInputs, keep: int) -> MethodResult:
        raise NotImplementedError

    def output_count(self, num_tokens: int, keep: int) -> int:
        """Number of output rows for budget `keep`: K unless the method documents otherwise."""
        return keep


def selection_result(
    features: torch.Tensor, kept: torch.Tensor, scores: torch.Tensor | None = None, **info: Any
) -> MethodResult:
    """Result of a pure selection: kept tokens unchanged, in ascending index order."""
    order = kept.sort().values
    assignment = torch.full((features.shape[0],), -1, dtype=torch.long, device=features.device)
    assignment[order] = torch.arange(order.numel(), device=features.device)
    return MethodResult(features[order], order, scores, assignment, info=info)
