"""ToMe: a hand-checkable matching, merge/unmerge/source consistency, the harness chain, the method, golden files."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from care_core.errors import MethodError
from care_core.methods import build_method, tome
from care_core.methods.tome import bipartite_soft_matching, merge_wavg, tome_chain, tome_chain_batch, tome_schedule

from .conftest import GOLDEN_FILES, assert_golden_passes, make_inputs


def test_hand_case() -> None:
    # A = tokens 0, 2; B = tokens 1, 3. cos(t2, t1) = 0.995 beats cos(t0, t3) = 0.894, so r = 1 merges t2 into t1.
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.1, 1.0], [1.0, 0.5]])
    match = bipartite_soft_matching(x, 1)
    assert match.sources.tolist() == [1] and match.destinations.tolist() == [0] and match.unmerged.tolist() == [0]
    merged, size = merge_wavg(match, x)
    expected = torch.stack([x[0], (x[1] + x[2]) / 2, x[3]])
    assert torch.allclose(merged, expected)
    assert size[:, 0].tolist() == [1.0, 2.0, 1.0]
    assert match.row_of_input().tolist() == [0, 1, 1, 2]
    assert match.occupant().tolist() == [0, 1, 3]


def test_source_map_and_unmerge_agree() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(33, 8, generator=g)
    match = bipartite_soft_matching(x, 10, class_token=True)
    source = match.merge(torch.eye(33), mode="amax")  # ToMe's merge_source
    assert torch.equal(source.argmax(dim=0), match.row_of_input())
    assert match.row_of_input()[0] == 0  # the class token stays first
    merged, _ = merge_wavg(match, x)
    back = match.unmerge(merged)
    assert torch.equal(back, merged[match.row_of_input()])


def test_r_is_capped_at_half() -> None:
    x = torch.randn(11, 4, generator=torch.Generator().manual_seed(1))
    assert bipartite_soft_matching(x, 100, class_token=True).r == 5
    assert bipartite_soft_matching(x, 100).r == 5
    assert bipartite_soft_matching(x, 0).merge(x) is x


@pytest.mark.parametrize(("n", "keep", "steps"), [(576, 64, (576, 288, 144, 72, 64)), (64, 8, (64, 32, 16, 8))])
def test_chain_schedule(n: int, keep: int, steps: tuple[int, ...]) -> None:
    x = torch.randn(n, 6, generator=torch.Generator().manual_seed(n))
    chain = tome_chain(x, keep)
    assert chain.steps == steps
    assert chain.tokens.shape == (keep, 6)
    assert chain.size.sum() == n
    counts = torch.bincount(chain.group, minlength=keep).to(chain.size.dtype)
    assert torch.equal(counts, chain.size)
    # every row is the mean of the inputs it holds
    means = torch.zeros(keep, 6).index_add_(0, chain.group, x) / counts[:, None]
    assert torch.allclose(means, chain.tokens, atol=1e-5)
    assert torch.equal(chain.group[chain.occupant], torch.arange(keep))


def test_method_and_degenerate_tokens() -> None:
    inputs = make_inputs(seed=3, zeros=True)
    result = build_method("tome")(inputs, 20)
    assert result.num_tokens == 20 and torch.isfinite(result.tokens).all()
    assert result.token_index.unique().numel() == 20
    with pytest.raises(MethodError):
        build_method("tome")(inputs, 0)


@pytest.mark.parametrize("name", GOLDEN_FILES["tome"])
def test_golden(name: str) -> None:
    assert_golden_passes(name)


def test_schedule_is_tomes_constant_r() -> None:
    # 512 tokens to merge in 23 calls: r = ceil(512 / 23) = 23 for 22 calls, then the remaining 6
    assert build_method("tome").r_per_call(576, 64) == 23
    assert tome_schedule(576, 64, 23) == [23] * 22 + [6]
    assert tome_schedule(576, 64) == [288, 144, 72, 8]  # the golden harness chain
    assert tome_schedule(10, 1, 100) == [5, 2, 1, 1]  # capped at n // 2 per call
    result = build_method("tome")(make_inputs(n=576, seed=1), 64)
    assert result.info["steps"][:3] == (576, 553, 530) and len(result.info["steps"]) == 24


def test_survivors_depend_on_the_features() -> None:
    """Issue #10 defect 9: the harness chain merges all of set A in every call, so 576 -> 64 kept exactly the
    tokens at index 7 mod 8 on every image. With i.i.d. features (no positional structure) the kept tokens must
    vary with the features and cover every residue."""
    kept = []
    for seed in range(3):
        x = torch.randn(576, 16, generator=torch.Generator().manual_seed(seed))
        inputs = make_inputs(n=576, seed=seed)
        inputs.features = x
        result = build_method("tome")(inputs, 64)
        assert result.token_index.unique().numel() == 64
        assert set((result.token_index % 8).tolist()) == set(range(8))
        kept.append(set(result.token_index.tolist()))
    assert kept[0] != kept[1] != kept[2]
    # the rows are still size-weighted means of the inputs they hold
    counts = torch.bincount(result.assignment, minlength=64).to(x.dtype)
    means = torch.zeros(64, 16).index_add_(0, result.assignment, x) / counts[:, None]
    assert torch.allclose(means, result.tokens, atol=1e-5)


# ------------------------------------------------------------------------------ many images in one loop

BATCH_SIZES = {1: (57,), 3: (40, 131, 90), 8: (40, 131, 57, 90, 1, 110, 64, 7)}
BATCH_KEEPS = (5, 40, 17, 9, 1, 3, 64, 2)  # image 6 keeps all its tokens (no call at all)


def _batch_images(sizes: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    """Random images; image 1 repeats its first half (exact ties), image 3 has zero rows (cosine 0 to all)."""
    xs = [torch.randn(n, 6, generator=torch.Generator().manual_seed(n)).to(dtype) for n in sizes]
    if len(xs) > 1:
        xs[1][66:] = xs[1][:65].clone()
    if len(xs) > 3:
        xs[3][::4] = 0
    return xs


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_batch_chain_gives_each_image_its_own_chain(batch: int, dtype: torch.dtype) -> None:
    xs, keeps = _batch_images(BATCH_SIZES[batch], dtype), list(BATCH_KEEPS[:batch])
    rs = [build_method("tome").r_per_call(x.shape[0], k) for x, k in zip(xs, keeps, strict=True)]
    got = tome_chain_batch(xs, keeps, rs)
    tol = {"rtol": 0, "atol": 1e-9} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-6}
    for i, (chain, x, keep, r) in enumerate(zip(got, xs, keeps, rs, strict=True)):
        want = tome_chain(x, keep, r)
        assert chain.steps == want.steps, f"image {i}"
        assert torch.equal(chain.occupant, want.occupant) and torch.equal(chain.group, want.group), f"image {i}"
        torch.testing.assert_close(chain.tokens, want.tokens, **tol, msg=f"image {i}")
        assert torch.equal(chain.size, want.size), f"image {i}"


def test_batch_ties_merge_into_the_first_match_and_padding_is_never_matched() -> None:
    """[v, -v, v, -v, v, -v]: every A-B cosine is -1 (a tie everywhere), below the 0 a zero padded column would
    give. One call of r = 3 merges all of A into B position 0 (the first best), in A order: by hand,
    rows [(v + v + v - v) / 4, -v, -v]. Batched with a larger image, the padded columns must not attract them."""
    v = torch.tensor([1.0, 2.0, -0.5], dtype=torch.float64)
    tied = torch.stack([v, -v] * 3)
    other = torch.randn(20, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    chain, big = tome_chain_batch([tied, other], [3, 11], [3, 10])
    torch.testing.assert_close(chain.tokens, torch.stack([v / 2, -v, -v]), rtol=0, atol=1e-12)
    assert chain.group.tolist() == [0, 0, 0, 1, 0, 2] and chain.occupant.tolist() == [1, 3, 5]
    assert chain.size.tolist() == [4.0, 1.0, 1.0]
    want = tome_chain(other, 11, 10)
    assert torch.equal(big.group, want.group) and torch.equal(big.occupant, want.occupant)
    assert int(big.group.max()) < 11 and int(chain.group.max()) < 3, "no input ends in a padded row"


# ------------------------------------------------------------------------------ budgets of one image, one loop

PLANNED_KEEPS = (40, 9, 3)


@pytest.mark.parametrize("first", PLANNED_KEEPS)
def test_planned_budgets_run_in_the_first_calls_loop_and_match_each_budget_alone(
    first: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a memo and planned budgets, the first call runs every planned chain of every image in one loop; the
    later calls compute nothing, and every (image, budget) gets bit for bit what it gets alone without memo."""
    alone = [dataclasses.replace(make_inputs(n=n, d_v=6, seed=n), features=x)
             for n, x in zip((90, 131), _batch_images((90, 131), torch.float64), strict=True)]  # fmt: skip
    shared = [dataclasses.replace(one, memo={}, planned_keeps=PLANNED_KEEPS) for one in alone]
    loops: list[list[int]] = []
    real = tome.tome_chain_batch

    def counting(xs: list[torch.Tensor], keeps: list[int], rs: list[int]) -> list[tome.ToMeChain]:
        loops.append(list(keeps))
        return real(xs, keeps, rs)

    monkeypatch.setattr(tome, "tome_chain_batch", counting)
    method = build_method("tome")
    order = [first, *(k for k in PLANNED_KEEPS if k != first)]
    for keep in order:
        got = method.batch(shared, [keep, keep])
        for i, (result, one) in enumerate(zip(got, alone, strict=True)):
            want = method(one, keep)
            assert torch.equal(result.tokens, want.tokens), f"image {i}, K = {keep}"
            assert torch.equal(result.token_index, want.token_index), f"image {i}, K = {keep}"
            assert torch.equal(result.assignment, want.assignment), f"image {i}, K = {keep}"
    others = sorted((k for k in PLANNED_KEEPS if k != first), reverse=True)
    assert loops[0] == [first, *others, first, *others], "one loop: both images, every planned budget"
    assert len(loops) == 1, "the later calls take their chains from the memo (the checks alone run tome_chain)"
    assert all(not one.memo for one in shared), "every chain was handed out once and left the memo"
