"""One cost model per method: its own selection work (score), its merging/calibration work (residual), and the
per-layer visual-token schedule its language model runs.

The formulas live here, keyed by cost-model name; which one a method uses is its class's ``cost_model``
metadata (``care_core.methods``), and method names, aliases and listing order are the method registry's: there
is no second list of names. ``baseline`` (also ``full``) is the unreduced row and not a method.

`tokens` (K) is the budget the user asked for. For pre-LLM methods every layer sees K visual tokens. For in-LLM
methods K is the count after the method's first pruning step (FastV) or the published budget (SparseVLM); the
row's equivalent average token count makes them comparable.

Selection and merging costs of the peers are the leading terms with constant 1, in the style of Supp. B; each
is stated in the `note` of its row. They are small next to the prefill; the prefill schedule is what differs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from care_core._chunks import SecondLayer
from care_core.config import ENGINES, CaReConfig, Engine
from care_core.errors import MethodError
from care_core.flops import formulas as fx

if TYPE_CHECKING:
    from care_core.architecture import BackboneSpec

DEFAULT_ENGINE: Engine = CaReConfig.engine  # the response engine care_reduce runs by default
DEFAULT_M: int = CaReConfig.m  # CaRe / ZOO-Prune perturbation directions (paper Supp. C; ZOO-Prune NOISERECOV_NUM)
BASELINE = "baseline"
_BASELINE_NAMES = (BASELINE, "full")


@dataclass(frozen=True)
class MethodCost:
    method: str
    tokens: int
    schedule: fx.Schedule
    score: dict[str, int] = field(default_factory=dict)
    residual: dict[str, int] = field(default_factory=dict)
    note: str = ""


Model = Callable[["BackboneSpec", int, int, int, int], MethodCost]  # (spec, N, K, m, T) -> cost
_MODELS: dict[str, Model] = {}


def _model(key: str) -> Callable[[Model], Model]:
    """Register a formula under `key`, the value a method class names as its ``cost_model``."""

    def register(fn: Model) -> Model:
        _MODELS[key] = fn
        return fn

    return register


def cost_model_names(family: str | None = None) -> list[str]:
    """Every registered method with a cost model, in the registry's listing order (baseline excluded); with
    `family` (e.g. "qwen2.5-vl"), only the methods that can run on that backbone family."""
    from care_core.methods import method_class, method_names, methods_for_backbone

    names = method_names() if family is None else methods_for_backbone(family)
    return [name for name in names if method_class(name).cost_model is not None]


def canonical_method(name: str) -> str:
    """The registry's name for `name` (aliases resolved), or "baseline"; MethodError if it has no cost model."""
    from care_core.methods import canonical_name, method_class

    key = name.strip().lower()
    if key in _BASELINE_NAMES:
        return BASELINE
    canonical = canonical_name(key)  # MethodError with suggestions for unknown names
    if method_class(canonical).cost_model not in _MODELS:
        raise MethodError(f"method {canonical!r} has no cost model (with one: {', '.join(cost_model_names())}, all)")
    return canonical


def follows_engine(name: str) -> bool:
    """Whether method `name`'s scoring runs on ``CaReConfig.engine`` (PRCA: it lists ``engine`` among the
    hyperparameters it reads). ZOO-Prune's anchors are always finite differences, as ZOO-Prune defines them."""
    from care_core.methods import method_class

    canonical = canonical_method(name)
    return canonical != BASELINE and "engine" in method_class(canonical).hyperparameters


def method_cost(
    name: str,
    spec: BackboneSpec,
    n: int,
    k: int,
    m: int = DEFAULT_M,
    text_tokens: int = 64,
    engine: Engine = DEFAULT_ENGINE,
    second_layer: SecondLayer = "dense",
) -> MethodCost:
    """The cost of method `name` (or "baseline") from the formula its class names as ``cost_model``.

    For the methods whose scoring follows the response engine (:func:`follows_engine`), ``engine="fd"`` keeps
    Supp. B's 2 m F_M(N) and ``engine="jvp"`` (the library default) counts what that engine runs instead, with
    the projector's second layer ``second_layer`` ("dense": the functional core, the CPU; "triangular": a
    ``Scorer`` on CUDA, e.g. the pipeline's; see :func:`care_core.flops.formulas.jvp_response_terms`).
    """
    from care_core.methods import method_class

    if engine not in ENGINES:
        raise MethodError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    canonical = canonical_method(name)
    key = BASELINE if canonical == BASELINE else method_class(canonical).cost_model
    assert key is not None
    cost = dataclasses.replace(_MODELS[key](spec, n, k, m, text_tokens), method=canonical)
    if engine == "fd" or not follows_engine(canonical) or "2mF_M(N)" not in cost.score:
        return cost
    score = fx.jvp_response_terms(n, m, spec.projector, second_layer)
    score.update((term, value) for term, value in cost.score.items() if term != "2mF_M(N)")
    note = cost.note.replace("Supp. B as written: ", "").replace("Supp. B ", "")
    return dataclasses.replace(cost, score=score, note=f"{note}; {fx.jvp_response_note(spec.projector, second_layer)}")


def _uniform(spec: BackboneSpec, tokens: int) -> fx.Schedule:
    return fx.uniform_schedule(spec.lm, tokens)


def _segments(spec: BackboneSpec, cuts: list[int], counts: list[int]) -> fx.Schedule:
    """Layers [0, cuts[0]) at counts[0], [cuts[0], cuts[1]) at counts[1], ..., the rest at counts[-1]."""
    bounds = [0, *[min(c, spec.lm.layers) for c in cuts], spec.lm.layers]
    return fx.check_schedule([(bounds[i + 1] - bounds[i], counts[i]) for i in range(len(counts))], spec.lm)


def _scaled_layer(spec: BackboneSpec, layer: int) -> int:
    """A pruning layer published for 32-layer 7B models, placed at the same depth of another model."""
    return layer if spec.lm.layers == 32 else max(1, round(layer * spec.lm.layers / 32))


# ------------------------------------------------------------------------------------------ baseline, CaRe
@_model("baseline")
def _baseline(spec: BackboneSpec, n: int, k: int, m: int, t: int) -> MethodCost:
    return MethodCost("baseline", n, _uniform(spec, n), note="unreduced: every layer sees all N visual tokens")


def _prca_score(spec: BackboneSpec, n: int, k: int, m: int) -> dict[str, int]:
    return fx.score_terms(n, k, m, spec.projector, spec.lm.hidden)


def _zoo_score(spec: BackboneSpec, n: int, k: int, m: int) -> dict[str, int]:
    """ZOO-Prune / SADS: the same 2m projector passes and m·N response norms, diversity on post-projector
    features (width H), greedy selection."""
    return {
        "2mF_M(N)": 2 * m * fx.projector_flops(spec.projector, n),
        "mNH": m * n * spec.lm.hidden,
        "N^2 d_t": n * n * spec.projector.out_dim,
        "KN": k * n,
    }


_SUPP_B = "Supp. B as written: F_score + F_res + F_prefill(K)"


@_model("care")
def _care(spec: BackboneSpec, n: int, k: int, m: int, t: int) -> MethodCost:
    return MethodCost("care", k, _uniform(spec, k), _prca_score(spec, n, k, m),
                      fx.residual_terms(n, k, spec.projector.token_dim), _SUPP_B)  # fmt: skip


@_model("prca-only")
def _prca_only(spec: BackboneSpec, n: int, k: int, m: int, t: int) -> MethodCost:
    return MethodCost("prca-only", k, _uniform(spec, k), _prca_score(spec, n, k, m), {},
                      "Supp. B F_score + F_prefill(K); no calibration, so F_res = 0")  # fmt: skip


@_model("simple-calib")
def _simple_calib(spec: BackboneSpec, n: int, k: int, m: int, t: int) -> MethodCost:
    return MethodCost("simple-calib", k, _uniform(spec, k), _zoo_score(spec, n, k, m),
                      fx.residual_terms(n, k, spec.projector.token_dim),
                      "ZOO-Prune anchors + ungated calibration: zoo-prune score + F_res + F_prefill(K)")  # fmt: skip


@_model("confidence-calib")
def _confidence_calib(spec: BackboneSpec, n: int, k: int, m: int, t: int) -> MethodCost:
    return MethodCost("confidence-calib", k, _uniform(spec, k), _zoo_score(spec, n, k, m),
                      fx.residual_terms(n, k, spec.projector.token_dim),
                      "ZOO-Prune anchors + CGTC: zoo-prune score + F_res + F_prefill(K)")  # fmt: skip


@_model("prca+simple-calib")
def _prca_simple(spec: BackboneSpec, n: int, k: int, m: int, t: int) -> MethodCost:
    return MethodCost("prca+simple-calib", k, _uniform(spec, k), _prca_score(spec, n, k, m),
                      fx.residual_terms(n, k, spec.projector.token_dim),
                      "PRCA anchors + ungated calibration: F_score + F_res + F_prefill(K)")  # fmt: skip


# ------------------------------------------------------------------------------------------ pre-LLM peers
@_model("zoo-prune")
def _zoo(spec: BackboneSpec, n: int, k: int, m: int, t: int) -> MethodCost:
    return MethodCost("zoo-prune", k, _uniform(spec, k), _zoo_score(spec, n, k, m), {},
                      f"2mF_M(N) + mNH + N² d_t (post-projector diversity, d_t = {spec.projector.out_dim}) + KN; "
                      "m = 64")  # fmt: skip


@_model("divprune")
def _divprune(spec: BackboneSpec, n: int, k: int, m: int, t: int) -> MethodCost:
    d_t = spec.projector.out_dim
    return MethodCost("divprune", k, _uniform(spec, k), {"N^2 d_t": n * n * d_t, "KN": k * n}, {},
                      f"N² d_t (1 - cos on post-projector tokens, d_t = {d_t}) + KN (greedy max-min)")  # fmt: skip


def _visionzip_split(k: int) -> tuple[int, int]:
    contextual = round(k * 10 / 64)  # 54+10, 108+20, 162+30 (README and the common ports)
    return k - contextual, contextual


@_model("visionzip")
def _visionzip(spec: BackboneSpec, n: int, k: int, m: int, t: int) -> MethodCost:
    dominant, contextual = _visionzip_split(k)
    heads, d_v = spec.vision.heads, spec.projector.token_dim
    d_k = spec.vision.hidden // heads
    rest = n - dominant
    merged = max(rest - contextual, 0)
    return MethodCost(
        "visionzip", k, _uniform(spec, k),
        {"heads·N": heads * n, "N": n},
        {"(R-C) C d_k": merged * contextual * d_k, "(R-C) d_v": merged * d_v},
        f"dominant {dominant} by CLS attention summed over {heads} heads (heads·N + N top-k); contextual "
        f"{contextual}: the R = N - D rest matched to C targets on head-mean keys (d_k = {d_k}) and averaged",
    )  # fmt: skip


def _prumerge_cost(name: str, spec: BackboneSpec, n: int, k: int, fill: bool) -> MethodCost:
    """PruMerge / PruMerge+ at the fixed budget: K - 1 kept patches + 1 summary row = K tokens for the LLM."""
    d_v = spec.projector.token_dim
    kept = max(k - 1, 0)
    score = {"N d_v": n * d_v, "N": n}
    if fill:
        score["N (spatial fill)"] = n
    how = "IQR outliers, the rest spread evenly over the image (N)" if fill else "top K - 1 by attention"
    return MethodCost(
        name, k, _uniform(spec, k), score,
        {"(K-1) N d_v": kept * n * d_v, "32 (K-1) d_v": 32 * kept * d_v, "N_d d_v": (n - kept) * d_v},
        f"CLS-row attention (N d_v) + selection (N): {how}; each of the K - 1 kept patches merges its 32 nearest "
        "keys ((K-1) N d_v + 32 (K-1) d_v); the N_d = N - K + 1 pruned ones form one summary row: K tokens in all",
    )  # fmt: skip


@_model("prumerge+")
def _prumerge_plus(spec: BackboneSpec, n: int, k: int, m: int, t: int) -> MethodCost:
    return _prumerge_cost("prumerge+", spec, n, k, fill=True)


@_model("prumerge")
def _prumerge(spec: BackboneSpec, n: int, k: int, m: int, t: int) -> MethodCost:
    return _prumerge_cost("prumerge", spec, n, k, fill=False)


@_model("tome")
def _tome(spec: BackboneSpec, n: int, k: int, m: int, t: int) -> MethodCost:
    from care_core.methods.tome import ToMe, tome_schedule

    d_v = spec.projector.token_dim
    method = ToMe()
    match = merge = 0
    current = n
    steps = tome_schedule(n, k, method.r_per_call(n, k)) if k < n else []
    for r in steps:
        a, b = (current + 1) // 2, current // 2
        match += a * b * d_v + current
        merge += r * d_v
        current -= r
    note = (f"bipartite soft matching, {len(steps)} calls of r <= ceil((N - K) / {method.calls}) (ToMe's constant "
            "schedule, as the method runs it): Σ |A||B| d_v + n to match, Σ r d_v to merge")  # fmt: skip
    return MethodCost("tome", k, _uniform(spec, k), {"Σ |A||B| d_v + n": match}, {"Σ r d_v": merge}, note)


@_model("ficoco-v")
def _ficoco(spec: BackboneSpec, n: int, k: int, m: int, t: int) -> MethodCost:
    layers = 11  # merging after layers 12..22 (LLaVA's feature layer -2)
    d_v = spec.projector.token_dim
    per_layer = math.ceil(max(n - k, 0) / layers)
    score = merge = 0
    current = n + 1
    for _ in range(layers):
        r = min(per_layer, max(current - (k + 1), 0))
        score += current * current + current
        merge += r * current + r * d_v
        current -= r
    return MethodCost("ficoco-v", k, _uniform(spec, k), {"Σ T²": score}, {"Σ r T + r d_v": merge},
                      "inside the vision tower: per merging layer T² (filter on attention logits) + r T + r d_v "
                      "(correlate, compress); N treated as one sequence (LLaVA-NeXT crops are merged per crop, "
                      "which costs less)")  # fmt: skip


@_model("random")
def _random(spec: BackboneSpec, n: int, k: int, m: int, t: int) -> MethodCost:
    return MethodCost("random", k, _uniform(spec, k), {"N": n}, {}, "a random permutation: N")


@_model("pool")
def _pool(spec: BackboneSpec, n: int, k: int, m: int, t: int) -> MethodCost:
    return MethodCost("pool", k, _uniform(spec, k), {}, {"N d_v": n * spec.projector.token_dim},
                      "average pooling of the N tokens into K: N d_v adds")  # fmt: skip


# ------------------------------------------------------------------------------------------ in-LLM peers
FASTV_LAYER = 2


@_model("fastv")
def _fastv(spec: BackboneSpec, n: int, k: int, m: int, t: int) -> MethodCost:
    k_layer = _scaled_layer(spec, FASTV_LAYER)
    heads = spec.lm.heads
    return MethodCost(
        "fastv", k, _segments(spec, [k_layer], [n, k]),
        {"heads·N": heads * n, "N": n}, {},
        f"layers 0..{k_layer - 1} at N, the rest at K; selection reads layer {k_layer - 1}'s attention of the last "
        "token (mean over heads: heads·N, top-k: N); no recompute assumed (eager attention)",
    )  # fmt: skip


def sparsevlm_counts(n: int, k: int) -> tuple[list[int], list[int], list[int], str]:
    """Per pruning layer: visual tokens after it (kept + v1 recycled cluster centres), tokens pruned, centres.

    The schedules, pruning layers and recycling rule are the method's (:mod:`care_core.methods.sparsevlm`).
    """
    from care_core.methods.sparsevlm import SCHEDULE_TOKENS, SCHEDULES, recycle_count

    schedules = SCHEDULES["1_0"]
    if k in schedules and n == SCHEDULE_TOKENS:
        kept = list(schedules[k])
        how = f"published v1 schedule for K={k}: keep {kept}"
    else:
        ref = min(schedules, key=lambda b: (abs(b * n - k * SCHEDULE_TOKENS), b))  # nearest K/N; ties: smaller
        kept = [max(1, min(n, round(s * k / ref))) for s in schedules[ref]]
        how = f"no published schedule for N={n}, K={k}: the K={ref} shape scaled by K/{ref} (declared), keep {kept}"
    counts, pruned_list, clusters, current = [], [], [], n
    for s in kept:
        s = min(s, current)
        pruned = current - s
        c = recycle_count(pruned)[1] if pruned > 0 else 0  # v1 recycling: centres of the top 30% (+1) pruned
        counts.append(s + c)
        pruned_list.append(pruned)
        clusters.append(c)
        current = s + c
    return counts, pruned_list, clusters, how


@_model("sparsevlm")
def _sparsevlm(spec: BackboneSpec, n: int, k: int, m: int, t: int) -> MethodCost:
    counts, pruned, clusters, how = sparsevlm_counts(n, k)
    from care_core.methods.sparsevlm import PRUNING_LAYERS, recycle_count

    layers = [_scaled_layer(spec, layer) for layer in PRUNING_LAYERS]
    cuts = [layer + 1 for layer in layers]  # the pruning layer itself still runs at the previous length
    schedule = _segments(spec, cuts, [n, *counts])
    h, raters = spec.lm.hidden, max(t, 1)
    before = [n, *counts[:-1]]
    score = {
        "N T H (text raters)": n * t * h,
        "Σ heads·T·n (relevance)": sum(spec.lm.heads * raters * b for b in before),
    }
    recycle = {"Σ p² H (density-peak kNN)": sum(recycle_count(p)[0] ** 2 * h for p in pruned if p > 0)}
    return MethodCost(
        "sparsevlm", k, schedule, score, recycle,
        f"v1: prunes after layers {layers} (those layers still run at the previous length); {how}; counts "
        f"{counts} include the recycled cluster centres {clusters}; raters taken as all T text tokens",
    )  # fmt: skip
