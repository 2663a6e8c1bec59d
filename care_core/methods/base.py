"""The one contract every token-reduction method implements, and what it returns.

A method is a small frozen dataclass (its hyperparameters as fields) with class-level metadata and
one ``reduce(inputs, keep) -> MethodResult``; ``__call__`` checks the budget once for every method
and then calls ``reduce``. Inputs a method needs beyond the features are named in ``needs``;
backbone adapters compute exactly those (see :data:`care_core.vocabulary.PROBES`).

All metadata lives on the class, so that listing (``care methods``), the flops cost models
(``care_core.flops``), the overlays' score labels and the per-backbone method lists read one source.
This module imports no torch at import time (``care methods`` and ``care flops`` start without it).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, final

from care_core._lazy import torch
from care_core.backbones import families
from care_core.backbones.families import BackboneFamily
from care_core.budget import check_keep
from care_core.errors import BudgetError, CareError, MethodError
from care_core.vocabulary import PROBES, TRAIT_NEEDS, Trait

if TYPE_CHECKING:
    from care_core.config import CaReConfig
    from care_core.reduction_graphs import ReductionGraphs
    from care_core.scoring import Scorer

Category = Literal["selection", "merging", "calibration"]
StageTimer = Callable[[str], AbstractContextManager[object]]  # stage name -> context manager (as care.StageTimer)


def backbone_family(family: str) -> BackboneFamily:
    """The registry's record of backbone `family` (its name or a config.json model_type); MethodError if unknown."""
    try:
        return families.backbone_family(family)
    except CareError as exc:
        raise MethodError(str(exc)) from None


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
    # Optional: stage name -> context manager that times it. Per call: give each call its own copy of the inputs,
    # ``method(dataclasses.replace(inputs, stage_timer=clock), keep)`` (the memo stays shared); never rewrite it on
    # inputs that other calls share.
    stage_timer: StageTimer | None = None
    # Optional per-image scratch space, owned by the caller: methods keep what does not depend on the budget
    # (PRCA's psi_bar, ZOO-Prune's sensitivity, the longest greedy order: :func:`memo_orders`) so that several
    # budgets and methods compute it once.
    memo: dict[Hashable, Any] | None = None
    # Optional scoring state for `projector`, owned by the caller across images (a prepared float32 copy, the
    # directions, the second layer's triangular factor on CUDA): PRCA scoring uses it where given.
    scorer: Scorer | None = None
    # Optional hint: the budgets' K the caller will ask for this image, any method (a pipeline's budgets). Greedy
    # orders kept in the memo are computed at the largest of them, so that smaller budgets take a prefix; never
    # required (without it, an order is computed at the K asked, and again at a larger K asked later).
    planned_keeps: tuple[int, ...] = ()
    # Optional CUDA graphs of single-image reductions, owned by the caller (a pipeline keeps one): CaRe replays its
    # fresh, untimed reduction of one image from them on CUDA, filling the memo as the eager path does
    # (care_core.methods.care_family.method_graph_reason); None: every method runs eagerly.
    graphs: ReductionGraphs | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.features.shape[0])

    def order_length(self, keep: int) -> int:
        """How many steps a greedy order for budget ``keep`` runs on this image: with a memo, the largest of
        ``keep`` and :attr:`planned_keeps` (at most N), so that every planned budget reads a prefix; else ``keep``."""
        if self.memo is None:
            return keep
        return max(keep, min(max(self.planned_keeps, default=0), self.num_tokens))

    def memoized(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        """``compute()``, or its earlier value for ``key`` on these same inputs when a memo is kept."""
        if self.memo is None:
            return compute()
        if key not in self.memo:
            self.memo[key] = compute()
        return self.memo[key]

    def probe(self, name: str, method: str) -> Any:
        if name not in self.probes or self.probes[name] is None:
            raise MethodError(f"method {method!r} needs {name!r} ({PROBES.get(name, '?')}), which was not provided")
        return self.probes[name]

    def stage(self, name: str) -> AbstractContextManager[object]:
        """The stage timer's context for `name` ("scoring", "anchors", "calibration"), or a no-op one."""
        return nullcontext() if self.stage_timer is None else self.stage_timer(name)


@dataclass(frozen=True)
class MethodResult:
    """What a method keeps: output tokens, where they sit, and where the other tokens went."""

    tokens: torch.Tensor  # (K_out, d_v) pre-projector tokens, in the order handed to the language model
    token_index: torch.Tensor  # (K_out,) long: patch index of each output row; -1 for rows tied to no patch
    scores: torch.Tensor | None = None  # (N,) the method's per-token scores, where it has them
    assignment: torch.Tensor | None = None  # (N,) long: output row each input token went to, -1 = dropped
    signal_mask: torch.Tensor | None = None  # (N,) bool, calibration methods: the accepted signals R+
    info: dict[str, Any] = field(default_factory=dict)  # method-specific extras (selection order, …)

    @property
    def signals(self) -> torch.Tensor | None:
        """(|R+|,) long, calibration methods: the accepted signals, ascending (a wait for the device: R+ is kept as a
        mask so that the method's tokens are used before anyone lists it)."""
        return None if self.signal_mask is None else torch.nonzero(self.signal_mask).flatten()

    @property
    def indices(self) -> torch.Tensor:
        """(K_p,) ascending, unique patch indices the output keeps or merges into."""
        idx = self.token_index[self.token_index >= 0]
        return torch.unique(idx)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])


class Method:
    """Base of every registered method: metadata on the class, hyperparameters as dataclass fields.

    Subclasses implement :meth:`reduce`; callers call the instance, which checks the budget first.
    """

    name: ClassVar[str]
    category: ClassVar[Category]
    paper: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()
    #: probes (keys of PROBES) the method reads beyond features, projector and positions
    needs: ClassVar[frozenset[str]] = frozenset()
    #: position in listings (`care methods`, `--method all`): CaRe and its ablations first, then the peers
    rank: ClassVar[int] = 1000
    #: CaReConfig fields the method reads when built by ``build_method(name, config)``
    hyperparameters: ClassVar[frozenset[str]] = frozenset()
    #: CaReConfig fields that choose how the method's maths runs (fused or PyTorch kernels), not what it computes
    runtime_options: ClassVar[frozenset[str]] = frozenset()
    #: what the per-token ``scores`` are, for figure labels ("psi_bar" for PRCA); None = generic "scores"
    score_label: ClassVar[str | None] = None
    #: key of the method's cost model in ``care_core.flops.methods`` (None = no cost model)
    cost_model: ClassVar[str | None] = None
    #: what the backbone must offer (traits of ``care_core.vocabulary.TRAITS``: "cls_token", "single_grid",
    #: "lm_attention_maps"); a family serves the method when its record offers them all
    requires: ClassVar[frozenset[Trait]] = frozenset()

    @final
    def __call__(self, inputs: MethodInputs, keep: int) -> MethodResult:
        """Check the budget (care_core.budget's rule: an integer, 1 <= keep <= N), then :meth:`reduce`."""
        try:
            keep = check_keep(keep, inputs.num_tokens)
        except BudgetError as exc:
            raise MethodError(f"{self.name}: the budget K {exc.detail}") from None
        return self.reduce(inputs, int(keep))

    def reduce(self, inputs: MethodInputs, keep: int) -> MethodResult:
        """The method itself, for a budget already checked to be 1 <= keep <= N."""
        raise NotImplementedError

    @final
    def batch(self, inputs: Sequence[MethodInputs], keeps: Sequence[int]) -> list[MethodResult]:
        """The method on several images at once (``keeps[i]`` for image i): per image, what ``self(inputs[i],
        keeps[i])`` gives. Every budget is checked before any work, then :meth:`reduce_batch`."""
        if len(inputs) != len(keeps):
            raise MethodError(f"{self.name}: {len(inputs)} images but {len(keeps)} budgets")
        checked = []
        for i, (one, keep) in enumerate(zip(inputs, keeps, strict=True)):
            try:
                checked.append(int(check_keep(keep, one.num_tokens)))
            except BudgetError as exc:
                raise MethodError(f"{self.name}: image {i}: the budget K {exc.detail}") from None
        return self.reduce_batch(list(inputs), checked)

    def reduce_batch(self, inputs: list[MethodInputs], keeps: list[int]) -> list[MethodResult]:
        """The method on several images, budgets already checked; one image at a time unless a method does better
        (the result per image must be :meth:`reduce`'s)."""
        return [self.reduce(one, keep) for one, keep in zip(inputs, keeps, strict=True)]

    def attention_layers(self) -> int:
        """How many language-model layers' attention maps (layers 0..a-1 of the ``language_model`` probe) the method
        reads: 0 for most; what the batch-size rule counts per sample (care_core.batch_sizes.sample_bytes)."""
        return 0

    def output_count(self, num_tokens: int, keep: int) -> int:
        """Number of output rows for budget `keep`: K unless the method documents otherwise."""
        return keep

    @classmethod
    def serves(cls, family: str) -> bool:
        """Whether the method can run on backbone `family` (e.g. "qwen2.5-vl"): the family offers all it requires."""
        return not backbone_family(family).missing(cls.requires)

    @classmethod
    def why_not_served(cls, family: str) -> str | None:
        """What the method needs that backbone `family` lacks (e.g. "the vision tower's CLS token"), or None."""
        missing = backbone_family(family).missing(cls.requires)
        return " and ".join(TRAIT_NEEDS[trait] for trait in missing) or None

    @classmethod
    def from_config(cls, config: CaReConfig) -> Method:
        """The method at its defaults, with every field named in ``hyperparameters`` taken from `config`."""
        names = {f.name for f in fields(cls)} & set(cls.hyperparameters)  # type: ignore[arg-type]
        return cls(**{name: getattr(config, name) for name in names})


def share_one_pass(inputs: Sequence[MethodInputs]) -> bool:
    """Whether B >= 2 images can share one scoring pass over their tokens: one projector, scorer (made for it, or
    none) and stage timer (each stage is then timed once, on the batch's one timer); floating-point (N, d_v)
    features of one width, device and compute dtype. Otherwise a method's batch goes one image at a time."""
    from care_core.precision import compute_dtype

    first = inputs[0]
    if len(inputs) < 2 or (first.scorer is not None and first.scorer.projector is not first.projector):
        return False
    for one in inputs:
        if one.projector is not first.projector or one.scorer is not first.scorer:
            return False
        if one.stage_timer is not first.stage_timer or one.features.ndim != 2 or not one.features.is_floating_point():
            return False
    kinds = {(v.shape[1], v.device, compute_dtype(v.dtype)) for v in (one.features for one in inputs)}
    return len(kinds) == 1


def memo_orders(
    inputs: Sequence[MethodInputs],
    keeps: Sequence[int],
    keys: Sequence[Hashable],
    compute: Callable[[list[int], list[int]], list[torch.Tensor]],
) -> list[torch.Tensor]:
    """Greedy selection orders of ``keeps[i]`` tokens per image, through the images' memos (docs/design/batches.md
    §Batches), for a greedy whose step t reads only the tokens chosen before it: its order for K is then the
    first K of its order for any larger K, the same numbers from the same operations.

    ``keys[i]``: image i's memo key, naming everything its order depends on besides the image (the greedy's
    weights, rows, eps, tie and mask rules, kernel setting). A memo keeps the longest order computed under the
    key. The images whose memo lacks one of at least ``keeps[i]`` steps (and those without a memo) are computed
    together by one ``compute(images, lengths)`` (the orders of those images, by index, at those lengths), at
    :meth:`MethodInputs.order_length`, and a longer order replaces a shorter one. Each order returned is the
    caller's own tensor of ``keeps[i]`` indices."""
    orders: dict[int, torch.Tensor] = {}
    for i, (one, key, k) in enumerate(zip(inputs, keys, keeps, strict=True)):
        stored = None if one.memo is None else one.memo.get(key)
        if stored is not None and stored.shape[0] >= k:
            orders[i] = stored
    todo = [i for i in range(len(inputs)) if i not in orders]
    if todo:
        computed = compute(todo, [inputs[i].order_length(keeps[i]) for i in todo])
        for i, order in zip(todo, computed, strict=True):
            orders[i] = order
            memo = inputs[i].memo
            if memo is not None:
                memo[keys[i]] = order
    # with a memo, a copy of the prefix: the memo's tensor is never handed out
    pairs = enumerate(zip(inputs, keeps, strict=True))
    return [orders[i] if one.memo is None else orders[i][:k].clone() for i, (one, k) in pairs]


def selection_result(
    features: torch.Tensor, kept: torch.Tensor, scores: torch.Tensor | None = None, **info: Any
) -> MethodResult:
    """Result of a pure selection: kept tokens unchanged, in ascending index order."""
    order = kept.sort().values
    assignment = torch.full((features.shape[0],), -1, dtype=torch.long, device=features.device)
    assignment[order] = torch.arange(order.numel(), device=features.device)
    return MethodResult(features[order], order, scores, assignment, info=info)
