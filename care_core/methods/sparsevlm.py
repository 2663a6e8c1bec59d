"""SparseVLM (Zhang et al., "SparseVLM: Visual Token Sparsification for Efficient VLM Inference", ICML 2025) and
its v2.0 code (SparseVLM+).

Official code: Gumpest/SparseVLMs @ 26a5f48 (main), ``llava/model/language_model/modelling_sparse_llama.py``
(``LlamaDynamicvitModel.forward``, pruning at decoder layers ``pruning_loc = [2, 6, 15]``),
``score.py`` (``attn_postprocess_topk``, ``select_attn_head_by_sum``, per-budget tables) and ``utils.py``
(``cluster_and_merge``). Environment: ``RETAIN_TOKN`` in {192, 128, 96, 64}, ``USE_VERSION`` in {1_0 (default), 2_0}.

Released algorithm:

1. Text raters, once, on the LLM input embeddings: ``M = V T^T`` (visual rows x the text tokens after the image),
   softmax over text, mean over visual; raters = text tokens whose score is above the mean (:func:`text_raters`).
2. At each pruning layer l in {2, 6, 15} the layer runs on all tokens; from its softmax attention
   (v2: the 14 heads with the largest rater->visual attention mass, :func:`select_heads_by_sum`) the relevance of
   visual token j is the head-mean, rater-mean attention onto j (:func:`rater_relevance`); the top ``k_l`` visual
   tokens of the layer's output are kept, ``k_l = min(SCHEDULES[version][budget][stage], n_visual - 1)``.
3. v1 recycling: of the pruned tokens the top 30% (+1) by relevance are clustered by density-peak kNN clustering
   into ``int(n / 10) + 1`` centres, averaged per cluster (:func:`cluster_and_merge`) and inserted after the kept
   visual tokens. v2 does not recycle.

What the registered ``sparsevlm`` method does (our contract reduces the visual tokens *before* the LLM):

* it computes step 1 and the relevance of step 2 at ``layer`` (default 2, the first pruning layer) on the full
  prompt, and keeps exactly ``keep`` visual tokens by that relevance; the selection is fed to the LLM from layer 0.
  The official schedule instead prunes progressively *inside* the LLM (layers 0-1 see all 576 tokens, layers 2-5
  ``k_2``, 6-14 ``k_6``, 15+ ``k_15``); that schedule is exposed as data (:data:`SCHEDULES`, :data:`PRUNING_LAYERS`)
  and the first stage as a pure function (:func:`first_stage_mask`), which the golden check uses;
* recycling (``recycle``, default: as the version does, on for v1, off for v2) keeps ``keep - c`` tokens and adds
  ``c`` recycled cluster rows so that the output still has exactly ``keep`` rows, where ``c`` is the official
  cluster count for the resulting number of pruned tokens (:func:`recycle_split`); when ``keep`` is too small for
  that (no split with at least one kept token) nothing is recycled. The recycled rows average **pre-projector**
  features (the official code averages layer-2 hidden states); their ``token_index`` is the cluster centre's patch;
* v2's "gravity" RoPE correction of the attention is not applied (the probe gives softmax attentions only; the
  golden file does not apply it either); attention and embeddings are used in float32 (the official runs fp16);
* ties in relevance go to the lower token index (one stable descending sort gives the kept tokens and, after them,
  the pruned ones in recycling order; the official ``topk`` leaves ties unspecified).

The raters and relevance do not depend on the budget: they are computed once per image and kept in its memo
(``inputs.memo``), so every budget of a ``care csr`` run reads them. Batches (``SparseVLM.reduce_batch``): each
image's relevance alone (its own probe), then one sort of the relevances padded with -inf, one sort of the kept
indices and one assignment scatter for all images; the recycling clusters run per image (their sizes are
data-dependent) and, like the selection, without host syncs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from care_core._lazy import torch
from care_core.errors import MethodError
from care_core.methods.base import Category, Method, MethodInputs, MethodResult
from care_core.methods.lazy_precision import compute_dtype, matmul_precision
from care_core.methods.registry import register
from care_core.vocabulary import Trait

Version = Literal["1_0", "2_0"]

PRUNING_LAYERS: tuple[int, ...] = (2, 6, 15)
# visual tokens kept at layers 2, 6, 15 for RETAIN_TOKN = budget (score.py), for LLaVA-1.5's N = SCHEDULE_TOKENS;
# the one copy of the schedules: care_core.flops.methods costs SparseVLM from them too
SCHEDULE_TOKENS = 576
SCHEDULES: dict[str, dict[int, tuple[int, int, int]]] = {
    "1_0": {192: (300, 200, 110), 128: (303, 110, 36), 96: (238, 48, 26), 64: (66, 30, 17)},
    "2_0": {192: (300, 200, 118), 128: (238, 108, 60), 96: (246, 54, 28), 64: (66, 34, 20)},
}
V2_HEADS_KEPT = 14  # select_attn_head_by_sum keeps this many heads
RECYCLE_FRACTION = 0.3  # top 30% (+1) of the pruned tokens are recycled (v1)


def text_raters(visual: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    """Rater positions (R,) relative to the text start: text tokens with above-mean ``softmax_t(V T^T)`` mean over V."""
    with matmul_precision(allow_tf32=False):
        scores = (visual @ text.T).softmax(dim=1).mean(dim=0)
    return torch.nonzero(scores > scores.mean()).flatten()


def select_heads_by_sum(block: torch.Tensor, num_heads: int = V2_HEADS_KEPT) -> torch.Tensor:
    """Heads (num_heads,) with the largest total rater->visual attention, in ``topk`` order; `block` is (H, R, N)."""
    sums = block.sum(dim=(1, 2))
    return torch.topk(sums, min(num_heads, block.shape[0])).indices


def rater_relevance(
    attention: torch.Tensor, image_span: tuple[int, int], rater_rows: torch.Tensor, version: Version = "1_0"
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(relevance (N,), heads kept or None): head-mean, rater-mean attention of `rater_rows` onto the image span.

    `attention` is one layer's (H, L, L) softmax attention; `rater_rows` are absolute sequence positions. For
    version ``2_0`` only the :func:`select_heads_by_sum` heads are averaged (as the official loop does).
    """
    start, end = image_span
    block = attention[:, rater_rows, start:end].contiguous()  # (H, R, N)
    heads = None
    if version == "2_0":
        heads = select_heads_by_sum(block)
        block = block[heads]
    return block.mean(dim=0).mean(dim=0), heads


def first_stage_mask(relevance: torch.Tensor, budget: int, version: Version = "1_0", stage: int = 0) -> torch.Tensor:
    """Official keep mask (N,) bool at pruning stage `stage` (0 = layer 2): top ``min(schedule, N - 1)`` tokens."""
    if version not in SCHEDULES or budget not in SCHEDULES[version]:
        raise MethodError(f"sparsevlm has no official schedule for version {version!r}, budget {budget}")
    n = relevance.shape[0]
    count = min(SCHEDULES[version][budget][stage], n - 1)
    mask = torch.zeros(n, dtype=torch.bool, device=relevance.device)
    mask[torch.topk(relevance, count).indices] = True
    return mask


def recycle_count(num_pruned: int) -> tuple[int, int]:
    """(tokens recycled, clusters) for `num_pruned` pruned tokens: ``m = int(0.3 n) + 1``, ``int(m / 10) + 1``."""
    recycled = int(num_pruned * RECYCLE_FRACTION) + 1
    return recycled, int(recycled / 10) + 1


def recycle_split(num_tokens: int, keep: int) -> tuple[int, int]:
    """(kept, clusters) with kept + clusters == keep, the largest kept >= 1 whose official cluster count fits.

    Returns (keep, 0) (no recycling) when no such split exists or nothing would be pruned.
    """
    if keep >= num_tokens:
        return keep, 0
    for kept in range(keep - 1, 0, -1):
        _, clusters = recycle_count(num_tokens - kept)
        if kept + clusters == keep:
            return kept, clusters
    return keep, 0


def cluster_and_merge(
    x: torch.Tensor, cluster_num: int, noise: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SparseVLM's density-peak kNN clustering of `x` (n, C) into `cluster_num` averaged tokens.

    Distances ``|x_i - x_j| / sqrt(C)``; density ``exp(-mean of the squared distances to the cluster_num nearest
    tokens, self included)`` plus `noise` (the official adds ``rand * 1e-6``); each token's distance to the nearest
    token of higher density (the largest distance if none); centres = top ``cluster_num`` of distance x density;
    every token joins its nearest centre (first on ties), centres join themselves; each cluster is the mean of its
    tokens (weights ``1 / (count + 1e-6)`` as released). Returns (merged (cluster_num, C), cluster of each token
    (n,), centres (cluster_num,) in ``topk`` order).
    """
    n, channels = x.shape
    dist = torch.cdist(x, x, compute_mode="donot_use_mm_for_euclid_dist") / (channels**0.5)
    nearest = torch.topk(dist, k=cluster_num, dim=-1, largest=False).values
    density = (-(nearest**2).mean(dim=-1)).exp()
    if noise is not None:
        density = density + noise.to(density)
    higher = density[None, :] > density[:, None]  # higher[i, j]: j is denser than i
    parent_dist = torch.where(higher, dist, dist.max()).min(dim=-1).values
    centres = torch.topk(parent_dist * density, k=cluster_num).indices
    cluster = dist[centres].argmin(dim=0)
    cluster[centres] = torch.arange(cluster_num, device=x.device)
    total = x.new_zeros(cluster_num).index_add_(0, cluster, x.new_ones(n)) + 1e-6
    weight = x.new_ones(n) / total[cluster]  # per-token weight 1 / (count + 1e-6), then a weighted sum
    merged = x.new_zeros(cluster_num, channels).index_add_(0, cluster, x * weight[:, None])
    return merged, cluster, centres


@register
@dataclass(frozen=True)
class SparseVLM(Method):
    """SparseVLM (Zhang et al., ICML 2025): text-rater-guided visual token sparsification, first pruning stage.

    Keeps the ``keep`` visual tokens most attended by the text raters at LLM layer ``layer`` (official first
    pruning layer 2), computed on the full prompt; with recycling (v1 default) ``keep - c`` tokens are kept and ``c``
    density-peak clusters of the best pruned tokens are appended, so the output has exactly ``keep`` rows. See the
    module docstring for how this pre-LLM contract differs from the official in-LLM schedule (layers 2/6/15).
    """

    name: ClassVar[str] = "sparsevlm"
    category: ClassVar[Category] = "merging"
    needs: ClassVar[frozenset[str]] = frozenset({"language_model"})
    requires: ClassVar[frozenset[Trait]] = frozenset({"lm_attention_maps"})  # reads an early layer's attention
    paper: ClassVar[str] = "Zhang et al., SparseVLM: Visual Token Sparsification for Efficient VLM Inference, ICML 2025"
    rank: ClassVar[int] = 13
    cost_model: ClassVar[str | None] = "sparsevlm"
    hyperparameters: ClassVar[frozenset[str]] = frozenset({"seed"})

    version: Version = "1_0"  # official default USE_VERSION; "2_0" = SparseVLM+ head selection, no recycling
    layer: int = 2  # LLM layer whose attention rates the visual tokens (official first pruning layer)
    recycle: bool | None = None  # None: as the version does (v1 recycles, v2 does not)
    noise: float = 1e-6  # density tie-break noise of cluster_and_merge (drawn from a generator seeded with `seed`)
    seed: int | None = None  # seed of that noise; None = inputs.seed

    def attention_layers(self) -> int:
        return self.layer + 1  # layers 0..layer

    def reduce(self, inputs: MethodInputs, keep: int) -> MethodResult:
        return self._select([inputs], [keep], [self._rated(inputs)])[0]

    def reduce_batch(self, inputs: list[MethodInputs], keeps: list[int]) -> list[MethodResult]:
        """Each image's relevance alone (memoised), then :meth:`_select` for all; one image at a time where the
        relevances differ in device or dtype."""
        rated = [self._rated(one) for one in inputs]
        if len(inputs) < 2 or len({(r.relevance.device, r.relevance.dtype) for r in rated}) > 1:
            return super().reduce_batch(inputs, keeps)
        return self._select(inputs, keeps, rated)

    def _select(self, inputs: list[MethodInputs], keeps: list[int], rated: list[Rated]) -> list[MethodResult]:
        """One padded stable sort, one sort of the kept indices and one assignment scatter for the images (of one
        device and dtype); recycling per image (its clusters are data-dependent), without host syncs; the budgets
        and the clustering noise go to the device in one copy each."""
        sizes = [one.num_tokens for one in inputs]
        splits = [self._split(n, keep) for n, keep in zip(sizes, keeps, strict=True)]
        orders, kept, assignment = _batch_selection([r.relevance for r in rated], [c for c, _ in splits])
        drawn = [
            self._noise(one, recycle_count(n - count)[0] if clusters else 0)
            for one, n, (count, clusters) in zip(inputs, sizes, splits, strict=True)
        ]  # one copy to the device for the batch (a pageable copy per image would wait for the device each time)
        noises = torch.cat(drawn).to(orders.device).split([x.numel() for x in drawn])
        return [
            self._result(one, r, orders[i, :n], kept[i, :count], assignment[i, :n], clusters, noises[i])
            for i, (one, r, n, (count, clusters)) in enumerate(zip(inputs, rated, sizes, splits, strict=True))
        ]

    def _noise(self, inputs: MethodInputs, count: int) -> torch.Tensor:
        """The clustering's density tie-break noise for `count` recycled tokens: ``rand * noise`` (CPU, seeded)."""
        g = torch.Generator().manual_seed(inputs.seed if self.seed is None else self.seed)
        return torch.rand(count, generator=g) * self.noise

    def _split(self, num_tokens: int, keep: int) -> tuple[int, int]:
        """(tokens kept by relevance, recycled clusters) for budget `keep`."""
        recycle = self.version == "1_0" if self.recycle is None else self.recycle
        return recycle_split(num_tokens, keep) if recycle else (keep, 0)

    def _rated(self, inputs: MethodInputs) -> Rated:
        """The image's raters and relevance, computed once per image for every budget (kept in its memo)."""
        if self.version not in SCHEDULES:
            raise MethodError(f"sparsevlm: version must be '1_0' or '2_0', got {self.version!r}")
        key = ("sparsevlm-relevance", self.version, self.layer)
        rated: Rated = inputs.memoized(key, lambda: self._relevance(inputs))
        return rated

    def _relevance(self, inputs: MethodInputs) -> Rated:
        """Steps 1 and 2 on the image's language-model probe (see the module docstring)."""
        lm = inputs.probe("language_model", self.name)
        n = inputs.num_tokens
        start, end = lm.image_span
        text_start, text_end = lm.text_span
        if end - start != n:
            raise MethodError(f"sparsevlm: the image span holds {end - start} tokens, the features {n}")
        if text_end <= text_start:
            raise MethodError("sparsevlm: the prompt has no text tokens after the image (no raters)")
        with torch.no_grad():
            embeds = lm.input_embeddings()
            embeds = embeds.to(compute_dtype(embeds.dtype))
            raters = text_raters(embeds[start:end], embeds[text_start:text_end])
            fallback = raters.numel() == 0
            if fallback:  # all text scores equal: every text token rates (the official mean over none is NaN)
                raters = torch.arange(text_end - text_start, device=embeds.device)
            attentions = lm.attentions(self.layer)
            if len(attentions) <= self.layer:
                raise MethodError(f"sparsevlm: the language model has no layer {self.layer}")
            attention = attentions[self.layer]
            attention = attention.to(compute_dtype(attention.dtype))
            relevance, heads = rater_relevance(attention, (start, end), raters + text_start, self.version)
        return Rated(relevance.to(inputs.features.device), raters, fallback, heads)

    def _result(
        self,
        inputs: MethodInputs,
        rated: Rated,
        order: torch.Tensor,
        kept: torch.Tensor,
        assignment: torch.Tensor,
        clusters: int,
        noise: torch.Tensor,
    ) -> MethodResult:
        """The result from the image's relevance order, its kept tokens (ascending), their assignment rows and the
        clustering's noise."""
        features = inputs.features
        kept_count = kept.numel()
        info: dict[str, object] = {
            "raters": rated.raters,
            "raters_fallback": rated.fallback,
            "heads_kept": rated.heads,
            "layer": self.layer,
            "kept": kept,
            "clusters": clusters,
        }
        tokens, token_index = features[kept], kept
        if clusters:
            recycled, _ = recycle_count(inputs.num_tokens - kept_count)
            members = order[kept_count : kept_count + recycled]  # the best pruned, by relevance (ties: lower index)
            x = features[members].to(compute_dtype(features.dtype))
            with torch.no_grad():
                merged, cluster, centres = cluster_and_merge(x, clusters, noise)
            tokens = torch.cat([tokens, merged.to(features.dtype)])
            token_index = torch.cat([kept, members[centres]])
            assignment[members] = kept_count + cluster
            info.update(recycled=members, cluster_of_recycled=cluster, cluster_centres=members[centres])
        return MethodResult(tokens, token_index, rated.relevance, assignment, info=info)


@dataclass(frozen=True)
class Rated:
    """One image's text raters and the relevance they give its visual tokens (budget-independent)."""

    relevance: torch.Tensor  # (N,) on the features' device
    raters: torch.Tensor  # (R,) rater positions relative to the text start
    fallback: bool  # no text score above the mean: every text token rates
    heads: torch.Tensor | None  # v2: the heads averaged


def relevance_order(relevance: torch.Tensor) -> torch.Tensor:
    """(..., N) token indices by descending relevance, ties to the lower index (a stable sort; the official
    ``topk`` leaves ties unspecified): the first K are the K kept, the next ones the best pruned."""
    return torch.sort(relevance, dim=-1, descending=True, stable=True).indices


def _batch_selection(
    relevances: list[torch.Tensor], counts: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(orders (B, max N), kept (B, max count) ascending, assignment (B, max N + 1)) of B images, image i's in
    row i's first N_i / counts[i] / N_i columns: :func:`relevance_order` on the relevances padded with -inf (a
    padded column sorts after every real one, and a stable sort orders a row's real columns as it does alone),
    the first counts[i] of each order sorted ascending, and their ranks scattered into rows of -1."""
    device = relevances[0].device
    b, n_max, count_max = len(relevances), max(r.shape[0] for r in relevances), max(counts)
    padded = torch.full((b, n_max), -torch.inf, dtype=relevances[0].dtype, device=device)
    for i, relevance in enumerate(relevances):
        padded[i, : relevance.shape[0]] = relevance
    orders = relevance_order(padded)
    rank = torch.arange(count_max, device=device)
    within = rank < torch.tensor(counts, device=device)[:, None]
    kept = torch.where(within, orders[:, :count_max], n_max).sort(dim=1).values  # n_max: past the image's count
    assignment = torch.full((b, n_max + 1), -1, dtype=torch.long, device=device)
    assignment.scatter_(1, kept, torch.where(within, rank, -1))  # column n_max: scratch for the padding
    return orders, kept, assignment
