"""ToMe (Bolya et al., "Token Merging: Your ViT But Faster", ICLR 2023).

Official code: facebookresearch/ToMe @ af95e4b, ``tome/merge.py::bipartite_soft_matching``, ``merge_wavg``,
``merge_source``. :func:`bipartite_soft_matching` reproduces one official call (paper Sec. 3, "bipartite soft
matching"):

* the metric rows are L2-normalised; tokens at even positions form set A, odd positions set B;
* every A token's best cosine match in B (``max``, first on ties); with ``class_token=True`` row 0 of A can't merge;
* A is sorted by that best similarity, descending; the first ``r`` A tokens merge into their B match, the rest
  stay (``r`` is capped at ``(T - protected) // 2``);
* output rows = ``[unmerged A (ascending when class_token, else in the sorted-similarity order)] ++ [B]``;
* ``merge(x, mode)`` scatter-reduces the merged A rows into their B rows (``sum`` / ``mean`` incl. the B row /
  ``amax``); ``merge_wavg`` is the size-weighted mean (``merge(x * size, "sum") / merge(size, "sum")``) and
  ``merge_source`` tracks which inputs every row holds; ``unmerge`` copies each output row back to its inputs.

In ToMe the merging runs inside every ViT block (keys averaged over heads as the metric, proportional attention)
with a constant ``r`` per block; there is no official recipe for a VLM token budget. The registered method ``tome``
applies ToMe's constant schedule to the pre-projector features: ``calls`` matching calls (default 23, one per
block of CLIP-L/14 up to LLaVA's feature layer) of ``r = ceil((N - keep) / calls)`` each (the last smaller, every
one capped at ``n // 2``; further calls if the cap binds, :func:`tome_schedule`), ``metric = current tokens``,
``class_token=False``, size-weighted average carrying the sizes. So ``keep`` rows come out. The golden
``tome_chain_*`` harness chain (:func:`tome_chain` without ``r``: ``r = min(n - keep, n // 2)``) is not used for
the method: each of its calls merges all of set A whenever ``n - keep >= n // 2``, so which tokens survive does
not depend on the features at all (576 -> 64 keeps exactly the tokens at index 7 mod 8 on every image).

Each output row's ``token_index`` is the patch that occupies it (the unmerged A token or the B token everything
merged into), ``assignment`` is the row every input ended in (``merge_source``). Deviations: zero metric rows (NaN
in the official normalisation) use a clamped norm (cosine 0 to everything); the descending sort is stable, so ties
between equal similarities are broken by position (the official ``argsort`` does not specify it).

Batches (:func:`tome_chain_batch`, ``ToMe.reduce_batch``): the calls of B images run in one loop, padded to the
largest N, each image with its own schedule (r and the number of calls are known before the loop, so the loop
never waits on the device); per image the same products, sort and summation order as :func:`tome_chain`.
Budgets: ToMe's r differs per budget, so two budgets of an image share no call; with a memo, an image's first call
computes the chains of all its planned budgets in that one loop and its memo holds the others until their own
call takes them (a resumed run's plan may leave some untaken: computed for nothing, never wrong).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

from care_core._lazy import torch
from care_core.errors import MethodError
from care_core.methods.base import Category, Method, MethodInputs, MethodResult
from care_core.methods.lazy_precision import compute_dtype, matmul_precision
from care_core.methods.registry import register

_EPS = 1e-12  # clamps zero metric norms only

Mode = Literal["sum", "mean", "amax"]


@dataclass(frozen=True)
class BipartiteMatch:
    """One bipartite soft matching of T tokens: which A rows stay, which merge, and into which B rows."""

    num_tokens: int
    unmerged: torch.Tensor  # (|A| - r,) A-set positions kept, in output order
    sources: torch.Tensor  # (r,) A-set positions merged away
    destinations: torch.Tensor  # (r,) B-set position each source merges into

    @property
    def r(self) -> int:
        return int(self.sources.numel())

    @property
    def num_out(self) -> int:
        return self.num_tokens - self.r

    def merge(self, x: torch.Tensor, mode: Mode = "mean") -> torch.Tensor:
        """(T, c) -> (T - r, c): [unmerged A rows] ++ [B rows with their sources reduced in by `mode`]."""
        if self.r == 0:
            return x
        a, b = x[0::2], x[1::2]
        index = self.destinations[:, None].expand(-1, x.shape[1])
        b = b.scatter_reduce(0, index, a[self.sources], reduce=mode)  # include_self: the B row takes part
        return torch.cat([a[self.unmerged], b])

    def unmerge(self, y: torch.Tensor) -> torch.Tensor:
        """(T - r, c) -> (T, c): every input position gets the row it was merged into."""
        if self.r == 0:
            return y
        kept = self.unmerged.numel()
        b = y[kept:]
        out = torch.zeros(self.num_tokens, y.shape[1], dtype=y.dtype, device=y.device)
        out[1::2] = b
        out[2 * self.unmerged] = y[:kept]
        out[2 * self.sources] = b[self.destinations]
        return out

    def row_of_input(self) -> torch.Tensor:
        """(T,) output row of every input token."""
        rows = torch.arange(self.num_tokens, device=self.sources.device)
        if self.r == 0:
            return rows
        kept = self.unmerged.numel()
        n_b = self.num_tokens // 2
        rows[1::2] = kept + torch.arange(n_b, device=rows.device)
        rows[2 * self.unmerged] = torch.arange(kept, device=rows.device)
        rows[2 * self.sources] = kept + self.destinations
        return rows

    def occupant(self) -> torch.Tensor:
        """(T - r,) input position that occupies every output row (unmerged A token or B token)."""
        if self.r == 0:
            return torch.arange(self.num_tokens, device=self.sources.device)
        b_pos = torch.arange(1, self.num_tokens, 2, device=self.sources.device)
        return torch.cat([2 * self.unmerged, b_pos])


def bipartite_soft_matching(metric: torch.Tensor, r: int, class_token: bool = False) -> BipartiteMatch:
    """One official ToMe matching on `metric` (T, c): merge up to `r` A tokens (capped at (T - protected) // 2)."""
    t = metric.shape[0]
    protected = int(class_token)
    r = min(r, (t - protected) // 2)
    device = metric.device
    if r <= 0:
        idx = torch.arange((t + 1) // 2, device=device)
        empty = torch.empty(0, dtype=torch.long, device=device)
        return BipartiteMatch(t, idx, empty, empty)
    m = metric.to(compute_dtype(metric.dtype))
    m = m / m.norm(dim=-1, keepdim=True).clamp_min(_EPS)
    with matmul_precision(allow_tf32=False):
        similarity = m[0::2] @ m[1::2].t()  # (|A|, |B|) cosine
    if class_token:
        similarity[0, :] = -torch.inf
    best, match = similarity.max(dim=1)
    order = torch.sort(best, descending=True, stable=True).indices
    unmerged, sources = order[r:], order[:r]
    if class_token:
        unmerged = unmerged.sort().values  # keeps the class token first
    return BipartiteMatch(t, unmerged, sources, match[sources])


def merge_wavg(match: BipartiteMatch, x: torch.Tensor, size: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Size-weighted average merge: (merged x (T - r, c), new sizes (T - r, 1))."""
    if size is None:
        size = torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)
    total = match.merge(x * size, mode="sum")
    size = match.merge(size, mode="sum")
    return total / size, size


@dataclass(frozen=True)
class ToMeChain:
    """Result of :func:`tome_chain`: merged tokens and where every input went."""

    tokens: torch.Tensor  # (K, d)
    size: torch.Tensor  # (K,) inputs per row
    group: torch.Tensor  # (N,) output row of every input
    occupant: torch.Tensor  # (K,) input index occupying every row
    steps: tuple[int, ...]  # token counts after every call, starting with N


def tome_schedule(num_tokens: int, keep: int, r: int | None = None) -> list[int]:
    """r of every matching call from `num_tokens` down to `keep`: ``min(r, n - keep, n // 2)`` per call.

    ``r = None`` is the harness chain's unbounded r (``min(n - keep, n // 2)``). Pure Python (flops uses it).
    """
    steps: list[int] = []
    current = num_tokens
    while current > keep:
        step = min(current - keep, current // 2)
        if r is not None:
            step = min(step, r)
        if step < 1:
            raise MethodError(f"tome: cannot merge {current} tokens down to {keep} with r = {r}")
        steps.append(step)
        current -= step
    return steps


def tome_chain(x: torch.Tensor, keep: int, r: int | None = None) -> ToMeChain:
    """Repeated official calls (metric = current tokens, class_token=False, size-weighted) until `keep` rows, with
    the r of :func:`tome_schedule`; ``r=None`` is the golden harness chain."""
    n = x.shape[0]
    if not 1 <= keep <= n:
        raise MethodError(f"tome: keep must be between 1 and N = {n}, got {keep}")
    size = None
    group = torch.arange(n, device=x.device)
    occupant = torch.arange(n, device=x.device)
    steps = [n]
    for step in tome_schedule(n, keep, r):
        match = bipartite_soft_matching(x, step, class_token=False)
        x, size = merge_wavg(match, x, size)
        group = match.row_of_input()[group]
        occupant = occupant[match.occupant()]
        steps.append(x.shape[0])
    if size is None:
        size = torch.ones(n, 1, dtype=x.dtype, device=x.device)
    return ToMeChain(x, size[:, 0], group, occupant, tuple(steps))


@dataclass(frozen=True)
class _Round:
    """One matching call for B images padded to T rows: the host-known sizes and their device copies."""

    counts: list[int]  # tokens per image before the call
    r: list[int]  # tokens each image merges (0 = the image is done)
    counts_t: torch.Tensor  # (B,) long: `counts` on the device
    r_t: torch.Tensor  # (B,) long: `r` on the device


def _batch_similarity(x: torch.Tensor, rnd: _Round) -> tuple[torch.Tensor, torch.Tensor]:
    """(best cosine (B, |A|), its B position (B, |A|)) of every A row; -inf on padded and finished images' rows.

    Each image's product is :func:`bipartite_soft_matching`'s on its own rows (one ``mm`` per image: a batched
    product may round differently, and the sort below turns rounding into a different merge order). Padded B
    columns are -inf, so they are never a match and ``max`` takes the first real best as for one image.
    """
    b, t = x.shape[0], x.shape[1]
    m = x / x.norm(dim=-1, keepdim=True).clamp_min(_EPS)
    similarity = torch.full((b, (t + 1) // 2, t // 2), -torch.inf, dtype=x.dtype, device=x.device)
    with matmul_precision(allow_tf32=False):
        for i, (n, r) in enumerate(zip(rnd.counts, rnd.r, strict=True)):
            if r > 0:
                one = m[i, :n]
                similarity[i, : (n + 1) // 2, : n // 2] = one[0::2] @ one[1::2].t()
    return similarity.max(dim=2)


def _batch_sources(order: torch.Tensor, rnd: _Round, t_out: int) -> torch.Tensor:
    """(B, t_out) current row of every output row, -1 on padding.

    Output rows per image: [unmerged A in sorted order] ++ [B], as :meth:`BipartiteMatch.occupant`; a finished
    image keeps its rows in place.
    """
    ta = order.shape[1]
    device = order.device
    r, a_count, b_count = rnd.r_t[:, None], (rnd.counts_t[:, None] + 1) // 2, rnd.counts_t[:, None] // 2
    unmerged = a_count - r
    j = torch.arange(t_out, device=device)[None, :]
    from_a = 2 * order.gather(1, (r + j).clamp_max(ta - 1))
    from_b = 2 * (j - unmerged) + 1
    current = torch.where(j < unmerged, from_a, torch.where(j < unmerged + b_count, from_b, -1))
    done = rnd.r_t[:, None] == 0
    return torch.where(done, torch.where(j < rnd.counts_t[:, None], j, -1), current)


def _batch_row_of_input(order: torch.Tensor, match: torch.Tensor, rnd: _Round, t: int) -> torch.Tensor:
    """(B, T) output row of every current row (:meth:`BipartiteMatch.row_of_input` per image; identity when done)."""
    b, ta = order.shape
    device = order.device
    r = rnd.r_t[:, None]
    unmerged = (rnd.counts_t[:, None] + 1) // 2 - r
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(ta, device=device).expand(b, ta))
    rows = torch.empty(b, t, dtype=torch.long, device=device)
    rows[:, 0::2] = torch.where(rank < r, unmerged + match, rank - r)
    rows[:, 1::2] = unmerged + torch.arange(t // 2, device=device)
    return torch.where(r == 0, torch.arange(t, device=device), rows)


def _batch_merge_sum(x: torch.Tensor, order: torch.Tensor, match: torch.Tensor, rnd: _Round) -> torch.Tensor:
    """(B, T, c) -> (B, |A| + |B| + 1, c): [A rows] ++ [B rows with their sources summed in] ++ [a zero row].

    :meth:`BipartiteMatch.merge` with ``"sum"`` for every image at once: the sources of all images in one
    ``scatter_reduce`` over the flattened B rows, each image's sources in its own order (a row's sum is
    accumulated in the same order as for one image); an unused source slot goes to a scratch row.
    """
    b, t, c = x.shape
    tb = t // 2
    r_max = max(rnd.r)
    a_rows, b_rows = x[:, 0::2], x[:, 1::2]
    sources = order[:, :r_max]
    slot = torch.arange(r_max, device=x.device)[None, :]
    image = torch.arange(b, device=x.device)[:, None]
    flat = torch.where(slot < rnd.r_t[:, None], image * tb + match.gather(1, sources), b * tb).reshape(-1)
    values = a_rows.gather(1, sources[..., None].expand(-1, -1, c)).reshape(-1, c)
    target = torch.cat([b_rows.reshape(b * tb, c), x.new_zeros(1, c)])
    merged = target.scatter_reduce(0, flat[:, None].expand(-1, c), values, reduce="sum")[: b * tb]
    return torch.cat([a_rows, merged.view(b, tb, c), x.new_zeros(b, 1, c)], dim=1)


def _batch_call(
    x: torch.Tensor, size: torch.Tensor, rnd: _Round
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One :func:`bipartite_soft_matching` + :func:`merge_wavg` for B padded images: (x, size, current row of every
    output row, output row of every current row); finished images (r = 0) keep their rows."""
    t = x.shape[1]
    t_out = max(n - r for n, r in zip(rnd.counts, rnd.r, strict=True))
    best, match = _batch_similarity(x, rnd)
    order = torch.sort(best, dim=1, descending=True, stable=True).indices  # padded rows (-inf) sort last
    current = _batch_sources(order, rnd, t_out)
    layout = torch.where(current % 2 == 0, current // 2, (t + 1) // 2 + current // 2)  # [A] ++ [B] ++ [zero]
    layout = torch.where(current < 0, (t + 1) // 2 + t // 2, layout)[..., None]
    total = _batch_merge_sum(x * size, order, match, rnd).gather(1, layout.expand(-1, -1, x.shape[2]))
    new_size = _batch_merge_sum(size, order, match, rnd).gather(1, layout)
    new_size = torch.where(current[..., None] < 0, 1.0, new_size)  # padding: 0 / 1
    done = (rnd.r_t == 0)[:, None, None]
    x_out = torch.where(done, x[:, :t_out], total / new_size)
    size_out = torch.where(done, size[:, :t_out], new_size)
    return x_out, size_out, current, _batch_row_of_input(order, match, rnd, t)


def tome_chain_batch(xs: Sequence[torch.Tensor], keeps: Sequence[int], rs: Sequence[int]) -> list[ToMeChain]:
    """:func:`tome_chain` for B images (one device, dtype and width) in one loop of matching calls, no host sync.

    The images are padded to the largest N with zero rows; call j merges ``tome_schedule(N_i, keep_i, r_i)[j]``
    tokens of image i (0 once it is done). Per image the same numbers as :func:`tome_chain`: its own cosine
    product, padded rows and columns at -inf (never matched, sorted after every real row, never a source), the
    same stable descending sort (ties to the lower A position) and the same summation order in the merge.
    """
    sizes = [int(x.shape[0]) for x in xs]
    schedules = [tome_schedule(n, k, r) for n, k, r in zip(sizes, keeps, rs, strict=True)]
    calls = max(len(s) for s in schedules)
    steps = [[s[j] if j < len(s) else 0 for s in schedules] for j in range(calls)]
    counts = [sizes]
    for step in steps:
        counts.append([n - r for n, r in zip(counts[-1], step, strict=True)])
    like = xs[0]
    table = torch.tensor([counts[:-1], steps], dtype=torch.long).to(like.device)  # (2, calls, B): one copy
    b, n_max = len(xs), max(sizes)
    x = like.new_zeros(b, n_max, like.shape[1])
    for i, one in enumerate(xs):
        x[i, : sizes[i]] = one
    size = like.new_ones(b, n_max, 1)
    inputs = torch.arange(n_max, device=like.device).expand(b, n_max)
    occupant = inputs.clone()
    group = torch.where(inputs < torch.tensor(sizes, device=like.device)[:, None], inputs, 0)  # padding follows row 0
    for j in range(calls):
        rnd = _Round(counts[j], steps[j], table[0, j], table[1, j])
        x, size, current, rows = _batch_call(x, size, rnd)
        occupant = occupant.gather(1, current.clamp_min(0))
        group = rows.gather(1, group)
    return [
        ToMeChain(x[i, :k], size[i, :k, 0], group[i, :n], occupant[i, :k], tuple(c[i] for c in counts[: len(s) + 1]))
        for i, (n, k, s) in enumerate(zip(sizes, keeps, schedules, strict=True))
    ]


@register
@dataclass(frozen=True)
class ToMe(Method):
    """ToMe (Bolya et al., ICLR 2023): bipartite soft matching with a constant r per call until ``keep`` tokens.

    ``calls`` calls of ``r = ceil((N - keep) / calls)`` (ToMe's constant schedule, one call per ViT block; no
    official VLM recipe), metric = current tokens, no protected class token, size-weighted average. Rows come out
    in ToMe's order ([unmerged A] ++ [B]).
    """

    name: ClassVar[str] = "tome"
    category: ClassVar[Category] = "merging"
    paper: ClassVar[str] = "Bolya et al., Token Merging: Your ViT But Faster, ICLR 2023"
    rank: ClassVar[int] = 10
    cost_model: ClassVar[str | None] = "tome"

    calls: int = 23  # matching calls (ToMe merges once per ViT block; CLIP-L/14 blocks 1..23 feed LLaVA)

    def r_per_call(self, num_tokens: int, keep: int) -> int:
        """ToMe's constant r: ``ceil((N - keep) / calls)`` (at least 1)."""
        if self.calls < 1:
            raise MethodError(f"tome: calls must be >= 1, got {self.calls}")
        return max(1, -(-(num_tokens - keep) // self.calls))

    def reduce(self, inputs: MethodInputs, keep: int) -> MethodResult:
        return self.reduce_batch([inputs], [keep])[0]

    def reduce_batch(self, inputs: list[MethodInputs], keeps: list[int]) -> list[MethodResult]:
        """Every image's chain for its budget and, where it keeps a memo, for its other planned budgets
        (``planned_keeps``) in the same loop of matching calls (:func:`tome_chain_batch`); those wait in the memo
        for their own call (each chain is the one its budget gets alone: the budgets share no step, r differs).
        One chain at a time where the features differ in device, dtype or width."""
        jobs, found = self._jobs(inputs, keeps)
        if jobs:
            xs = [inputs[i].features.to(compute_dtype(inputs[i].features.dtype)) for i, _ in jobs]
            ks = [k for _, k in jobs]
            with torch.no_grad():
                if len(jobs) == 1 or len({(x.device, x.dtype, x.shape[1]) for x in xs}) > 1:
                    chains = [tome_chain(x, k, self.r_per_call(x.shape[0], k)) for x, k in zip(xs, ks, strict=True)]
                else:
                    rs = [self.r_per_call(x.shape[0], k) for x, k in zip(xs, ks, strict=True)]
                    chains = tome_chain_batch(xs, ks, rs)
            for (i, k), chain in zip(jobs, chains, strict=True):
                found[(i, k)] = chain
                memo = inputs[i].memo
                if memo is not None and k != keeps[i]:  # another budget's, for its own call
                    memo[self._memo_key(inputs[i], k)] = chain
        results = []
        for i, (one, keep) in enumerate(zip(inputs, keeps, strict=True)):
            chain = found[(i, keep)]
            if one.memo is not None:  # handed out once: the memo keeps no tensor a caller holds
                one.memo.pop(self._memo_key(one, keep), None)
            results.append(_result(chain, one.features.dtype))
        return results

    def _memo_key(self, one: MethodInputs, keep: int) -> tuple[object, ...]:
        """What an image's chain for ``keep`` depends on besides the image: r (from ``calls``), the compute dtype."""
        return (self.name, "chain", self.calls, keep, compute_dtype(one.features.dtype))

    def _jobs(
        self, inputs: list[MethodInputs], keeps: list[int]
    ) -> tuple[list[tuple[int, int]], dict[tuple[int, int], ToMeChain]]:
        """(the (image, budget) chains to compute, those an image's memo holds already): each image's ``keep``, plus
        its other planned budgets (1 <= K <= N) where it keeps a memo."""
        jobs: list[tuple[int, int]] = []
        found: dict[tuple[int, int], ToMeChain] = {}
        for i, (one, keep) in enumerate(zip(inputs, keeps, strict=True)):
            memo = one.memo
            if memo is None:
                jobs.append((i, keep))
            elif (held := memo.get(self._memo_key(one, keep))) is not None:
                found[(i, keep)] = held
            else:
                planned = {k for k in one.planned_keeps if 1 <= k <= one.num_tokens and k != keep}
                others = sorted((k for k in planned if self._memo_key(one, k) not in memo), reverse=True)
                jobs += [(i, k) for k in (keep, *others)]
        return jobs, found


def _result(chain: ToMeChain, dtype: torch.dtype) -> MethodResult:
    """The method's result from a chain: rows in ToMe's order, each row's occupant, the row every input went to."""
    return MethodResult(
        tokens=chain.tokens.to(dtype),
        token_index=chain.occupant,
        assignment=chain.group,
        info={"size": chain.size, "steps": chain.steps},
    )
