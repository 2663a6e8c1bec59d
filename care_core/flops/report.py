"""Assemble the `care flops` report: the baseline row, one row per (budget, method), optional terms, paper values."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from care_core._chunks import SECOND_LAYERS, SecondLayer
from care_core.architecture import BackboneSpec
from care_core.backbones.families import backbone_family
from care_core.budget import check_keep, keep_from_ratio
from care_core.config import ENGINES, Engine
from care_core.errors import CareError, MethodError
from care_core.flops import formulas as fx
from care_core.flops import paper as paper_data
from care_core.flops.methods import (
    BASELINE,
    DEFAULT_ENGINE,
    DEFAULT_M,
    canonical_method,
    cost_model_names,
    follows_engine,
    method_cost,
)
from care_core.flops.specs import KNOWN_BACKBONES
from care_core.flops.tokens import TokenCount, squarest_grid, visual_tokens


@dataclass(frozen=True)
class FlopsOptions:
    text_tokens: int = 64
    convention: fx.Convention = "flops"
    gqa: bool = False
    lm_head: bool = False
    vision_tower: bool = False
    m: int = DEFAULT_M
    engine: Engine = DEFAULT_ENGINE  # PRCA's response engine whose work is counted
    second_layer: SecondLayer = "dense"  # the jvp engine's second layer: dense, or through its triangular factor

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise CareError(f"must be one of {', '.join(ENGINES)}, got {self.engine!r}", parameter="engine")
        if self.second_layer not in SECOND_LAYERS:
            raise CareError(f"must be one of {', '.join(SECOND_LAYERS)}, got {self.second_layer!r}",
                            parameter="second_layer")  # fmt: skip
        if self.convention not in fx.CONVENTIONS:
            raise CareError(f"must be one of {', '.join(fx.CONVENTIONS)}, got {self.convention!r}",
                            parameter="convention")  # fmt: skip
        if self.text_tokens < 0:
            raise CareError(f"must be >= 0, got {self.text_tokens}", parameter="text_tokens")
        if self.m < 1:
            raise CareError(f"must be >= 1, got {self.m}", parameter="m")


FORMULAS = {
    "F_score": "2 m F_M(N) + m N H + N^2 d_v + K N   (Supp. B; what engine fd runs)",
    "F_score (engine jvp)": "F_1(N) + F_1(m) + 2 m N d_h d_out + m N H + N^2 d_v + K N for a Linear-act-Linear "
    "projector (F_1: its first layer; d_h, d_out: the second's in/out); other projectors: as Supp. B",
    "F_score (engine jvp, second_layer triangular)": "the second layer through W2's triangular factor R (d_h x d_h, "
    "W2 = QR) in blocks of 256 columns: 2 m N sum_b (d_h - first column of b) * 256 in place of 2 m N d_h d_out "
    "(what a Scorer runs on CUDA, e.g. the pipeline's)",
    "F_res": "N_d K d_v + N_d K   (N_d = N - K)",
    "F_layer": "8 W H^2 + 6 W H I + 4 W^2 H   (W = T + visual tokens of the layer)",
    "F_layer (gqa)": "4 W H q + 4 W H kv + 6 W H I + 4 W^2 q   (q = heads·head_dim, kv = kv_heads·head_dim)",
    "F_prefill": "sum over the layer schedule of F_layer",
    "F_M(N)": "2 N sum(in·out) over the projector's linear layers",
    "lm_head": "2 H V (logits of the last position only, as generate computes them in prefill)",
    "O(.)": "taken with constant 1, in FLOPs, as written",
    "macs": "every figure halved: 1 MAC = 2 FLOPs",
    "not counted": "bias adds, norms, activations, softmax, RoPE, embeddings, causal halving, and the projection "
    "of the tokens handed to the LLM",
}


@dataclass(frozen=True)
class TokenSource:
    tokens: int
    how: str  # where N came from: "default", or the parameter that gave it ("tokens", "image_size")
    note: str
    count: TokenCount | None = None
    image: tuple[int, int] | None = None


def resolve_tokens(spec: BackboneSpec, tokens: int | None, image: tuple[int, int] | None) -> TokenSource:
    if tokens is not None and image is not None:
        raise CareError("give either {tokens} or {image_size}, not both")
    if tokens is not None:
        if tokens < 1:
            raise CareError(f"must be at least 1, got {tokens}", parameter="tokens")
        return TokenSource(tokens, "tokens", f"N = {tokens} as given")
    if image is not None:
        count = visual_tokens(spec, *image)
        note = f"N for a {image[0]}×{image[1]} image"
        if count.detail.get("pooled_grid", list(count.grid or ())) != list(count.grid or ()):
            note += (f" (the unpooled grid; the model's own sequence pools it to {count.detail['model_visual_rows']} "
                     "visual rows, newlines included: docs/design/backbones.md §LLaVA-OneVision)")  # fmt: skip
        return TokenSource(count.tokens, "image_size", note, count, image)
    default = visual_tokens(spec, *spec.default_image) if spec.default_image else None
    return TokenSource(spec.default_tokens, "default", spec.default_tokens_note, default, spec.default_image)


def resolve_budgets(spec: BackboneSpec, n: int, keeps: Sequence[int], ratios: Sequence[float]) -> list[int]:
    """K values, `keeps` then `ratios` (duplicates dropped, as `care csr` takes them);
    none given: the paper's budgets for this backbone (its fractions of N)."""
    values = [check_keep(keep, n) for keep in keeps] + [keep_from_ratio(ratio, n) for ratio in ratios]
    if not keeps and not ratios:
        values = [keep_from_ratio(fraction, n) for fraction in spec.default_budget_fractions()]
    return list(dict.fromkeys(values))


def resolve_methods(methods: Sequence[str], family: str | None = None) -> list[str]:
    """Canonical method names; 'all' = every method with a cost model that can run on backbone `family`
    (the same list as ``care_core.methods.methods_for_backbone``). A named method that cannot run there is an error."""
    from care_core.methods import method_class

    names: list[str] = []
    for name in methods or ["care"]:
        if name.strip().lower() == "all":
            names.extend(cost_model_names(family))
            continue
        canonical = canonical_method(name)
        if family is not None and canonical != BASELINE and not method_class(canonical).serves(family):
            raise MethodError(f"method {canonical!r} cannot run on {family} backbones, so it has no cost there")
        names.append(canonical)
    return [name for name in dict.fromkeys(names) if name != BASELINE]


def vision_terms(spec: BackboneSpec, source: TokenSource) -> tuple[dict[str, int], str]:
    """The optional vision-tower term and how it was counted, as :data:`formulas.VISION_TOWERS` counts the spec's
    tower kind."""
    vision = spec.vision
    tower = fx.VISION_TOWERS.get(vision.kind)
    if tower is None:
        raise CareError(f"cannot count a vision tower of kind {vision.kind!r} (known: {', '.join(fx.VISION_TOWERS)})",
                        parameter="vision_tower")  # fmt: skip
    if isinstance(tower, fx.CropTower):
        if backbone_family(spec.family).crops:
            if source.count is not None:
                crops, how = source.count.crops, f"{source.count.crops} crops (tiles and base view) for this image"
            else:
                crops, how = (
                    5,
                    "5 crops assumed (base + 2×2 tiles, as at the default image size): N alone does not fix them",
                )
        else:
            crops, how = 1, f"one {vision.image_size}×{vision.image_size} view"
        counted = vision.layers_counted
        if counted < vision.layers:
            layers = f"{counted} of {vision.layers} layers, up to the feature layer"
        else:
            layers = f"all {counted} layers"
        return tower.flops(vision, crops), f"{tower.label}, {layers}, {how}"
    if source.count is not None and source.count.grid is not None:
        rows, cols = source.count.grid
        how = f"merged grid {rows}×{cols} of this image"
    else:
        rows, cols = squarest_grid(source.tokens)
        how = f"merged grid {rows}×{cols} assumed (the squarest factorisation of N = {source.tokens})"
    label = tower.label.format(deepstack=len(vision.deepstack_layers))
    return tower.flops(vision, rows, cols), f"{label}, {how}"


def _tera(values: dict[str, int], convention: fx.Convention = "flops") -> dict[str, float]:
    return {key: fx.to_unit(value, convention) for key, value in values.items()}


def build_row(spec: BackboneSpec, method: str, n: int, k: int, options: FlopsOptions,
              extra: dict[str, int]) -> dict[str, Any]:  # fmt: skip
    cost = method_cost(method, spec, n, k if method != "baseline" else n, options.m, options.text_tokens,
                       options.engine, options.second_layer)  # fmt: skip
    t = options.text_tokens
    prefill = fx.prefill_flops(cost.schedule, spec.lm, t, options.gqa)
    terms_flops = {"score": sum(cost.score.values()), "residual": sum(cost.residual.values()), "prefill": prefill}
    terms_flops.update(extra)
    total = sum(terms_flops.values())
    breakdown = {
        "score": _tera(cost.score),
        "residual": _tera(cost.residual),
        "prefill": _tera(fx.prefill_breakdown(cost.schedule, spec.lm, t, options.gqa)),
    }
    row: dict[str, Any] = {
        "backbone": spec.display,
        "method": cost.method,
        "tokens": cost.tokens,
        "engine": options.engine if follows_engine(cost.method) else None,
        "second_layer": options.second_layer if follows_engine(cost.method) and options.engine == "jvp" else None,
        "avg_tokens": round(fx.equivalent_tokens(cost.schedule, spec.lm, t, options.gqa), 2),
        "layer_avg_tokens": round(fx.layer_average_tokens(cost.schedule), 2),
        "schedule": [list(segment) for segment in cost.schedule],
        "tflops": fx.to_unit(total),
        "terms": _tera(terms_flops),
        "breakdown": breakdown,
        "flops": total,
        "note": cost.note,
    }
    if options.convention == "macs":
        row["tmacs"] = fx.to_unit(total, "macs")
        row["terms_tmacs"] = _tera(terms_flops, "macs")
    return row


def attach_paper(row: dict[str, Any], spec: BackboneSpec, n: int) -> None:
    """The paper's figure for this row; only at the paper's own N (a different N is a different question)."""
    key = spec.paper_key if n == spec.default_tokens else None
    match = paper_data.paper_value(key, row["method"], row["tokens"])
    row["paper_tflops"] = match.tflops if match else None
    row["paper_source"] = match.source if match else None
    if match is not None and match.tflops is not None:
        row["paper_diff"] = row["tflops"] - match.tflops
        row["paper_diff_pct"] = 100 * (row["tflops"] - match.tflops) / match.tflops
    else:
        row["paper_diff"] = row["paper_diff_pct"] = None


def table_s1_vs_ours(options: FlopsOptions) -> list[dict[str, Any]]:
    """Every Table S1 row beside our figure for it (that backbone at the paper's N, these options)."""
    by_key = {spec.paper_key: spec for spec in KNOWN_BACKBONES.values() if spec.paper_key}
    out = []
    for entry in paper_data.TABLE_S1:
        spec = by_key[entry.backbone]
        n = spec.default_tokens
        extra: dict[str, int] = {}
        if options.lm_head:
            extra["lm_head"] = fx.lm_head_flops(spec.lm)
        if options.vision_tower:
            extra["vision_tower"] = sum(vision_terms(spec, resolve_tokens(spec, None, None))[0].values())
        row = build_row(spec, entry.method, n, entry.tokens, options, extra)
        assert entry.tflops is not None
        out.append({
            "backbone": entry.backbone, "method": entry.method, "tokens": entry.tokens, "rate": entry.rate,
            "paper_tflops": entry.tflops, "tflops": row["tflops"], "terms": row["terms"],
            "diff": row["tflops"] - entry.tflops, "diff_pct": 100 * (row["tflops"] - entry.tflops) / entry.tflops,
        })  # fmt: skip
    return out


def flops_report(
    spec: BackboneSpec,
    *,
    tokens: int | None = None,
    image: tuple[int, int] | None = None,
    keeps: Sequence[int] = (),
    ratios: Sequence[float] = (),
    methods: Sequence[str] = ("care",),
    options: FlopsOptions | None = None,
    paper: bool = False,
) -> dict[str, Any]:
    """Everything `care flops` prints, as one JSON-ready dict (figures in TFLOPs; TMACs added for `macs`)."""
    options = options or FlopsOptions()
    source = resolve_tokens(spec, tokens, image)
    n = source.tokens
    names = resolve_methods(methods, spec.family)
    budgets = resolve_budgets(spec, n, keeps, ratios)
    extra: dict[str, int] = {}
    optional: dict[str, str] = {}
    if options.lm_head:
        extra["lm_head"] = fx.lm_head_flops(spec.lm)
        optional["lm_head"] = f"2·H·V = 2·{spec.lm.hidden}·{spec.lm.vocab}: logits of the last position only"
    if options.vision_tower:
        vision_parts, how = vision_terms(spec, source)
        extra["vision_tower"] = sum(vision_parts.values())
        optional["vision_tower"] = how
    rows = [build_row(spec, "baseline", n, n, options, extra)]
    rows += [build_row(spec, name, n, k, options, extra) for k in budgets for name in names]
    if paper:
        for row in rows:
            attach_paper(row, spec, n)
    backbone = spec.to_dict()
    backbone.update({"tokens": n, "tokens_source": source.how, "tokens_note": source.note,
                     "image_size": list(source.image) if source.image else None,
                     "token_detail": source.count.detail if source.count else None})  # fmt: skip
    report: dict[str, Any] = {
        "command": "flops",
        "backbone": backbone,
        "convention": options.convention,
        "unit": fx.UNITS[options.convention],
        "text_tokens": options.text_tokens,
        "N": n,
        "budgets": budgets,
        "methods": names,
        "options": {**asdict(options), "paper": paper, "optional_terms": optional},
        "formulas": FORMULAS,
        "rows": rows,
    }
    if paper:
        report["paper"] = {
            "table_s1": [asdict(r) for r in paper_data.TABLE_S1],
            "table_s1_vs_ours": table_s1_vs_ours(options),
            "table_1": [asdict(r) for r in paper_data.TABLE_1],
            "matched_backbone": spec.paper_key,
            "gap_analysis": paper_data.gap_analysis(spec, options.text_tokens, options.m) if spec.paper_key else [],
            "note": "Table S1 and Table 1 TFLOPs as printed; the paper does not state how the peers were counted. "
            "Differences are ours (TFLOPs, with the options above) minus the paper.",
        }
    return report
