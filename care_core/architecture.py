"""A backbone's architecture as ``care flops`` counts it: frozen dims of its language model, projector and vision
tower, and how its processor turns an image into visual tokens.

Plain data, no torch: each family's record (``care_core/backbones/<family>/__init__.py``) states its specs with these
classes, and ``care_core.flops`` reads them from the records.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from fractions import Fraction
from typing import Any, Literal, get_args

from care_core.errors import ModelLoadError

#: How a processor turns an image into visual tokens (``care_core.flops.tokens`` counts each):
#: one fixed view, anyres crops (a base view + tiles at a grid pinpoint), square tiles + a thumbnail, or one merged
#: grid of the image resized within a pixel budget.
ImageLayout = Literal["one_view", "anyres", "tiles", "merged_grid"]
IMAGE_LAYOUTS: tuple[ImageLayout, ...] = get_args(ImageLayout)


class BackboneSpecError(ModelLoadError):
    """An unknown backbone name, or a config.json that cannot be turned into a spec."""


@dataclass(frozen=True)
class LinearAttentionSpec:
    """The widths of a Gated DeltaNet linear-attention layer (Qwen3.5's ``linear_*`` config fields)."""

    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    chunk: int = 64  # the chunked delta rule's chunk: prefill pads the rows to whole chunks

    @property
    def key_dim(self) -> int:
        return self.key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.value_heads * self.value_head_dim


@dataclass(frozen=True)
class LanguageModelSpec:
    """The decoder-only language model: L layers of attention + SwiGLU FFN; in a hybrid decoder (Qwen3.5) the layers
    ``linear_layers`` mix tokens with Gated DeltaNet (``linear_attention``) instead of attention."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: int = 0  # 0: hidden // heads
    attention_output_gate: bool = False  # q_proj also gives a sigmoid gate on the attention output (2x its width)
    linear_layers: tuple[int, ...] = ()  # indices of the Gated DeltaNet layers (none: every layer is attention)
    linear_attention: LinearAttentionSpec | None = None  # their widths, given exactly when linear_layers is

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        if bool(self.linear_layers) != (self.linear_attention is not None):
            raise ValueError("linear_layers and linear_attention go together: give both or neither")
        if any(not 0 <= i < self.layers for i in self.linear_layers) or len(set(self.linear_layers)) != len(
            self.linear_layers
        ):
            raise ValueError(f"linear_layers {self.linear_layers} must be distinct layer indices below {self.layers}")

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


def hidden_state_index(layer: int, num_layers: int) -> int:
    """``hidden_states[layer]`` as a non-negative index into the ``num_layers + 1`` hidden states."""
    index = layer if layer >= 0 else num_layers + 1 + layer
    if not 0 <= index <= num_layers:
        raise ValueError(f"vision feature layer {layer} is out of range for a {num_layers}-layer tower")
    return index


def hidden_state_indices(feature_layer: Any, num_layers: int) -> list[int]:
    """A ``vision_feature_layer`` (one index, or a list or tuple of them) as :func:`hidden_state_index` indices, in its
    order. ValueError for an index out of range, TypeError or ValueError for one that is not an integer."""
    read = list(feature_layer) if isinstance(feature_layer, (list, tuple)) else [feature_layer]
    return [hidden_state_index(int(layer), num_layers) for layer in read]


@dataclass(frozen=True)
class VisionSpec:
    """The vision tower (only for the optional `vision_tower` term; its ``kind`` picks how it is counted)."""

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
    # LLaVA: the encoder layers up to the deepest ``vision_feature_layer`` read, the ones care runs
    # (care_core.backbones.vision_encoder stops the forward there); None: all of them
    layers_run: int | None = None

    @property
    def layers_counted(self) -> int:
        """The encoder layers the tower term counts: :attr:`layers_run` where set, else all of them."""
        return self.layers if self.layers_run is None else self.layers_run


@dataclass(frozen=True)
class BackboneSpec:
    name: str  # the spec's name in care flops, e.g. "llava-1.5-7b", or "config:<path>"
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

    def __post_init__(self) -> None:
        stated = [what for what, value in (("grid_pinpoints", self.grid_pinpoints), ("max_tiles", self.max_tiles),
                                           ("max_pixels", self.max_pixels)) if value]  # fmt: skip
        if len(stated) > 1:  # each names one way of cutting an image (image_layout): two would be a guess
            raise ValueError(f"backbone spec {self.name!r} states {' and '.join(stated)}: give one image layout")

    @property
    def image_layout(self) -> ImageLayout:
        """How the processor turns an image into tokens, read from the geometry the spec states: grid pinpoints
        (anyres crops), ``max_tiles`` (square tiles + thumbnail), a pixel budget (one merged grid), else one view."""
        if self.grid_pinpoints:
            return "anyres"
        if self.max_tiles:
            return "tiles"
        if self.max_pixels:
            return "merged_grid"
        return "one_view"

    def default_budget_fractions(self) -> tuple[Fraction, ...]:
        return tuple(Fraction(k, self.default_tokens) for k in self.paper_budgets)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("aliases")
        data["lm"]["q_dim"], data["lm"]["kv_dim"] = self.lm.q_dim, self.lm.kv_dim
        data["projector"]["out_dim"] = self.projector.out_dim
        return data
