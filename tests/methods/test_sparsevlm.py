"""SparseVLM: text raters, rater relevance, v2 head selection, the official schedule, recycling, golden files."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest
import torch

from care_core.errors import MethodError
from care_core.methods import MethodInputs, MethodResult, build_method
from care_core.methods.sparsevlm import (
    PRUNING_LAYERS,
    SCHEDULES,
    cluster_and_merge,
    first_stage_mask,
    rater_relevance,
    recycle_count,
    recycle_split,
    select_heads_by_sum,
    text_raters,
)

from .conftest import GOLDEN_FILES, assert_golden_passes, make_inputs


@dataclass
class ScriptedLM:
    """Language-model probe with given layer attentions and input embeddings."""

    layers: list[torch.Tensor]
    embeds: torch.Tensor
    image: tuple[int, int]
    text: tuple[int, int]
    calls: list[int] = field(default_factory=list)

    def attentions(self, upto_layer: int) -> list[torch.Tensor]:
        self.calls.append(upto_layer)
        return self.layers[: upto_layer + 1]

    @property
    def image_span(self) -> tuple[int, int]:
        return self.image

    @property
    def text_span(self) -> tuple[int, int]:
        return self.text

    def input_embeddings(self) -> torch.Tensor:
        return self.embeds


def test_text_raters_by_hand() -> None:
    visual = torch.tensor([[1.0, 0.0]])
    text = torch.tensor([[2.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    # softmax([2, 0, 0]) = [0.787, 0.107, 0.107]; mean 1/3 -> only text token 0 rates
    assert text_raters(visual, text).tolist() == [0]
    visual = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    text = torch.tensor([[3.0, 0.0], [0.0, 3.0], [0.0, 0.0]])
    assert text_raters(visual, text).tolist() == [0, 1]


def test_rater_relevance_is_head_mean_rater_mean() -> None:
    attention = torch.zeros(2, 6, 6)
    # image = positions 1..3, raters = rows 4 and 5
    attention[0, 4, 1:4] = torch.tensor([0.2, 0.4, 0.0])
    attention[1, 4, 1:4] = torch.tensor([0.0, 0.2, 0.2])
    attention[0, 5, 1:4] = torch.tensor([0.6, 0.0, 0.0])
    attention[1, 5, 1:4] = torch.tensor([0.2, 0.0, 0.2])
    relevance, heads = rater_relevance(attention, (1, 4), torch.tensor([4, 5]))
    # head means: row 4 [0.1, 0.3, 0.1], row 5 [0.4, 0.0, 0.1] -> rater mean [0.25, 0.15, 0.1]
    assert relevance.tolist() == pytest.approx([0.25, 0.15, 0.1])
    assert heads is None


def test_v2_keeps_the_14_heads_with_most_rater_to_visual_mass() -> None:
    block = torch.zeros(16, 2, 3)
    for h in range(16):
        block[h] = (h + 1) / 100
    block[3] = 5.0  # largest
    heads = select_heads_by_sum(block)
    assert heads.numel() == 14 and heads[0].item() == 3
    assert set(range(16)) - set(heads.tolist()) == {0, 1}
    attention = torch.zeros(16, 6, 6)
    attention[:, 4:6, 1:4] = block
    attention[0, 4:6, 1:4] = torch.tensor([0.03, 0.0, 0.0])  # head 0 (dropped) moves its small mass to token 0
    v1, _ = rater_relevance(attention, (1, 4), torch.tensor([4, 5]), "1_0")
    v2, kept = rater_relevance(attention, (1, 4), torch.tensor([4, 5]), "2_0")
    assert torch.equal(kept, heads)
    assert v1.tolist() == pytest.approx(attention[:, 4:6, 1:4].mean(dim=(0, 1)).tolist())
    assert v2.tolist() == pytest.approx(block[kept].mean(dim=(0, 1)).tolist())
    assert v1[0] > v1[1] and v2[0] == pytest.approx(v2[1])


def test_schedule_data_and_first_stage_counts() -> None:
    assert PRUNING_LAYERS == (2, 6, 15)
    assert SCHEDULES["1_0"][192] == (300, 200, 110) and SCHEDULES["2_0"][128] == (238, 108, 60)
    relevance = torch.arange(576, dtype=torch.float32)
    mask = first_stage_mask(relevance, 64, "1_0")
    assert mask.sum().item() == 66 and mask[-66:].all()
    small = torch.arange(100, dtype=torch.float32)
    assert first_stage_mask(small, 192, "1_0").sum().item() == 99  # capped at n_visual - 1
    with pytest.raises(MethodError):
        first_stage_mask(small, 100, "1_0")


def test_recycle_counts_match_the_official_example() -> None:
    # README: 276 pruned at layer 2 (RETAIN_TOKN = 192) -> 83 recycled -> 9 clusters
    assert recycle_count(276) == (83, 9)
    # keep = 192 of 576: 180 kept + 12 clusters (396 pruned -> 119 recycled -> 12); 181 would give 193
    assert recycle_split(576, 192) == (180, 12)
    for keep in range(1, 577):
        kept, clusters = recycle_split(576, keep)
        assert kept + clusters == keep
        if clusters:
            assert kept >= 1 and recycle_count(576 - kept)[1] == clusters
    assert recycle_split(144, 1) == (1, 0)  # too small to hold a cluster: no recycling


def test_cluster_and_merge_two_obvious_groups() -> None:
    x = torch.tensor([[0.0, 0.0], [0.1, 0.0], [0.0, 0.1], [10.0, 10.0], [10.2, 10.0]])
    # mutual nearest neighbours have equal densities: the official rand * 1e-6 noise breaks the tie
    merged, cluster, centres = cluster_and_merge(x, 2, noise=torch.arange(5) * 1e-6)
    assert cluster[:3].unique().numel() == 1 and cluster[3:].unique().numel() == 1 and cluster[0] != cluster[3]
    means = {tuple(round(v, 4) for v in x[:3].mean(0).tolist()), tuple(round(v, 4) for v in x[3:].mean(0).tolist())}
    assert {tuple(round(v, 4) for v in row) for row in merged.tolist()} == means
    assert cluster[centres].tolist() == [0, 1]


def _scripted(n: int = 8, favourite: tuple[int, ...] = (6, 1, 3)) -> tuple[MethodInputs, ScriptedLM]:
    prefix, text = 2, 3
    length = prefix + n + text
    layers = [torch.full((2, length, length), 1.0 / length) for _ in range(3)]
    for rank, j in enumerate(favourite):  # layer 2: every text row attends most to `favourite`, in that order
        layers[2][:, prefix + n :, prefix + j] = 0.5 / (rank + 1)
    embeds = torch.zeros(length, 4)
    embeds[prefix + n :, 0] = torch.tensor([1.0, 0.0, 0.0])  # text token 0 is the only rater
    embeds[prefix : prefix + n, 0] = 1.0
    lm = ScriptedLM(layers, embeds, (prefix, prefix + n), (prefix + n, length))
    features = torch.randn(n, 5, generator=torch.Generator().manual_seed(1))
    inputs = MethodInputs(features, lambda v: v, torch.zeros(n, 2), probes={"language_model": lm})
    return inputs, lm


def test_method_keeps_the_most_rated_tokens_from_layer_2() -> None:
    inputs, lm = _scripted()
    result = build_method("sparsevlm", recycle=False)(inputs, 3)
    assert lm.calls == [2]
    assert result.token_index.tolist() == [1, 3, 6]
    assert torch.equal(result.tokens, inputs.features[[1, 3, 6]])
    assert result.info["raters"].tolist() == [0]
    assert result.assignment.tolist() == [-1, 0, -1, 1, -1, -1, 2, -1]


def test_method_recycles_into_exactly_keep_rows() -> None:
    inputs = make_inputs(seed=7)
    n = inputs.num_tokens
    result = build_method("sparsevlm")(inputs, 40)  # v1 default: recycling on
    kept, clusters = recycle_split(n, 40)
    assert clusters > 0 and result.tokens.shape[0] == 40 and result.info["clusters"] == clusters
    assert result.info["kept"].numel() == kept
    recycled = result.info["recycled"]
    assert recycled.numel() == recycle_count(n - kept)[0]
    # recycled tokens are the best-rated pruned ones
    pruned = torch.ones(n, dtype=torch.bool)
    pruned[result.info["kept"]] = False
    threshold = result.scores[recycled].min()
    assert (result.scores[pruned] > threshold).sum().item() < recycled.numel()
    for row in range(kept, 40):
        members = result.assignment == row
        assert members.any()
        assert torch.allclose(result.tokens[row], inputs.features[members].mean(0), atol=1e-5)
    assert set(result.token_index[kept:].tolist()) <= set(recycled.tolist())
    v2 = build_method("sparsevlm", version="2_0")(inputs, 40)
    assert v2.info["clusters"] == 0 and v2.info["heads_kept"] is not None and v2.tokens.shape[0] == 40


def test_equal_text_scores_fall_back_to_all_raters() -> None:
    inputs, lm = _scripted()
    lm.embeds = torch.zeros_like(lm.embeds)
    result = build_method("sparsevlm", recycle=False)(inputs, 3)
    assert result.info["raters_fallback"] and result.info["raters"].tolist() == [0, 1, 2]
    assert torch.isfinite(result.scores).all()


def test_span_mismatch_and_bad_version_are_errors() -> None:
    inputs, lm = _scripted()
    lm.image = (2, 9)
    with pytest.raises(MethodError, match="image span"):
        build_method("sparsevlm")(inputs, 3)
    with pytest.raises(MethodError, match="version"):
        build_method("sparsevlm", version="3")(make_inputs(), 3)


@pytest.mark.parametrize("name", GOLDEN_FILES["sparsevlm"])
def test_golden(name: str) -> None:
    assert_golden_passes(name)


# ------------------------------------------------------------------------------ many images at once

BATCH_SIZES = {1: (144,), 3: (144, 90, 56), 8: (144, 90, 56, 144, 42, 110, 64, 72)}
BATCH_KEEPS = {1: (40,), 3: (40, 12, 55), 8: (40, 12, 55, 7, 41, 1, 30, 71)}
MODES = ({}, {"version": "2_0"}, {"recycle": False}, {"version": "2_0", "recycle": True})


def _batch_inputs(sizes: tuple[int, ...], dtype: torch.dtype) -> list[MethodInputs]:
    made = [make_inputs(n, d_v=8, seed=i) for i, n in enumerate(sizes)]
    return [dataclasses.replace(one, features=one.features.to(dtype)) for one in made]


def _assert_identical(got: MethodResult, want: MethodResult, what: str) -> None:
    """Indices, assignment and info equal; tokens and scores bit for bit."""
    for name in ("token_index", "assignment", "tokens", "scores"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), f"{what}: {name}"
    assert got.info.keys() == want.info.keys(), what
    for key, value in want.info.items():
        same = torch.equal(got.info[key], value) if isinstance(value, torch.Tensor) else got.info[key] == value
        assert same, f"{what}: info[{key!r}]"


@pytest.mark.parametrize("mode", MODES, ids=["v1", "v2", "v1-no-recycling", "v2-recycling"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_batch_gives_each_image_what_it_gets_alone(batch: int, dtype: torch.dtype, mode: dict[str, object]) -> None:
    method = build_method("sparsevlm", **mode)
    inputs, keeps = _batch_inputs(BATCH_SIZES[batch], dtype), list(BATCH_KEEPS[batch])
    got = method.batch(inputs, keeps)
    recycles = method.version == "1_0" if method.recycle is None else method.recycle
    assert any(result.info["clusters"] for result in got) == recycles, "the batches do recycle where the mode does"
    for i, (result, one, keep) in enumerate(zip(got, inputs, keeps, strict=True)):
        assert result.tokens.shape[0] == keep
        _assert_identical(result, method(one, keep), f"image {i}")


def test_ties_keep_the_lowest_indices_and_recycle_the_next_ones_alone_and_in_a_batch() -> None:
    """Uniform layer-2 attention: every token is rated alike. N = 8, K = 3 recycles: 2 kept + 1 cluster of the
    int(0.3 * 6) + 1 = 2 best pruned, i.e. tokens 0, 1 kept and tokens 2, 3 merged (ties go to the lower index)."""
    tied, _ = _scripted(favourite=())
    method = build_method("sparsevlm")
    alone = method(tied, 3)
    assert alone.token_index[:2].tolist() == [0, 1] and alone.info["recycled"].tolist() == [2, 3]
    assert alone.assignment.tolist() == [0, 1, 2, 2, -1, -1, -1, -1]
    torch.testing.assert_close(alone.tokens[2], tied.features[2:4].mean(0), rtol=0, atol=1e-6)
    for got in method.batch([make_inputs(56, d_v=5, seed=3), tied, tied], [9, 3, 3])[1:]:
        _assert_identical(got, alone, "the tied image")


def test_relevance_is_computed_once_per_image_for_every_budget() -> None:
    inputs, lm = _scripted(n=30, favourite=(6, 1, 3, 20, 11))
    memoised = dataclasses.replace(inputs, memo={})
    method = build_method("sparsevlm")
    got = [method(memoised, keep) for keep in (3, 9)] + method.batch([memoised, memoised], [12, 5])
    assert lm.calls == [2], "one probe read for four budgets"
    for result, keep in zip(got, (3, 9, 12, 5), strict=True):
        assert result.scores is got[0].scores
        _assert_identical(result, method(inputs, keep), f"K = {keep}")
    assert len(lm.calls) == 5, "without a memo every call reads the probe"
