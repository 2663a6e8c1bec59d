"""The analytic cost terms (Supp. B of the paper as written; docs/design/measures.md §FLOPs), in exact integer FLOPs.

Conventions (every function returns FLOPs; `to_unit` turns them into TFLOPs or TMACs):
- A multiply-add is 2 FLOPs (`FlopCounterMode`'s `2·m·n·k`); a matmul of (a×b)·(b×c) costs 2abc.
- Bias adds, norms, activations, softmax and RoPE cost 0 (as in `FlopCounterMode` and the paper), except the
  LayerNorm *inside a projector* (InternVL's, on 4·d_v channels): it is part of F_M, the function PRCA perturbs, and
  is counted at 7 FLOPs per element (mean, centre, square, variance, normalise, scale, shift); a tangent through it
  (jvp) is counted as one more pass (``LAYER_NORM_FLOPS_PER_ELEMENT``).
- Attention is counted over the full W×W square: no causal halving (as the counters do).
- The O(·) terms of the paper are taken with constant 1, in FLOPs, exactly as written (e.g. `N² d_v`).
- `macs` convention: every figure is the FLOPs figure halved (1 MAC = 2 FLOPs), the O(·) terms included, so
  TMACs = TFLOPs / 2 exactly.

Supp. B as written (N visual tokens, K kept, N_d = N - K, T text tokens, W = T + K, m directions, d_v the pre-projector
token width, H/I the LLM hidden/FFN width, L layers):
    F_score   = 2 m F_M(N) + m N H + N² d_v + K N
    F_res     = N_d K d_v + N_d K
    F_layer   = 8 W H² + 6 W H I + 4 W² H         (`gqa`: 4 W H q + 4 W H kv + 6 W H I + 4 W² q)
    (not in Supp. B: a hybrid decoder's Gated DeltaNet layers cost F_GDN(W), :func:`gated_deltanet_terms`, linear
    in W; an attention output gate adds 2 W H q)
    F_prefill = Σ over the layer schedule of F_layer(T + tokens of that segment)
    F_M(N)    = 2 N Σ_linear (in · out)

Supp. B's 2 m F_M(N) is what the ``fd`` engine runs. The default ``jvp`` engine runs, for LLaVA's projector
(d_v -> d_h -> d_out), F_1(N) + F_1(m) + 2 m N d_h d_out in its place, and for a norm-first projector (the Qwen
mergers, InternVL's) that plus the tangent through the norm (:func:`jvp_response_terms`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from care_core._chunks import TRIANGULAR_BLOCKS, SecondLayer, two_pass_chunk, upper_macs
from care_core.architecture import LanguageModelSpec, ProjectorSpec, VisionSpec

#: how figures are counted: "flops" (1 multiply-add = 2 FLOPs) or "macs" (every figure halved)
Convention = Literal["flops", "macs"]
CONVENTIONS: tuple[Convention, ...] = get_args(Convention)
#: Output columns per tile of the fused jvp kernel (its autotuner's pick for LLaVA's 4096 -> 4096 on H100 and
#: H200, tf32 and bf16): through the triangular factor, each tile skips the hidden units left of it.
FUSED_TILE_COLUMNS = 256
UNITS = {"flops": "TFLOPs", "macs": "TMACs"}


def to_unit(flops: float, convention: Convention = "flops") -> float:
    """FLOPs -> TFLOPs (or TMACs: half of it)."""
    return flops / 1e12 / (2 if convention == "macs" else 1)


# ------------------------------------------------------------------------------------------------ projector
#: FLOPs per element of a projector's LayerNorm: mean (add), centre (sub), square (mul), variance (add),
#: normalise (mul), scale (mul), shift (add)
LAYER_NORM_FLOPS_PER_ELEMENT = 7


def projector_flops(projector: ProjectorSpec, n: int) -> int:
    """F_M(n): the projector's linear layers on n tokens, 2 FLOPs per multiply-add, plus its input LayerNorm
    (InternVL) at :data:`LAYER_NORM_FLOPS_PER_ELEMENT` per element."""
    return 2 * n * projector.macs_per_token + n * LAYER_NORM_FLOPS_PER_ELEMENT * projector.layer_norm


def jvp_response_terms(
    n: int, m: int, projector: ProjectorSpec, second_layer: SecondLayer = "dense", blocks: int | None = None
) -> dict[str, int]:
    """The perturbation responses as the ``jvp`` engine computes them (``care_core.scoring.responses_jvp``).

    A Linear -> activation -> Linear projector (LLaVA's ``mlp2x_gelu``): the first layer once on the N tokens,
    its weight once on the m directions (W1 u, shared by every token), and the second layer on the m·N tangents
    act'(W1 v + b1) ⊙ W1 u. A norm-first projector (the Qwen mergers, InternVL's LayerNorm + MLP;
    ``care_core.norm_first``) adds the tangent through the norm to that: :func:`norm_first_terms`. Any other
    projector goes through ``torch.func.jvp`` at the N tokens, vmapped over chunks of directions
    (``care_core._chunks``): per chunk one primal pass F_M(N), the chunk's tangents, and one more F_M(N) because
    forward-mode AD's product rule (x_t W + x W_t) also multiplies the tokens by the weights' zero tangent:
    (m + 2 · chunks) F_M(N) in all.

    ``second_layer="triangular"`` (what a ``Scorer`` runs on CUDA, e.g. the pipeline's): the second layer goes
    through the factor R of W2 = QR (d_h x d_h upper triangular; where d_out < d_h, d_out x d_h upper trapezoidal)
    in ``blocks`` column blocks, each needing only the hidden units from its first column on:
    ``2mN · upper_macs(rows of R, d_h, blocks)``. ``blocks`` defaults to what runs: the fused kernel's tiles
    (d_h / 256) for a Linear-act-Linear projector with a square R, else the PyTorch path's 4
    (``care_core._chunks``). The one-off QR is not counted (made once per projector, not per image).
    """
    if _is_linear_act_linear(projector) or _is_norm_first(projector):
        (d_in, d_hidden), (_, d_out) = projector.linears
        if _is_norm_first(projector):
            terms = norm_first_terms(n, m, projector)
        else:
            terms = {"F_1(N)": 2 * n * d_in * d_hidden, "F_1(m)": 2 * m * d_in * d_hidden}
        if second_layer == "triangular":
            rows = min(d_out, d_hidden)
            b = blocks if blocks is not None else _factor_blocks(projector)
            shape = "triangle" if rows == d_hidden else "trapezoid"
            terms[f"2mN R-{shape} ({b} blocks)"] = 2 * m * n * upper_macs(rows, d_hidden, b)
        else:
            terms["2mN d_h d_out"] = 2 * m * n * d_hidden * d_out
        return terms
    chunks = math.ceil(m / two_pass_chunk(m, n, projector.token_dim, projector.out_dim))
    f_m = projector_flops(projector, n)
    return {"mF_M(N) tangents": m * f_m, "F_M(N) primal per chunk": chunks * f_m,
            "F_M(N) zero tangent per chunk": chunks * f_m}  # fmt: skip


def norm_first_terms(n: int, m: int, projector: ProjectorSpec) -> dict[str, int]:
    """The first layer's tangents through the norm (``care_core.norm_first.first_layer``), B = ``norm_blocks``:
    the per-block products W1_b (g ⊙ x̂_ib) on the N tokens (``F_1(N)``), W1 on the m directions (``F_1(m)``),
    W1 β once where the norm shifts (``F_1(1) shift``), the inner products ⟨x̂_ib, t_jb⟩ (``2mN d_v``), and the
    combination Σ_b (1/s_ib) [W1_b (g ⊙ t_jb) - c_ijb W1_b (g ⊙ x̂_ib)] as two products with B inner terms
    (``4mN B d_h``). A LayerNorm counted in F_M (InternVL's) is counted once more, on the N tokens' forward."""
    (d_in, d_hidden), _ = projector.linears
    terms = {"F_1(N)": 2 * n * d_in * d_hidden, "F_1(m)": 2 * m * d_in * d_hidden}
    if projector.norm_shift:
        terms["F_1(1) shift"] = 2 * d_in * d_hidden
    terms["2mN d_v <x^, t>"] = 2 * m * n * d_in
    terms["4mN B d_h combine"] = 4 * m * n * projector.norm_blocks * d_hidden
    if projector.layer_norm:
        terms["LayerNorm(N)"] = n * LAYER_NORM_FLOPS_PER_ELEMENT * projector.layer_norm
    return terms


def _is_linear_act_linear(projector: ProjectorSpec) -> bool:
    """The projectors the jvp engine scores on its MLP path (``care_core.scoring._as_mlp``)."""
    return projector.kind == "mlp2x_gelu" and len(projector.linears) == 2


def _is_norm_first(projector: ProjectorSpec) -> bool:
    """The projectors the jvp engine scores on its norm-first path (``care_core.scoring._as_norm_first``)."""
    return projector.norm_blocks > 0 and len(projector.linears) == 2


def _factor_blocks(projector: ProjectorSpec) -> int:
    """Column blocks of R the jvp engine runs: the fused kernel's tiles for a Linear-act-Linear projector with a
    square R (``care_core.scoring._fused_jvp_applies``), else the PyTorch path's."""
    (_, d_hidden), (_, d_out) = projector.linears
    if _is_linear_act_linear(projector) and d_out >= d_hidden:
        return max(1, d_hidden // FUSED_TILE_COLUMNS)
    return TRIANGULAR_BLOCKS


def _through_factor(projector: ProjectorSpec, second_layer: SecondLayer) -> bool:
    """Whether the jvp engine's second layer runs through W2's factor R (MLP and norm-first paths)."""
    return second_layer == "triangular" and (_is_linear_act_linear(projector) or _is_norm_first(projector))


def jvp_response_note(projector: ProjectorSpec, second_layer: SecondLayer = "dense") -> str:
    """One line on what :func:`jvp_response_terms` counts for this projector."""
    if _is_norm_first(projector):
        second = (
            f"the second layer through W2's factor R (W2 = QR, ||W2 t|| = ||R t||) in {TRIANGULAR_BLOCKS} column "
            "blocks, each from its first hidden unit on"
            if _through_factor(projector, second_layer)
            else "2mN d_h d_out (second layer on the m·N tangents)"
        )
        return (
            "responses as the jvp engine runs them for a norm-first projector: F_1(N) + F_1(m) + the tangent "
            f"through the norm (2mN d_v + 4mN B d_h, B = {projector.norm_blocks} blocks normalised apart) + {second}, "
            "in place of Supp. B's 2mF_M(N)"
        )
    if _through_factor(projector, second_layer):
        return (
            "responses as the jvp engine runs them with a Scorer on CUDA: F_1(N) + F_1(m) + the second layer through "
            f"its triangular factor R (W2 = QR, ||W2 t|| = ||R t||) in blocks of {FUSED_TILE_COLUMNS} columns, each "
            "from its first hidden unit on, in place of Supp. B's 2mF_M(N)"
        )
    if _is_linear_act_linear(projector):
        return (
            "responses as the jvp engine runs them: F_1(N) (first layer on the N tokens) + F_1(m) (W1 on the "
            "m directions) + 2mN d_h d_out (second layer on the m·N tangents), in place of Supp. B's 2mF_M(N)"
        )
    return (
        "responses as the jvp engine runs them: torch.func.jvp at the N tokens, vmapped over chunks of directions: "
        "mF_M(N) for the tangents, plus per chunk a primal pass and a product with the weights' zero tangent "
        "(F_M(N) each), in place of Supp. B's 2mF_M(N)"
    )


def score_terms(n: int, k: int, m: int, projector: ProjectorSpec, hidden: int) -> dict[str, int]:
    """Eq. score_flops as Supp. B writes it (the responses as the ``fd`` engine runs them): perturbation responses
    through M, their magnitudes, pairwise diversity, greedy selection. ``care_core.flops.methods.method_cost``
    puts :func:`jvp_response_terms` in place of 2 m F_M(N) for the jvp engine."""
    return {
        "2mF_M(N)": 2 * m * projector_flops(projector, n),
        "mNH": m * n * hidden,
        "N^2 d_v": n * n * projector.token_dim,
        "KN": k * n,
    }


def residual_terms(n: int, k: int, token_dim: int) -> dict[str, int]:
    """Eq. residual_flops: residual-anchor affinity and the scalar gate/weight/fusion work."""
    n_d = n - k
    return {"N_d K d_v": n_d * k * token_dim, "N_d K": n_d * k}


# ------------------------------------------------------------------------------------------------ prefill
@dataclass(frozen=True)
class LayerTerms:
    projections: int  # q, k, v, o (a Gated DeltaNet layer: its in_proj_* and out_proj)
    ffn: int  # gate, up, down
    attention: int  # QK^T and AV (a Gated DeltaNet layer: its causal conv and chunked delta rule)

    @property
    def total(self) -> int:
        return self.projections + self.ffn + self.attention


def layer_terms(w: int, lm: LanguageModelSpec, gqa: bool = False) -> LayerTerms:
    """One attention decoder layer on a W-token sequence: 8WH² + 6WHI + 4W²H (GQA-aware when `gqa`); an output gate
    (``attention_output_gate``: q_proj twice as wide) adds 2WHq (2WH² without `gqa`)."""
    h, i = lm.hidden, lm.intermediate
    if gqa:
        projections = 4 * w * h * lm.q_dim + 4 * w * h * lm.kv_dim  # q and o: H <-> q_dim; k and v: H -> kv_dim
        attention = 4 * w * w * lm.q_dim
    else:
        projections = 8 * w * h * h
        attention = 4 * w * w * h
    if lm.attention_output_gate:
        projections += 2 * w * h * (lm.q_dim if gqa else h)
    return LayerTerms(projections, 6 * w * h * i, attention)


def layer_flops(w: int, lm: LanguageModelSpec, gqa: bool = False) -> int:
    return layer_terms(w, lm, gqa).total


def gated_deltanet_terms(w: int, lm: LanguageModelSpec, padded: bool = True) -> LayerTerms:
    """One Gated DeltaNet layer (``linear_attention``) on W rows, as transformers' torch fallback runs its prefill.

    Projections 2WH(2kd + vd) (in_proj_qkv) + 2WH vd (in_proj_z) + 4WH n_v (in_proj_b, in_proj_a) + 2W vd H
    (out_proj); the depthwise causal conv 2(2kd + vd) k (W + k - 1) (it runs over W + k - 1 positions); the chunked
    delta rule, per value head on W_p = W padded to whole chunks of C: 4 W_p C d_k (k_beta kᵀ, q kᵀ) + 6 W_p d_k d_v
    (the state products) + 2 W_p C d_v (the intra-chunk product with v). kd = n_k d_k, vd = n_v d_v. The two
    triangular solves and all elementwise work (decays, gates, norms) cost 0, as ``FlopCounterMode`` counts them.
    ``padded=False``: W in place of W_p (a quadratic in W; :func:`equivalent_tokens`)."""
    lin = lm.linear_attention
    if lin is None:
        raise ValueError("this language model has no Gated DeltaNet layers (linear_attention is None)")
    h, kd, vd, k, c = lm.hidden, lin.key_dim, lin.value_dim, lin.conv_kernel, lin.chunk
    projections = 2 * w * h * (2 * kd + vd) + 2 * w * h * vd + 4 * w * h * lin.value_heads + 2 * w * vd * h
    conv = 2 * (2 * kd + vd) * k * (w + k - 1) if w else 0
    rows = -(-w // c) * c if padded else w
    d_k, d_v = lin.key_head_dim, lin.value_head_dim
    rule = lin.value_heads * rows * (4 * c * d_k + 6 * d_k * d_v + 2 * c * d_v)
    return LayerTerms(projections, 6 * w * h * lm.intermediate, conv + rule)


Schedule = tuple[tuple[int, int], ...]  # (number of consecutive layers, visual tokens in them)


def uniform_schedule(lm: LanguageModelSpec, tokens: int) -> Schedule:
    return ((lm.layers, tokens),)


def check_schedule(schedule: Sequence[tuple[int, int]], lm: LanguageModelSpec) -> Schedule:
    layers = sum(n for n, _ in schedule)
    if layers != lm.layers or any(n < 0 or t < 0 for n, t in schedule):
        raise ValueError(f"schedule {list(schedule)} must cover exactly {lm.layers} layers with tokens >= 0")
    return tuple((int(n), int(t)) for n, t in schedule if n > 0)


def schedule_layers(schedule: Schedule, lm: LanguageModelSpec) -> list[tuple[int, int, int]]:
    """Per segment of the schedule: (attention layers, Gated DeltaNet layers, visual tokens), the segments taking the
    layers in order from layer 0."""
    linear = set(lm.linear_layers)
    out, start = [], 0
    for n, t in schedule:
        in_linear = sum(1 for i in range(start, start + n) if i in linear)
        out.append((n - in_linear, in_linear, t))
        start += n
    return out


def _schedule_terms(schedule: Schedule, lm: LanguageModelSpec, text_tokens: int, gqa: bool,
                    padded: bool = True) -> list[tuple[int, LayerTerms]]:  # fmt: skip
    """(layer count, one layer's terms) for every kind of layer in every segment of the schedule."""
    parts = []
    for full, linear, t in schedule_layers(schedule, lm):
        if full:
            parts.append((full, layer_terms(text_tokens + t, lm, gqa)))
        if linear:
            parts.append((linear, gated_deltanet_terms(text_tokens + t, lm, padded)))
    return parts


def prefill_flops(schedule: Schedule, lm: LanguageModelSpec, text_tokens: int, gqa: bool = False) -> int:
    """F_prefill = Σ_segments Σ_layers F_layer(T + tokens), each layer by its kind (attention or Gated DeltaNet)."""
    return sum(n * p.total for n, p in _schedule_terms(schedule, lm, text_tokens, gqa))


def prefill_breakdown(schedule: Schedule, lm: LanguageModelSpec, text_tokens: int, gqa: bool = False) -> dict:
    parts = _schedule_terms(schedule, lm, text_tokens, gqa)
    return {
        "projections": sum(n * p.projections for n, p in parts),
        "ffn": sum(n * p.ffn for n, p in parts),
        "attention": sum(n * p.attention for n, p in parts),
    }


def layer_average_tokens(schedule: Schedule) -> float:
    """The plain average of visual tokens over layers (the SparseVLM / VisionZip convention)."""
    layers = sum(n for n, _ in schedule)
    return sum(n * t for n, t in schedule) / layers


def equivalent_tokens(schedule: Schedule, lm: LanguageModelSpec, text_tokens: int, gqa: bool = False) -> float:
    """The visual token count K' whose uniform prefill costs what the schedule costs.

    Solves F(T + K') = Σ_layers F_layer(T + tokens of the layer), where F(W) = Σ_layers F_layer(W) = a W² + b W + c
    is a quadratic in W. Gated DeltaNet layers are taken without the padding to whole chunks on both sides (the
    padding makes F a step function of W; without it, a uniform schedule of K tokens gives back K exactly).
    """
    total = sum(n * p.total for n, p in _schedule_terms(schedule, lm, text_tokens, gqa, padded=False))
    whole = uniform_schedule(lm, 0)

    def uniform(w: int) -> int:
        return sum(n * p.total for n, p in _schedule_terms(whole, lm, w, gqa, padded=False))

    one, two, three = uniform(1), uniform(2), uniform(3)
    a = (three - 2 * two + one) / 2  # F(1) = a + b + c, F(2) = 4a + 2b + c, F(3) = 9a + 3b + c
    b = two - one - 3 * a
    c = one - a - b - total
    w = (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a) if a else -c / b
    return w - text_tokens


# ------------------------------------------------------------------------------------------------ optional
def lm_head_flops(lm: LanguageModelSpec) -> int:
    """Logits for the last position only (what `generate` computes in prefill: `logits_to_keep=1`): 2 H V."""
    return 2 * lm.hidden * lm.vocab


def clip_tower_flops(vision: VisionSpec, crops: int = 1, cls_tokens: int = 1) -> dict[str, int]:
    """CLIP (or SigLIP) ViT, per crop: patch conv + the encoder layers care runs (:attr:`VisionSpec.layers_counted`:
    up to the deepest feature layer the model reads; transformers' own model runs them all).

    Per layer on T = patches + ``cls_tokens`` (CLIP: 1; SigLIP: patches only) tokens: 8 T d² (q, k, v, o)
    + 4 T d I (fc1, fc2) + 4 T² d (QK^T, AV).
    """
    patches = (vision.image_size // vision.patch_size) ** 2
    t, d = patches + cls_tokens, vision.hidden
    conv = 2 * patches * d * vision.in_channels * vision.patch_size**2
    layer = 8 * t * d * d + 4 * t * d * vision.intermediate + 4 * t * t * d
    return {"patch_embed": crops * conv, "layers": crops * vision.layers_counted * layer}


def qwen_window_sizes(rows: int, cols: int, vision: VisionSpec) -> list[int]:
    """Patches per attention window of the Qwen2.5-VL ViT for a merged grid rows×cols (edge windows are smaller)."""
    merge = vision.spatial_merge_size
    side = vision.window_size // merge // vision.patch_size  # window side in merged units (112 // 2 // 14 = 4)
    sizes = []
    for r0 in range(0, rows, side):
        for c0 in range(0, cols, side):
            sizes.append(min(side, rows - r0) * min(side, cols - c0) * merge * merge)
    return sizes


def qwen3_tower_flops(vision: VisionSpec, rows: int, cols: int) -> dict[str, int]:
    """Qwen3-VL ViT on one image whose merged grid is rows×cols (P = 4·rows·cols patches, N = rows·cols), main
    merger excluded (it is F_M).

    Patch embed Conv3d, per block 8 P d² (qkv, proj) + 4 P d I (Linear -> GELU -> Linear, not SwiGLU) and full
    attention 4 P² d (no windows); the deepstack mergers run here, before any reduction, on all N groups: each
    2 N (16 d² + 4 d · out) (the merger's two linears on 4 d; its LayerNorm costs 0 like every norm).
    """
    merge = vision.spatial_merge_size
    patches = rows * cols * merge * merge
    d, width = vision.hidden, vision.hidden * merge * merge
    kernel = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    per_merger = 2 * rows * cols * (width * width + width * vision.out_hidden)
    return {
        "patch_embed": 2 * patches * kernel * d,
        "linears": vision.layers * (8 * patches * d * d + 4 * patches * d * vision.intermediate),
        "attention": vision.layers * 4 * patches * patches * d,
        "deepstack_mergers": len(vision.deepstack_layers) * per_merger,
    }


def qwen_tower_flops(vision: VisionSpec, rows: int, cols: int) -> dict[str, int]:
    """Qwen2.5-VL ViT on one image whose merged grid is rows×cols (P = 4·rows·cols patches), merger excluded.

    Patch embed Conv3d (in·t·p² -> d), per block 8 P d² (qkv, proj) + 6 P d I (SwiGLU), attention 4 s² d per
    window of s patches in windowed blocks and 4 P² d in the full-attention blocks.
    """
    merge = vision.spatial_merge_size
    patches = rows * cols * merge * merge
    d = vision.hidden
    kernel = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    windows = qwen_window_sizes(rows, cols, vision)
    full_blocks = len([i for i in vision.full_attention_layers if 0 <= i < vision.layers])
    window_blocks = vision.layers - full_blocks
    return {
        "patch_embed": 2 * patches * kernel * d,
        "linears": vision.layers * (8 * patches * d * d + 6 * patches * d * vision.intermediate),
        "attention": full_blocks * 4 * patches * patches * d + window_blocks * sum(4 * s * s * d for s in windows),
    }


@dataclass(frozen=True)
class CropTower:
    """A tower that sees crops of one fixed side, each through every layer: its FLOPs for ``crops`` of them."""

    label: str  # how the report names it
    flops: Callable[[VisionSpec, int], dict[str, int]]


@dataclass(frozen=True)
class GridTower:
    """A tower that sees one image at its own size: its FLOPs for a merged grid of rows×cols tokens."""

    label: str  # how the report names it; {deepstack}: the number of its deepstack mergers
    flops: Callable[[VisionSpec, int, int], dict[str, int]]


#: how the optional vision-tower term counts each VisionSpec.kind (a new family with one of these kinds needs no edit)
VISION_TOWERS: dict[str, CropTower | GridTower] = {
    "clip": CropTower("CLIP ViT", clip_tower_flops),
    "siglip": CropTower("SigLIP ViT (no CLS)", functools.partial(clip_tower_flops, cls_tokens=0)),
    # counted on its patches alone, as first written (its CLS is 1 token of 1025 per tile)
    "internvit": CropTower("InternViT (pixel shuffle and projector in F_M)",
                           functools.partial(clip_tower_flops, cls_tokens=0)),
    "qwen2.5-vit": GridTower("Qwen2.5-VL ViT, merger excluded (counted as F_M)", qwen_tower_flops),
    "qwen3-vit": GridTower("Qwen3-VL ViT with its {deepstack} deepstack mergers on all N, main merger excluded "
                           "(counted as F_M)", qwen3_tower_flops),
}  # fmt: skip
