"""Backbone specs for analytic FLOPs: the published config numbers, frozen, plus `from_config(path)`.

Sources of the numbers (each checked against a stored copy of the hub file where one was found):
- LLaVA-1.5-7B  `llava-hf/llava-1.5-7b-hf/config.json`: `text_config` names `lmsys/vicuna-7b-v1.5` and sets only
  `vocab_size: 32064`, so the rest are `LlamaConfig` defaults (L=32, H=4096, I=11008, 32 heads, 32 KV heads);
  `vision_config`: CLIP-L/14-336 (hidden 1024, intermediate 4096, 24 layers, 16 heads, image 336, patch 14);
  `vision_feature_layer: -2`, `vision_feature_select_strategy: "default"`, `projector_hidden_act: "gelu"`.
  Projector `LlavaMultiModalProjector`: Linear(1024, H) -> GELU -> Linear(H, H).
- LLaVA-1.5-13B `llava-hf/llava-1.5-13b-hf`: Vicuna-13B-v1.5, L=40, H=5120, I=13824, 40 heads (MHA), vocab 32064.
- LLaVA-NeXT-7B/13B `llava-hf/llava-v1.6-vicuna-{7,13}b-hf`: the same language models and CLIP tower,
  `image_grid_pinpoints` [[336,672],[672,336],[672,672],[1008,336],[336,1008]] (height, width).
- Qwen2.5-VL-7B `Qwen/Qwen2.5-VL-7B-Instruct/config.json`: L=28, H=3584, I=18944, 28 heads, 4 KV heads,
  vocab 152064; `vision_config`: depth 32, hidden 1280, intermediate 3420, 16 heads, out_hidden_size 3584,
  patch 14, spatial_merge_size 2, window_size 112, fullatt_block_indexes [7, 15, 23, 31], temporal_patch_size 2.
  Merger `Qwen2_5_VLPatchMerger`: RMSNorm(1280) -> view(-1, 5120) -> Linear(5120, 5120) -> GELU -> Linear(5120, out).
- Qwen2.5-VL-3B `Qwen/Qwen2.5-VL-3B-Instruct/config.json`: L=36, H=2048, I=11008, 16 heads, 2 KV heads,
  vocab 151936, out_hidden_size 2048 (vision tower as the 7B).
- Qwen2.5-VL processor (`preprocessor_config.json`): min_pixels 3136, max_pixels 12845056.
- Qwen3-VL-8B `Qwen/Qwen3-VL-8B-Instruct`: **not checked against a stored copy of the hub file** (none was found).
  From transformers' `Qwen3VLVisionConfig` class defaults (5.21-5.24): vision depth 27, hidden 1152, intermediate
  4304, 16 heads, patch 16, spatial_merge_size 2, temporal_patch_size 2, deepstack_visual_indexes (8, 16, 24), full
  attention in every block (no windows), MLP Linear -> GELU -> Linear (not SwiGLU). Unverified hub values: text
  L=36, H=4096, I=12288, 32 heads, 8 KV heads, head_dim 128, vocab 151936, vision out_hidden_size 4096 (the class
  default is 3584), processor pixel budget 65536..16777216. `from_config` on the real config.json gives exact dims.
  Merger `Qwen3VLVisionPatchMerger`: LayerNorm(1152) -> view(-1, 4608) -> Linear(4608, 4608) -> GELU ->
  Linear(4608, out); each deepstack merger is the same MLP after a LayerNorm(4608).
- InternVL3-8B (`OpenGVLab/InternVL3-8B-hf`; **no hub file was checked**: the numbers are the published model card's
  architecture -- InternViT-300M-448px-V2.5 + Qwen2.5-7B -- and transformers' ``InternVLVisionConfig`` /
  ``InternVLConfig`` defaults, which are InternViT-300M's): vision 24 layers, hidden 1024, MLP 4096, 16 heads,
  image 448, patch 14, CLS, ``downsample_ratio`` 0.5 (pixel shuffle: 256 tokens of 4096 channels per tile),
  ``vision_feature_layer`` -1; LM Qwen2.5-7B: L=28, H=3584, I=18944, 28 heads, 4 KV heads; vocab 151674
  (unverified: the InternVL3 tokenizer's size; the LM head term alone depends on it). Projector
  ``InternVLMultiModalProjector``: LayerNorm(4096) -> Linear(4096, 3584) -> GELU -> Linear(3584, 3584). Tiles: the
  ``GotOcr2ImageProcessor`` class defaults min_patches 1, max_patches 12 (the hub's ``max_patches`` unverified).
- LLaVA-OneVision-7B `llava-hf/llava-onevision-qwen2-7b-ov-hf` (no hub file was checked: the numbers are
  transformers' `LlavaOnevisionConfig` defaults and the published Qwen2-7B / SigLIP-so400m dims): SigLIP-so400m
  384/14 (hidden 1152, intermediate 4304, 16 heads, 729 patches, no CLS) with **26** layers, the class default
  (so400m has 27; the conversion keeps 26 because the original LLaVA-OneVision reads the penultimate layer, which
  transformers reads as layer -1); strategy "full"; `vision_aspect_ratio` "anyres_max_9"; 36 pinpoints 384..2304 in
  steps of 384. Qwen2-7B: L=28, H=3584, I=18944, 28 heads, 4 KV heads, vocab 152064 (unconfirmed for the hf
  checkpoint, whose tokenizer adds <image>/<video>). Projector `LlavaOnevisionMultiModalProjector`:
  Linear(1152, 3584) -> GELU -> Linear(3584, 3584).
"""

from __future__ import annotations

import difflib
import json
from dataclasses import asdict, dataclass, field, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

from care_core.backbones.families import backbone_family, families, model_types
from care_core.backbones.geometry import anyres_max_crops
from care_core.errors import CareError, ModelLoadError, one_line
from care_core.flops.tokens import visual_tokens


class BackboneSpecError(ModelLoadError):
    """An unknown backbone name, or a config.json that cannot be turned into a spec."""


@dataclass(frozen=True)
class LanguageModelSpec:
    """The decoder-only language model: L layers of attention + SwiGLU FFN."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: int = 0  # 0: hidden // heads

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


@dataclass(frozen=True)
class ProjectorSpec:
    """The multimodal projector M: its linear layers (in, out); activations and norms cost nothing here."""

    kind: str  # "mlp2x_gelu" (LLaVA), "qwen2.5-vl merger", "qwen3-vl merger" or "internvl ln+mlp"
    token_dim: int  # d_v: the width of one visual token as the reduction sees it (pre-projector)
    linears: tuple[tuple[int, int], ...]
    layer_norm: int = 0  # width of a LayerNorm on the input before the linears (InternVL: 4096); 0 = none
    # norm-first projectors (care_core.norm_first): the input's blocks normalised on their own before the first
    # linear (the Qwen mergers: 4 patches; InternVL: 1, the whole row), 0 = no norm first; whether the norm shifts
    norm_blocks: int = 0
    norm_shift: bool = False

    @property
    def out_dim(self) -> int:
        return self.linears[-1][1]

    @property
    def macs_per_token(self) -> int:
        return sum(i * o for i, o in self.linears)


@dataclass(frozen=True)
class VisionSpec:
    """The vision tower (only for the optional `vision_tower` term)."""

    kind: str  # "clip", "siglip" (no CLS), "qwen2.5-vit", "qwen3-vit" or "internvit" (CLIP-like, CLS, 448 px tiles)
    layers: int
    hidden: int
    intermediate: int
    heads: int
    patch_size: int
    image_size: int = 0  # CLIP: the square input side
    in_channels: int = 3
    temporal_patch_size: int = 1
    spatial_merge_size: int = 1
    window_size: int = 0  # Qwen: window side in pixels
    full_attention_layers: tuple[int, ...] = ()
    feature_tokens: int = 0  # CLIP: patch tokens handed on per crop (CLS dropped with strategy "default")
    deepstack_layers: tuple[int, ...] = ()  # Qwen3-VL: blocks whose output a deepstack merger merges
    out_hidden: int = 0  # Qwen3-VL: the deepstack mergers' output width (the language model's hidden size)


@dataclass(frozen=True)
class BackboneSpec:
    name: str  # registry name, e.g. "llava-1.5-7b", or "config:<path>"
    display: str  # e.g. "LLaVA-1.5-7B"
    family: str  # its family's name in care_core.backbones.families: "llava-1.5", "llava-next", "qwen2.5-vl", ...
    lm: LanguageModelSpec
    projector: ProjectorSpec
    vision: VisionSpec
    default_tokens: int
    default_tokens_note: str
    default_image: tuple[int, int] | None = None  # (height, width) that gives default_tokens, where one exists
    grid_pinpoints: tuple[tuple[int, int], ...] = ()
    min_pixels: int = 0
    max_pixels: int = 0
    max_tiles: int = 0  # InternVL: most 448 px tiles per image (GotOcr2 max_patches; min_patches is 1)
    max_crops: int = 0  # LLaVA-OneVision's anyres_max_<crops>: the model pools its grid beyond it (0: no pooling)
    paper_budgets: tuple[int, ...] = ()  # the paper's budgets (K) at default_tokens; the default budgets
    paper_key: str | None = None  # Table S1 / Table 1 backbone name, when these are the paper's dims
    source: str = ""
    aliases: tuple[str, ...] = field(default=(), compare=False)

    def default_budget_fractions(self) -> tuple[Fraction, ...]:
        return tuple(Fraction(k, self.default_tokens) for k in self.paper_budgets)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("aliases")
        data["lm"]["q_dim"], data["lm"]["kv_dim"] = self.lm.q_dim, self.lm.kv_dim
        data["projector"]["out_dim"] = self.projector.out_dim
        return data


_CLIP_L336 = VisionSpec(kind="clip", layers=24, hidden=1024, intermediate=4096, heads=16, patch_size=14,
                        image_size=336, feature_tokens=576)  # fmt: skip
_QWEN_VIT = VisionSpec(kind="qwen2.5-vit", layers=32, hidden=1280, intermediate=3420, heads=16, patch_size=14,
                       temporal_patch_size=2, spatial_merge_size=2, window_size=112,
                       full_attention_layers=(7, 15, 23, 31))  # fmt: skip
_QWEN3_VIT = VisionSpec(kind="qwen3-vit", layers=27, hidden=1152, intermediate=4304, heads=16, patch_size=16,
                        temporal_patch_size=2, spatial_merge_size=2, full_attention_layers=tuple(range(27)),
                        deepstack_layers=(8, 16, 24), out_hidden=4096)  # fmt: skip
_INTERNVIT_300M = VisionSpec(kind="internvit", layers=24, hidden=1024, intermediate=4096, heads=16, patch_size=14,
                             image_size=448, feature_tokens=256)  # fmt: skip
_VICUNA_7B = LanguageModelSpec(layers=32, hidden=4096, intermediate=11008, heads=32, kv_heads=32, vocab=32064)
_VICUNA_13B = LanguageModelSpec(layers=40, hidden=5120, intermediate=13824, heads=40, kv_heads=40, vocab=32064)
_QWEN25_7B = LanguageModelSpec(layers=28, hidden=3584, intermediate=18944, heads=28, kv_heads=4, vocab=152064)
_QWEN2_7B = LanguageModelSpec(layers=28, hidden=3584, intermediate=18944, heads=28, kv_heads=4, vocab=152064)
_SIGLIP_SO400M_384 = VisionSpec(kind="siglip", layers=26, hidden=1152, intermediate=4304, heads=16, patch_size=14,
                                image_size=384, feature_tokens=729)  # fmt: skip
_QWEN25_3B = LanguageModelSpec(layers=36, hidden=2048, intermediate=11008, heads=16, kv_heads=2, vocab=151936)
_QWEN3_8B = LanguageModelSpec(layers=36, hidden=4096, intermediate=12288, heads=32, kv_heads=8, vocab=151936,
                              head_dim=128)  # fmt: skip
_INTERNVL3_8B_LM = LanguageModelSpec(layers=28, hidden=3584, intermediate=18944, heads=28, kv_heads=4, vocab=151674)
INTERNVL_MAX_TILES = 12
NEXT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))
QWEN_MIN_PIXELS, QWEN_MAX_PIXELS = 3136, 12845056
QWEN3_MIN_PIXELS, QWEN3_MAX_PIXELS = 65536, 16777216  # unverified hub budget (see the module docstring)
ONEVISION_PINPOINTS = tuple((h, w) for h in range(384, 2305, 384) for w in range(384, 2305, 384))
ONEVISION_MAX_CROPS = 9


def _llava_projector(hidden: int, token_dim: int = 1024) -> ProjectorSpec:
    return ProjectorSpec(kind="mlp2x_gelu", token_dim=token_dim, linears=((token_dim, hidden), (hidden, hidden)))


def _qwen_merger(out: int, vit_hidden: int = 1280, merge: int = 2, kind: str = "qwen2.5-vl merger") -> ProjectorSpec:
    """A Qwen merger (Qwen2.5-VL: RMSNorm per patch; Qwen3-VL: LayerNorm per patch, with a shift; norms cost 0):
    the MLP on the 4 · d_v group."""
    width = vit_hidden * merge * merge
    return ProjectorSpec(kind=kind, token_dim=width, linears=((width, width), (width, out)), norm_blocks=merge * merge,
                         norm_shift=kind == "qwen3-vl merger")  # fmt: skip


def _internvl_projector(hidden: int, vit_hidden: int = 1024, shuffle: int = 2) -> ProjectorSpec:
    width = vit_hidden * shuffle * shuffle
    return ProjectorSpec(kind="internvl ln+mlp", token_dim=width, linears=((width, hidden), (hidden, hidden)),
                         layer_norm=width, norm_blocks=1, norm_shift=True)  # fmt: skip


_LLAVA15_NOTE = "LLaVA-1.5: 576 patch tokens of one 336×336 view, whatever the image size"
_NEXT_NOTE = "LLaVA-NeXT at 672×672: 576 base + 2304 unpadded high-res tokens, no newline rows (paper's N)"
_ONEVISION_NOTE = (
    "LLaVA-OneVision at 768×768: 729 base + 2916 unpadded high-res tokens, no newline rows, no pooling (ratio ≤ 1.1)"
)
#: LLaVA-NeXT's paper fractions (640, 320, 160 of 2880) at OneVision's 3645: the paper has no OneVision rows
_ONEVISION_BUDGETS = (810, 405, 202)
_QWEN_NOTE = "Qwen2.5-VL: the paper's representative sample of 1110 merged tokens (Table S1 caption)"
_QWEN3_NOTE = "Qwen3-VL at 1024×1024: a 32×32 merged grid (not a paper setting; budgets 20 % and 10 % of N)"
_QWEN3_8B_NOTE = f"{_QWEN3_NOTE}; text sizes, out_hidden_size and pixel budget unverified"
_INTERNVL_NOTE = "InternVL3 at 672×672: 2×2 tiles + thumbnail, 256 pixel-shuffled tokens each (not a paper backbone)"

KNOWN_BACKBONES: dict[str, BackboneSpec] = {
    spec.name: spec
    for spec in (
        BackboneSpec(
            "llava-1.5-7b", "LLaVA-1.5-7B", "llava-1.5", _VICUNA_7B, _llava_projector(4096), _CLIP_L336,
            576, _LLAVA15_NOTE, (336, 336), paper_budgets=(192, 128, 64), paper_key="LLaVA-1.5-7B",
            source="llava-hf/llava-1.5-7b-hf config.json (Vicuna-7B-v1.5 = LlamaConfig defaults)",
            aliases=("llava15", "llava-v1.5-7b", "llava-hf/llava-1.5-7b-hf", "liuhaotian/llava-v1.5-7b"),
        ),
        BackboneSpec(
            "llava-1.5-13b", "LLaVA-1.5-13B", "llava-1.5", _VICUNA_13B, _llava_projector(5120), _CLIP_L336,
            576, _LLAVA15_NOTE, (336, 336), paper_budgets=(192, 128, 64),
            source="llava-hf/llava-1.5-13b-hf config.json (Vicuna-13B-v1.5)",
            aliases=("llava-v1.5-13b", "llava-hf/llava-1.5-13b-hf", "liuhaotian/llava-v1.5-13b"),
        ),
        BackboneSpec(
            "llava-next-7b", "LLaVA-NeXT-7B", "llava-next", _VICUNA_7B, _llava_projector(4096), _CLIP_L336,
            2880, _NEXT_NOTE, (672, 672), NEXT_PINPOINTS, paper_budgets=(640, 320, 160), paper_key="LLaVA-NeXT-7B",
            source="llava-hf/llava-v1.6-vicuna-7b-hf config.json",
            aliases=("llava-1.6", "llava-v1.6-vicuna-7b", "llava-1.6-7b",
                     "llava-hf/llava-v1.6-vicuna-7b-hf", "liuhaotian/llava-v1.6-vicuna-7b"),
        ),
        BackboneSpec(
            "llava-next-13b", "LLaVA-NeXT-13B", "llava-next", _VICUNA_13B, _llava_projector(5120), _CLIP_L336,
            2880, _NEXT_NOTE, (672, 672), NEXT_PINPOINTS, paper_budgets=(640, 320, 160),
            source="llava-hf/llava-v1.6-vicuna-13b-hf config.json",
            aliases=("llava-v1.6-vicuna-13b", "llava-1.6-13b", "llava-hf/llava-v1.6-vicuna-13b-hf",
                     "liuhaotian/llava-v1.6-vicuna-13b"),
        ),
        BackboneSpec(
            "llava-onevision-7b", "LLaVA-OneVision-7B", "llava-onevision", _QWEN2_7B, _llava_projector(3584, 1152),
            _SIGLIP_SO400M_384, 3645, _ONEVISION_NOTE, (768, 768), ONEVISION_PINPOINTS, max_crops=ONEVISION_MAX_CROPS,
            paper_budgets=_ONEVISION_BUDGETS,
            source="transformers LlavaOnevisionConfig defaults + Qwen2-7B dims (llava-onevision-qwen2-7b-ov-hf, "
                   "hub file not checked)",
            aliases=("llava-onevision-qwen2-7b-ov-hf", "llava-hf/llava-onevision-qwen2-7b-ov-hf", "llava-ov-7b",
                     "lmms-lab/llava-onevision-qwen2-7b-ov"),
        ),
        BackboneSpec(
            "qwen2.5-vl-3b", "Qwen2.5-VL-3B", "qwen2.5-vl", _QWEN25_3B, _qwen_merger(2048), _QWEN_VIT,
            1110, _QWEN_NOTE, None, min_pixels=QWEN_MIN_PIXELS, max_pixels=QWEN_MAX_PIXELS, paper_budgets=(222, 111),
            source="Qwen/Qwen2.5-VL-3B-Instruct config.json",
            aliases=("qwen2.5-vl-3b-instruct", "qwen/qwen2.5-vl-3b-instruct", "qwen25-vl-3b"),
        ),
        BackboneSpec(
            "qwen2.5-vl-7b", "Qwen2.5-VL-7B", "qwen2.5-vl", _QWEN25_7B, _qwen_merger(3584), _QWEN_VIT,
            1110, _QWEN_NOTE, None, min_pixels=QWEN_MIN_PIXELS, max_pixels=QWEN_MAX_PIXELS, paper_budgets=(222, 111),
            paper_key="Qwen2.5-VL-7B", source="Qwen/Qwen2.5-VL-7B-Instruct config.json",
            aliases=("qwen2.5-vl-7b-instruct", "qwen/qwen2.5-vl-7b-instruct", "qwen25-vl"),
        ),
        BackboneSpec(
            "qwen3-vl-8b", "Qwen3-VL-8B", "qwen3-vl", _QWEN3_8B, _qwen_merger(4096, 1152, kind="qwen3-vl merger"),
            _QWEN3_VIT, 1024, _QWEN3_8B_NOTE, (1024, 1024), min_pixels=QWEN3_MIN_PIXELS, max_pixels=QWEN3_MAX_PIXELS,
            paper_budgets=(204, 102),
            source="transformers Qwen3VLVisionConfig defaults; text sizes, out_hidden_size and pixel budget "
                   "unverified (no stored copy of Qwen/Qwen3-VL-8B-Instruct config.json)",
            aliases=("qwen3-vl-8b-instruct", "qwen/qwen3-vl-8b-instruct", "qwen3vl-8b"),
        ),
        BackboneSpec(
            "internvl3-8b", "InternVL3-8B", "internvl3", _INTERNVL3_8B_LM, _internvl_projector(3584),
            _INTERNVIT_300M, 1280, _INTERNVL_NOTE, (672, 672), max_tiles=INTERNVL_MAX_TILES,
            paper_budgets=(256, 128, 64),
            source="OpenGVLab/InternVL3-8B-hf architecture (model card) + transformers InternVL config defaults; "
            "no hub config.json checked",
            aliases=("internvl3-8b-hf", "opengvlab/internvl3-8b-hf", "opengvlab/internvl3-8b"),
        ),
    )
}  # fmt: skip

_ALIASES: dict[str, str] = {alias.lower(): spec.name for spec in KNOWN_BACKBONES.values() for alias in spec.aliases}


def short_names() -> dict[str, str]:
    """Family name -> the spec it stands for (`llava-1.5` -> `llava-1.5-7b`, ...): each family record's
    ``flops_spec``."""
    return {family.name: family.flops_spec for family in families()}


def resolve_backbone(name: str) -> BackboneSpec:
    """A registry name or alias (case-insensitive), a config.json, or a model folder holding one."""
    key = name.strip()
    if not key:
        raise BackboneSpecError("is empty", parameter="backbone")
    lowered = key.lower()
    if lowered in KNOWN_BACKBONES:
        return KNOWN_BACKBONES[lowered]
    if lowered in _ALIASES:
        return KNOWN_BACKBONES[_ALIASES[lowered]]
    if lowered in short_names():
        return KNOWN_BACKBONES[short_names()[lowered]]
    path = Path(key).expanduser()
    if path.exists():
        return from_config(path)
    looks_like_path = key.endswith(".json") or key.startswith((".", "/", "~")) or "\\" in key
    if looks_like_path:
        raise BackboneSpecError(f"no such file or folder: {key}")
    known = [*short_names(), *KNOWN_BACKBONES]
    families = [family for family in short_names() if family.startswith(lowered)]
    if len(families) > 1:  # "llava", "qwen": a family name would be a guess
        raise BackboneSpecError(f"{name!r} is ambiguous: give one of {', '.join(families)} (or a full name such as "
                                f"{short_names()[families[0]]})", parameter="backbone")  # fmt: skip
    # suggestions by the names the error lists: an alias that is close stands for its spec's name
    choices = {**{key: key for key in known}, **_ALIASES}
    close = [choices[match] for match in difflib.get_close_matches(lowered, list(choices), n=3, cutoff=0.5)]
    hint = f"; did you mean {', '.join(dict.fromkeys(close))}?" if close else ""
    raise BackboneSpecError(f"unknown backbone {name!r}{hint} (known: {', '.join(known)}; or a local config.json or "
                            "model folder)")  # fmt: skip


# ---------------------------------------------------------------------------------------------- config.json


def _load_json(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise BackboneSpecError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise BackboneSpecError(f"{path} is not UTF-8 text") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno}, column {exc.colno}"
        raise BackboneSpecError(f"{path} is not valid JSON ({where}: {exc.msg})") from None
    if not isinstance(data, dict):
        raise BackboneSpecError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _brief(exc: Exception, limit: int = 200) -> str:
    text = one_line(f"{type(exc).__name__}: {exc}")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _positive(value: Any, what: str, path: Path) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BackboneSpecError(f"{path}: {what} must be a positive integer, got {value!r}")
    return value


def from_config(path: str | Path) -> BackboneSpec:
    """Build a spec from a Hugging Face `config.json` (a model_type of a registered family).

    Missing fields take the defaults transformers itself would use (the config classes are asked), so the
    `llava-hf` configs, whose `text_config` names only the Vicuna checkpoint, resolve to Vicuna's dims.
    """
    path = Path(path).expanduser()
    folder = path if path.is_dir() else path.parent
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise BackboneSpecError(f"{folder} has no config.json (give a model folder or its config.json)")
    raw = _load_json(path)
    model_type = raw.get("model_type")
    if model_type not in model_types():
        raise BackboneSpecError(
            f"{path}: model_type {model_type!r} is not supported (supported: {', '.join(model_types())})"
        )
    _check_complete(raw, model_type, path)
    try:
        from transformers import AutoConfig

        config = AutoConfig.for_model(**raw)
    except CareError:
        raise
    except Exception as exc:  # transformers raises many types for malformed configs
        raise BackboneSpecError(f"{path}: malformed {model_type} config ({_brief(exc)})") from None
    try:
        spec = _spec_from_hf(config, model_type, path)
    except (AttributeError, TypeError, ValueError, ZeroDivisionError) as exc:
        if isinstance(exc, CareError):
            raise
        raise BackboneSpecError(f"{path}: malformed {model_type} config ({_brief(exc)})") from None
    if model_type in _QWEN_TYPES:
        spec = _with_qwen_pixels(spec, folder / "preprocessor_config.json")
    if model_type == "internvl":
        spec = _with_internvl_tiles(spec, folder / "preprocessor_config.json")
    return _match_paper(spec)


_QWEN_TYPES = ("qwen2_5_vl", "qwen3_vl")


# What a config.json must state itself: sizes transformers would otherwise fill from its defaults (7B-class
# numbers) without saying so. llava-hf configs name the text model in text_config and let its class fill the
# sizes, which is how the checkpoint itself is built, so a named text model is enough there.
_VISION_FIELDS = ("hidden_size", "image_size", "patch_size", "num_hidden_layers")
_TEXT_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


def _check_complete(raw: dict[str, Any], model_type: str, path: Path) -> None:
    """BackboneSpecError naming every missing field of an incomplete config.json."""
    missing: list[str] = []
    vision = raw.get("vision_config")
    if not isinstance(vision, dict):
        missing.append("vision_config")
    elif model_type not in _QWEN_TYPES:
        missing += [f"vision_config.{k}" for k in _VISION_FIELDS if k not in vision]
    text = raw.get("text_config")
    if model_type in _QWEN_TYPES:
        source = text if isinstance(text, dict) and "hidden_size" in text else raw
        where = "text_config." if source is text else ""
        missing += [f"{where}{k}" for k in _TEXT_FIELDS if k not in source]
    elif not isinstance(text, dict):
        missing.append("text_config")
    elif not (text.get("model_type") or text.get("_name_or_path")) and any(k not in text for k in _TEXT_FIELDS):
        missing += [f"text_config.{k}" for k in ("model_type", *_TEXT_FIELDS) if k not in text]
    if missing:
        raise BackboneSpecError(f"{path}: incomplete {model_type} config, missing {', '.join(missing)}")


def _lm_spec(text: Any, path: Path) -> LanguageModelSpec:
    """The language model's dims from a config's text part."""
    layers = _positive(text.num_hidden_layers, "num_hidden_layers", path)
    hidden = _positive(text.hidden_size, "hidden_size", path)
    heads = _positive(text.num_attention_heads, "num_attention_heads", path)
    kv_heads = _positive(getattr(text, "num_key_value_heads", None) or heads, "num_key_value_heads", path)
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    return LanguageModelSpec(
        layers=layers, hidden=hidden, intermediate=_positive(text.intermediate_size, "intermediate_size", path),
        heads=heads, kv_heads=kv_heads, vocab=_positive(text.vocab_size, "vocab_size", path), head_dim=head_dim,
    )  # fmt: skip


def _spec_from_hf(config: Any, model_type: str, path: Path) -> BackboneSpec:
    family = backbone_family(model_type)
    lm = _lm_spec(config.text_config, path)
    vc = config.vision_config
    name = f"config:{path}"
    if model_type in ("llava", "llava_next", "llava_onevision"):
        feature_layer = config.vision_feature_layer
        n_layers = len(feature_layer) if isinstance(feature_layer, (list, tuple)) else 1
        v_hidden = _positive(vc.hidden_size, "vision_config.hidden_size", path)
        image, patch = _positive(vc.image_size, "image_size", path), _positive(vc.patch_size, "patch_size", path)
        siglip = model_type == "llava_onevision"  # SigLIP: no CLS, so "full" keeps exactly the patches
        per_crop = (image // patch) ** 2 + (1 if config.vision_feature_select_strategy == "full" and not siglip else 0)
        vision = VisionSpec(kind="siglip" if siglip else "clip",
                            layers=_positive(vc.num_hidden_layers, "vision num_hidden_layers", path),
                            hidden=v_hidden, intermediate=_positive(vc.intermediate_size, "vision intermediate", path),
                            heads=_positive(vc.num_attention_heads, "vision heads", path), patch_size=patch,
                            image_size=image, feature_tokens=per_crop)  # fmt: skip
        projector = _llava_projector(lm.hidden, token_dim=v_hidden * n_layers)
        if model_type == "llava":
            return BackboneSpec(name, f"{family.display} (config)", family.name, lm, projector, vision, per_crop,
                                f"one {image}×{image} view: {per_crop} tokens", (image, image),
                                paper_budgets=(192, 128, 64), source=str(path))  # fmt: skip
        spec = BackboneSpec(name, f"{family.display} (config)", family.name, lm, projector, vision, 0, "", None,
                            _pinpoints(config, path), source=str(path))  # fmt: skip
        if siglip:
            spec = replace(
                spec, max_crops=anyres_max_crops(str(getattr(config, "vision_aspect_ratio", "anyres_max_9")))
            )
        return _with_default_image(spec, family.display)
    if model_type == "internvl":
        return _internvl_spec(config, lm, name, family.display, path)
    return _qwen_spec(config, model_type, path, name, lm)


def _qwen_spec(config: Any, model_type: str, path: Path, name: str, lm: LanguageModelSpec) -> BackboneSpec:
    """The spec of a Qwen2.5-VL or Qwen3-VL config (merged 2x2 tokens, a merger as projector)."""
    family = backbone_family(model_type)
    vc = config.vision_config
    merge = _positive(vc.spatial_merge_size, "spatial_merge_size", path)
    v_hidden = _positive(vc.hidden_size, "vision hidden_size", path)
    out = _positive(vc.out_hidden_size, "out_hidden_size", path)
    depth = _positive(vc.depth, "vision depth", path)
    shared: dict[str, Any] = {"layers": depth, "hidden": v_hidden, "spatial_merge_size": merge,
              "intermediate": _positive(vc.intermediate_size, "vision intermediate_size", path),
              "heads": _positive(vc.num_heads, "vision num_heads", path),
              "patch_size": _positive(vc.patch_size, "vision patch_size", path),
              "in_channels": getattr(vc, "in_channels", 3) or 3,
              "temporal_patch_size": getattr(vc, "temporal_patch_size", 2) or 2}  # fmt: skip
    if model_type == "qwen3_vl":
        vision = VisionSpec(kind="qwen3-vit", full_attention_layers=tuple(range(depth)), out_hidden=out,
                            deepstack_layers=tuple(int(i) for i in vc.deepstack_visual_indexes), **shared)  # fmt: skip
        return BackboneSpec(name, f"{family.display} (config)", family.name, lm,
                            _qwen_merger(out, v_hidden, merge, kind="qwen3-vl merger"), vision, 1024, _QWEN3_NOTE,
                            (1024, 1024), min_pixels=QWEN3_MIN_PIXELS, max_pixels=QWEN3_MAX_PIXELS,
                            paper_budgets=(204, 102), source=str(path))  # fmt: skip
    vision = VisionSpec(
        kind="qwen2.5-vit",
        window_size=getattr(vc, "window_size", 112) or 112,
        full_attention_layers=tuple(getattr(vc, "fullatt_block_indexes", ()) or ()),
        **shared,
    )
    return BackboneSpec(name, f"{family.display} (config)", family.name, lm, _qwen_merger(out, v_hidden, merge),
                        vision, 1110, _QWEN_NOTE, None, min_pixels=QWEN_MIN_PIXELS, max_pixels=QWEN_MAX_PIXELS,
                        paper_budgets=(222, 111), source=str(path))  # fmt: skip


def _internvl_spec(config: Any, lm: LanguageModelSpec, name: str, display: str, path: Path) -> BackboneSpec:
    """An InternVL config: InternViT on square tiles, pixel shuffle by 1 / downsample_ratio, LayerNorm + MLP."""
    vc = config.vision_config
    side = vc.image_size[0] if isinstance(vc.image_size, (list, tuple)) else vc.image_size
    patch = vc.patch_size[0] if isinstance(vc.patch_size, (list, tuple)) else vc.patch_size
    image, patch = _positive(int(side), "image_size", path), _positive(int(patch), "patch_size", path)
    shuffle = round(1 / float(config.downsample_ratio))
    per_tile = (image // patch // shuffle) ** 2
    v_hidden = _positive(vc.hidden_size, "vision hidden_size", path)
    vision = VisionSpec(kind="internvit", layers=_positive(vc.num_hidden_layers, "vision num_hidden_layers", path),
                        hidden=v_hidden, intermediate=_positive(vc.intermediate_size, "vision intermediate", path),
                        heads=_positive(vc.num_attention_heads, "vision heads", path), patch_size=patch,
                        image_size=image, feature_tokens=per_tile)  # fmt: skip
    spec = BackboneSpec(name, f"{display} (config)", "internvl3", lm, _internvl_projector(lm.hidden, v_hidden, shuffle),
                        vision, 0, "", (672, 672), max_tiles=INTERNVL_MAX_TILES, source=str(path))  # fmt: skip
    n = visual_tokens(spec, 672, 672).tokens
    return replace(spec, default_tokens=n, paper_budgets=(n // 5, n // 10, n // 20),
                   default_tokens_note=f"InternVL at 672×672: tiles + thumbnail, {per_tile} tokens each")  # fmt: skip


def _pinpoints(config: Any, path: Path) -> tuple[tuple[int, int], ...]:
    raw_pinpoints = [tuple(int(v) for v in p) for p in config.image_grid_pinpoints]
    if not raw_pinpoints or any(len(p) != 2 or min(p) < 1 for p in raw_pinpoints):
        raise BackboneSpecError(f"{path}: image_grid_pinpoints must be a list of [height, width] pairs")
    return tuple((p[0], p[1]) for p in raw_pinpoints)


def _with_default_image(spec: BackboneSpec, display: str) -> BackboneSpec:
    """An anyres spec's default image (672×672, else 768×768 where a pinpoint, else the largest pinpoint), its N and
    budgets at LLaVA-NeXT's paper fractions (640, 320, 160 of 2880)."""
    pinpoints = spec.grid_pinpoints
    default_image = next((p for p in ((672, 672), (768, 768)) if p in pinpoints), None)
    default_image = default_image or max(pinpoints, key=lambda p: p[0] * p[1])
    n = visual_tokens(spec, *default_image).tokens
    budgets = tuple(max(1, int(Fraction(k, 2880) * n)) for k in (640, 320, 160))
    note = f"{display} at {default_image[0]}×{default_image[1]}: base + unpadded high-res, no newline rows"
    return replace(spec, default_tokens=n, default_tokens_note=note, default_image=default_image,
                   paper_budgets=budgets)  # fmt: skip


def _with_qwen_pixels(spec: BackboneSpec, preprocessor: Path) -> BackboneSpec:
    """Use the folder's processor pixel limits when it has them (min/max_pixels or size.{shortest,longest}_edge)."""
    if not preprocessor.is_file():
        return spec
    data = _load_json(preprocessor)
    raw_size = data.get("size")
    size: dict[str, Any] = raw_size if isinstance(raw_size, dict) else {}
    low = data.get("min_pixels", size.get("shortest_edge", spec.min_pixels))
    high = data.get("max_pixels", size.get("longest_edge", spec.max_pixels))
    return replace(spec, min_pixels=_positive(low, "min_pixels", preprocessor),
                   max_pixels=_positive(high, "max_pixels", preprocessor))  # fmt: skip


def _with_internvl_tiles(spec: BackboneSpec, preprocessor: Path) -> BackboneSpec:
    """Use the folder's processor ``max_patches`` when it has one (N at the default image follows it)."""
    if not preprocessor.is_file():
        return spec
    tiles = _positive(_load_json(preprocessor).get("max_patches", spec.max_tiles), "max_patches", preprocessor)
    if tiles == spec.max_tiles:
        return spec
    spec = replace(spec, max_tiles=tiles)
    n = visual_tokens(spec, *(spec.default_image or (672, 672))).tokens
    return replace(spec, default_tokens=n, paper_budgets=(n // 5, n // 10, n // 20))


def _signature(spec: BackboneSpec) -> tuple[Any, ...]:
    return (spec.family, spec.lm, spec.projector, spec.vision, spec.grid_pinpoints, spec.max_tiles, spec.max_crops)


def _match_paper(spec: BackboneSpec) -> BackboneSpec:
    """A config with exactly a registry backbone's dims takes that backbone's display name and paper rows."""
    for known in KNOWN_BACKBONES.values():
        if _signature(known) == _signature(spec):
            return replace(spec, display=known.display, paper_key=known.paper_key,
                           default_tokens=known.default_tokens, default_tokens_note=known.default_tokens_note,
                           paper_budgets=known.paper_budgets)  # fmt: skip
    return spec
