"""Greedy decoding over a static KV cache, prefill and decode steps replayed from captured CUDA graphs.

``model.generate`` launches every kernel of every layer from Python, step after step. On a 7B language model
with a few hundred prompt rows (what a reduction leaves) that launch time is most of the prefill, so the
time saved by dropping visual tokens is lost to the host. :class:`StaticGreedy` runs the language model's own
weights (embedding table, decoder layers through :mod:`~care_core.backbones.decoder_layers`' lean layer, final
norm, LM head) in a fixed-shape loop whose pieces are captured once and replayed:

- **prefill**: the prompt's input embeddings, right-padded to a multiple of :data:`BUCKET` rows, through every
  layer with causal attention; keys and values go to the static cache; the argmax at the last real row is the
  first token. Causal attention keeps the real rows blind to the padding, and decoding overwrites the padded
  cache rows before any query can see them. One graph per padded length (and batch bucket).
- **decode**: one token in, one token out; keys and values written at the current position, attention over the
  whole cache with every later position masked. One graph per cache capacity (and batch bucket).

**Prompts** (:class:`StaticPrompt`): input embeddings, and where the decoder needs them (Qwen2.5-VL, Qwen3-VL)
multimodal-rope (t, h, w) positions and Qwen3-VL's DeepStack rows. A prompt's cache index is its row 0..L-1
(what the mask and the cache writes follow); its rotary positions are its own in the prefill, and a new token
at cache index c sits at c + (last prompt position + 1 - L) on each of the three rows, as ``model.generate``
continues explicit positions (1-D decoders: c). DeepStack rows are added to the hidden states after the first
layers in the prefill (zeros on the rows that get none), never in decoding, as the model does.

**Batches** (:meth:`StaticGreedy.generate_batch`): the batch size is padded up to one of :data:`BATCH_BUCKETS`
with dummy rows, the prompts right-padded to a common multiple of :data:`BUCKET`; every sample sits at its own
cache rows 0..L_i-1, takes its first token from its own last row and decodes at its own position (per-sample
write index, mask and rotary position), so it sees exactly the keys and positions of its batch-1 run. Graphs
are kept per (batch bucket, padded length) for prefill and per batch bucket for decode. A call replays a
captured shape other than its own only where that shape's prompt rows are at most :data:`REUSE_ROWS_RATIO`
times its own (:func:`reused_shape`); otherwise it captures its own.

The maths is the eager forward's (same weights; scaled dot-product attention, causal in the prefill and masked in
decoding); only float rounding may differ from ``model.generate``'s kernels. :func:`unsupported_reason` says where
this loop would not be the model's own computation (other decoders or layer forms, sliding windows, logit processors
in the generation config, ...); there the adapters keep ``model.generate``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch

from ..vocabulary import BATCH_BUCKETS
from .decoder_layers import (
    CacheRows,
    LeanLayers,
    layer_forward,
    layer_reason,
    layer_shape,
    layer_tensors,
    rotation_tables,
)

BUCKET = 16  # prompt rows are padded to a multiple of this: prompts of nearby lengths share a graph
CAPACITY_STEP = 256  # the cache grows in steps of this many positions
MAX_PREFILL_GRAPHS = 8  # (batch, padded length) pairs whose prefill graph is kept (least recently used dropped first)
# a call replays a captured prefill shape other than its own only where that shape's prompt rows (batch bucket x
# padded length) are at most this many times its own. A replay costs what its rows cost (on an H100, about 27 us a
# row of LLaVA-1.5-7B), so under a looser rule a reduced prompt of ~200 rows replayed the all-token graph of ~2,900
# rows captured just before it and its prefill cost what all tokens cost (issue #47). Within 25% a data set's
# shorter batches still replay their run's graphs instead of capturing their own (0.2-1.1 s a capture); batch buckets
# double, so a short last batch (fewer samples) never replays a larger bucket's graphs
REUSE_ROWS_RATIO = 1.25
#: decoder layers whose forward this loop drives as they are
DECODERS = frozenset({"llama", "mistral", "qwen2", "qwen2_5_vl_text", "qwen3_vl_text"})
#: decoders whose rotary embedding takes (t, h, w) positions per row (multimodal rope; text rows: all three equal)
MROPE_DECODERS = frozenset({"qwen2_5_vl_text", "qwen3_vl_text"})
#: decoders that add DeepStack rows after their first layers (as many as the vision config's deepstack taps)
DEEPSTACK_DECODERS = frozenset({"qwen3_vl_text"})

# generation-config fields that change greedy tokens, with the value that leaves them alone
_NEUTRAL_PROCESSORS: dict[str, tuple[Any, ...]] = {
    "repetition_penalty": (None, 1.0),
    "encoder_repetition_penalty": (None, 1.0),
    "no_repeat_ngram_size": (None, 0),
    "encoder_no_repeat_ngram_size": (None, 0),
    "bad_words_ids": (None,),
    "sequence_bias": (None,),
    "suppress_tokens": (None,),
    "begin_suppress_tokens": (None,),
    "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,),
    "min_length": (None, 0),
    "min_new_tokens": (None, 0),
    "exponential_decay_length_penalty": (None,),
    "stop_strings": (None,),
    "watermarking_config": (None,),
}


def _text_config(model: Any) -> Any:
    config = model.config
    return getattr(config, "text_config", None) or config


def _rope_type(text_config: Any) -> str:
    for key in ("rope_parameters", "rope_scaling"):
        params = getattr(text_config, key, None)
        if isinstance(params, dict) and params.get("rope_type", params.get("type")):
            return str(params.get("rope_type", params.get("type")))
    return "default"


def sliding_window(model: Any) -> int | None:
    """The decoder's attention window (None: full attention)."""
    cfg = _text_config(model)
    if not getattr(cfg, "use_sliding_window", True):
        return None
    window = getattr(cfg, "sliding_window", None)
    return int(window) if window else None


def unsupported_reason(model: Any, length: int | None = None) -> str | None:
    """Why :class:`StaticGreedy` would not compute ``model``'s greedy answer (one line), or None.

    ``length``: prompt plus new tokens, where known (a sliding window matters only beyond its width).
    """
    inner = getattr(model, "model", None)
    lm = getattr(inner, "language_model", None)
    head = getattr(model, "lm_head", None)
    if lm is None or head is None or not all(hasattr(lm, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return f"{type(model).__name__} has no language model with embed_tokens, layers, norm and rotary_emb"
    cfg = _text_config(model)
    kind = getattr(cfg, "model_type", None)
    if kind not in DECODERS:
        return f"the {kind} decoder is not one the static loop drives ({', '.join(sorted(DECODERS))})"
    odd = next((r for r in map(layer_reason, lm.layers) if r is not None), None)
    if odd is not None:
        return odd
    if deepstack_levels(model) > len(lm.layers):
        return f"{deepstack_levels(model)} DeepStack levels for {len(lm.layers)} decoder layers"
    rope = _rope_type(cfg)
    if "dynamic" in rope or "longrope" in rope:
        return f"rope type {rope!r} rescales with the sequence length (a host-side decision no graph can replay)"
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ()):
        return "the decoder mixes attention types per layer"
    generation = getattr(model, "generation_config", None)
    for name, neutral in _NEUTRAL_PROCESSORS.items():
        value = getattr(generation, name, None)
        if value not in neutral:
            return f"the generation config sets {name}={value!r}, which model.generate applies and this loop does not"
    return window_reason(model, length)


def _first_parameter(module: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """The submodule that holds ``module``'s first parameter, and its name there."""
    path, _, name = next(module.named_parameters())[0].rpartition(".")
    return module.get_submodule(path), name


def window_reason(model: Any, length: int | None) -> str | None:
    """Why ``length`` positions (prompt plus new tokens) would not fit the decoder's sliding window, or None: the part
    of :func:`unsupported_reason` that depends on the call (the rest depends on the model only)."""
    return length_reason(sliding_window(model), length)


def length_reason(window: int | None, length: int | None) -> str | None:
    """:func:`window_reason` for a decoder whose :func:`sliding_window` is ``window`` (read once per model)."""
    if window is not None and length is not None and length > window:
        return f"{length} positions exceed the decoder's sliding window of {window}"
    return None


def deepstack_levels(model: Any) -> int:
    """How many DeepStack levels the decoder adds after its first layers (0 for decoders without DeepStack)."""
    if getattr(_text_config(model), "model_type", None) not in DEEPSTACK_DECODERS:
        return 0
    vision = getattr(model.config, "vision_config", None)
    return len(getattr(vision, "deepstack_visual_indexes", None) or ())


def eos_ids(model: Any) -> frozenset[int]:
    """The token ids that end greedy generation (the generation config's, as ``model.generate`` reads them)."""
    value = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if value is None:
        return frozenset()
    if isinstance(value, int):
        return frozenset({value})
    return frozenset(int(v) for v in value)


def batch_bucket(size: int) -> int:
    """The smallest of :data:`BATCH_BUCKETS` that holds ``size`` samples (1 <= size <= the largest)."""
    return next(b for b in BATCH_BUCKETS if b >= size)


def reused_shape(own: int, rows: int, captured: Iterable[tuple[int, int]]) -> tuple[int, int]:
    """The (batch bucket, padded rows) a batch runs in, given its own bucket ``own`` and its prompts' padded
    ``rows``: its own shape where captured; else the captured shape with the fewest prompt rows (bucket x rows) that
    holds it (bucket >= own, rows >= its rows) with at most :data:`REUSE_ROWS_RATIO` times its own rows; else its own
    (captured on first use). Extra padding rows are like the bucket's: causal attention keeps every real row blind
    to them."""
    shapes = set(captured)
    if (own, rows) in shapes:
        return own, rows
    most = REUSE_ROWS_RATIO * own * rows
    fits = [(b * r, b, r) for b, r in shapes if b >= own and r >= rows and b * r <= most]
    return min(fits)[1:] if fits else (own, rows)


@dataclass(frozen=True, eq=False)
class StaticPrompt:
    """One prompt of :meth:`StaticGreedy.generate_batch`.

    ``embeds``: (L, d) input embeddings (or (1, L, d)). ``positions``: (3, L) multimodal-rope (t, h, w) positions
    (:data:`MROPE_DECODERS` only; None: 0..L-1 on every row, a text prompt's), which the rotary embedding takes in
    the prefill; a new token at cache index c gets c + (last position + 1 - L) on each row, as ``model.generate``
    continues explicit positions (a chat prompt ends in text, whose three positions are its largest: the model's own
    rope delta). ``deepstack``: (levels, L, d) rows added to the hidden states after decoder layer l < levels in the
    prefill (:data:`DEEPSTACK_DECODERS`; zeros where nothing is added), or None (nothing added).

    ``inserted``: (R, d) rows that go in before row ``at`` of ``embeds``, which then holds the prompt's other rows
    (the prompt is embeds[:at], inserted, embeds[at:]; L counts both): a chat prompt's visual rows amid its text rows,
    which stay the same for every image (an adapter keeps them on the device), so the prompt is put together where
    the loop writes its static inputs, in one copy.
    """

    embeds: torch.Tensor
    positions: torch.Tensor | None = None
    deepstack: torch.Tensor | None = None
    inserted: torch.Tensor | None = None
    at: int = 0

    @property
    def length(self) -> int:
        """L: the prompt's rows."""
        rows = int(self.embeds.shape[-2])
        return rows if self.inserted is None else rows + int(self.inserted.shape[0])

    def write(self, out: torch.Tensor) -> None:
        """Write the prompt's (L, d) embeddings into ``out``."""
        if self.inserted is None:
            out.copy_(self.embeds)
        else:
            at = self.at
            torch.cat([self.embeds[:at], self.inserted, self.embeds[at:]], out=out)


class StaticKV:
    """Every layer's keys and values in preallocated (batch, kv_heads, capacity, head_dim) buffers.

    A step runs the ``active`` leading samples of the ``batch`` allocated (views of the buffers, so the graphs of
    smaller batches read the same memory). A prefill writes its ``rows`` keys and values to cache rows
    0..rows-1 (:meth:`prefill_rows`) as the lean layer makes them, and attends over those alone (the cache was empty
    before them). A decode step goes through :meth:`update`, as a transformers cache: one flat row per (sample, head)
    of the buffer viewed as (-1, head_dim), each sample at its own position (``write``, a tensor the graphs read on
    replay, set by the driver), and the attention sees the positions up to ``span`` (the mask hides what lies ahead).
    """

    def __init__(self, layers: int, shape: tuple[int, int, int, int], dtype: torch.dtype,
                 device: torch.device) -> None:  # fmt: skip
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.batch, self.kv_heads, self.capacity, self.head_dim = shape
        self.active = shape[0]  # samples the current step runs (set by the driver before each step)
        self.rows = 0  # a prefill's prompt rows (set by the driver)
        self.span = shape[2]  # positions a decode step attends over (set by the driver; at most the capacity)
        self.write: torch.Tensor | None = None
        self.prefill = True

    def prefill_rows(self, layer_idx: int) -> CacheRows:
        """One layer's cache rows 0..rows-1 of the active samples (keys, values), where a prefill's go."""
        keys, values = self.keys[layer_idx][: self.active], self.values[layer_idx][: self.active]
        return keys[:, :, : self.rows], values[:, :, : self.rows]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step: write one layer's new keys and values (batch, kv_heads, 1, head_dim) and return those to
        attend over. A prefill (its rows written already, :meth:`prefill_rows`): return the new ones as they are."""
        if self.prefill:
            return key, value
        assert self.write is not None
        keys, values = self.keys[layer_idx][: self.active], self.values[layer_idx][: self.active]
        if key.shape[:2] != keys.shape[:2] or key.shape[-1] != keys.shape[-1]:
            raise RuntimeError(f"layer {layer_idx} gave keys {tuple(key.shape)}; the cache holds {tuple(keys.shape)}")
        flat = (-1, self.head_dim)  # (sample, head, position) rows: one write per sample and head, no host sync
        keys.view(flat).index_copy_(0, self.write, key.reshape(flat).to(keys.dtype))
        values.view(flat).index_copy_(0, self.write, value.reshape(flat).to(values.dtype))
        return keys[:, :, : self.span], values[:, :, : self.span]  # positions past the span: never written yet


@dataclass
class _Prefill:
    """The static inputs and the captured graph of one (batch bucket, padded prompt length)."""

    embeds: torch.Tensor  # (batch, rows, d)
    last: torch.Tensor  # (batch,) index of each prompt's last real row
    positions: torch.Tensor | None = None  # (3, batch, rows) rotary (t, h, w) positions: multimodal-rope decoders
    deepstack: torch.Tensor | None = None  # (levels, batch, rows, d) rows added after the first layers: a view
    graph: Any = None
    filled: tuple[tuple[int, bool], ...] = ()  # (length, positions given) per prompt at the last fill


class StaticGreedy:
    """Greedy decoding of a transformers VLM's language model from input embeddings, one prompt or a batch.

    ``graphs``: capture and replay CUDA graphs (CUDA only); otherwise the same loop runs eagerly, which is
    what the CPU tests check against ``model.generate``. The first call at a new (batch bucket, padded length)
    runs eagerly and captures on the way out; later calls replay. The eager loop picks its shapes as the graph loop
    does, among the shapes it has run (so the CPU tests see the reuse rule at work). Holds the cache
    (``2 · layers · batch · kv_heads · head_dim · capacity`` values, for the largest batch bucket seen) until dropped.
    """

    def __init__(self, model: Any, *, graphs: bool) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(reason)
        self.model = model
        self.lm = model.model.language_model
        self.head = model.lm_head
        self.layers = list(self.lm.layers)
        cfg = _text_config(model)
        self.shape = layer_shape(cfg, self.layers[0])
        self.kv_heads, self.head_dim = self.shape.kv_heads, self.shape.head_dim
        self.tensors = [layer_tensors(layer) for layer in self.layers]
        self.mrope = cfg.model_type in MROPE_DECODERS
        self.deepstack_levels = deepstack_levels(model)
        weight = self.lm.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.hidden_size = int(weight.shape[1])
        if graphs and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the language model is on {self.device}")
        self.graphs = graphs
        self.pieces = LeanLayers(self.device)
        self.capturing = False  # True while a step runs for a graph capture (its warm-up included)
        self.eos = eos_ids(model)
        self.watched = tuple(_first_parameter(m) for m in (self.lm.embed_tokens, self.lm.norm, self.head, *self.layers))
        self.weights = self._weights()
        self.kv: StaticKV | None = None
        self._static_state(1, 0)
        self.prefills: OrderedDict[tuple[int, int], _Prefill] = OrderedDict()
        self.decodes: dict[tuple[int, int], Any] = {}  # (batch bucket, attended span) -> decode graph
        self.captures = 0  # graphs captured so far (for tests and reports)
        self.last_shape: tuple[int, int] | None = None  # the (batch bucket, padded rows) the last prefill ran in
        self.pool: Any = None
        self.stream: Any = None
        self._new_pool()

    # ------------------------------------------------------------------ state
    def _weights(self) -> tuple[tuple[int, torch.dtype], ...]:
        # one tensor per module (the first), read from the module that holds it: every call pays this, and a walk
        # over all ~300 tensors of a 7B model (or even a parameters() generator per layer) costs a good part of a
        # millisecond of host time; moves and casts (.to, .half, .cuda) replace them all
        tensors = (holder._parameters[name] for holder, name in self.watched)
        return tuple((0, torch.float32) if t is None else (t.data_ptr(), t.dtype) for t in tensors)

    @property
    def stale(self) -> bool:
        """True when the model's tensors were moved or cast (``.to``, ``.half``), or a module's first parameter
        replaced: the graphs would read the old memory."""
        return self._weights() != self.weights

    def _new_pool(self) -> None:
        if self.graphs:
            self.pool = torch.cuda.graph_pool_handle()
            self.stream = torch.cuda.Stream(self.device)

    def _static_state(self, batch: int, capacity: int) -> None:
        """The tensors the graphs read and write besides the cache, for up to ``batch`` samples."""
        device = self.device
        self.positions = torch.arange(capacity, device=device)
        self.token = torch.zeros((batch, 1), dtype=torch.long, device=device)  # each sample's next token
        self.position = torch.zeros(batch, dtype=torch.long, device=device)  # where each sample's next token goes
        # per sample and rotary row: a new token's rotary position minus its cache index (multimodal rope)
        self.rope_delta = torch.zeros((3, batch), dtype=torch.long, device=device)
        heads = torch.arange(batch * self.kv_heads, device=device).view(batch, self.kv_heads)
        self.row_base = heads * capacity  # first flat cache row of each (sample, head)
        # DeepStack rows: one buffer for every prefill shape (each reads its corner; a call fills it before its
        # prefill), as (levels, batch, rows, d) per shape would be up to MAX_PREFILL_GRAPHS times its size
        shape = (self.deepstack_levels, batch, capacity, self.hidden_size)
        self.deepstack = torch.zeros(shape, dtype=self.dtype, device=device) if self.deepstack_levels else None

    def _ensure_capacity(self, batch: int, needed: int) -> None:
        """A cache of at least ``batch`` samples and ``needed`` positions (grown, never shrunk)."""
        kv = self.kv
        if kv is not None and kv.batch >= batch and kv.capacity >= needed:
            return
        capacity = CAPACITY_STEP * math.ceil(needed / CAPACITY_STEP)
        if kv is not None:
            batch, capacity = max(batch, kv.batch), max(capacity, kv.capacity)
        self.prefills.clear()  # the graphs write into the old buffers
        self.decodes.clear()
        self.kv = self.deepstack = None  # the old buffers go before the new ones are allocated
        shape = (batch, self.kv_heads, capacity, self.head_dim)
        self.kv = StaticKV(len(self.layers), shape, self.dtype, self.device)
        self._static_state(batch, capacity)
        self._new_pool()

    def _bucket(self, batch: int, rows: int) -> _Prefill:
        key = (batch, rows)
        entry = self.prefills.get(key)
        if entry is None:
            device, dtype = self.device, self.dtype
            embeds = torch.zeros((batch, rows, self.hidden_size), dtype=dtype, device=device)
            entry = _Prefill(embeds, torch.zeros(batch, dtype=torch.long, device=device))
            if self.mrope:
                entry.positions = torch.zeros((3, batch, rows), dtype=torch.long, device=device)
            if self.deepstack is not None:
                entry.deepstack = self.deepstack[:, :batch, :rows]
            self.prefills[key] = entry
            while len(self.prefills) > MAX_PREFILL_GRAPHS:
                self.prefills.popitem(last=False)
        self.prefills.move_to_end(key)
        return entry

    def _shape(self, own: int, rows: int, replay: bool) -> tuple[int, int]:
        """The (batch bucket, padded rows) a call runs in (:func:`reused_shape` over the shapes ready to replay:
        captured graphs, or every shape run where the loop runs eagerly; an eager call of a graph loop: its own)."""
        if self.graphs and not replay:
            ready = []
        else:
            ready = [key for key, entry in self.prefills.items() if entry.graph is not None or not self.graphs]
        self.last_shape = reused_shape(own, rows, ready)
        return self.last_shape

    # ------------------------------------------------------------------ the two steps
    def _layers(self, hidden: torch.Tensor, rotary: torch.Tensor, mask: torch.Tensor | None,
                deepstack: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """Every decoder layer (:func:`~care_core.backbones.decoder_layers.layer_forward`): ``rotary`` positions
        ((batch, rows), or (3, batch, rows) for multimodal rope) for the rotary embedding, ``mask`` None (causal
        prefill) or the decode step's additive mask; after layer l, ``deepstack[l]`` added where given
        (levels, batch, rows, d)."""
        assert self.kv is not None
        rotation = rotation_tables(*self.lm.rotary_emb(hidden, position_ids=rotary))
        kv = self.kv
        with self.pieces.scope(for_graphs=self.capturing):
            for index, tensors in enumerate(self.tensors):
                cache = partial(kv.update, layer_idx=index)
                rows = kv.prefill_rows(index) if kv.prefill else None
                hidden = layer_forward(self.pieces, hidden, tensors, rotation, self.shape, cache, mask, rows)
                if deepstack is not None and index < deepstack.shape[0]:
                    hidden = hidden + deepstack[index]  # zeros leave a row as it is: only the visual rows change
        return hidden

    def _next_token(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self.lm.norm(hidden)).argmax(-1)  # (batch, 1)

    def _prefill_step(self, entry: _Prefill) -> None:
        assert self.kv is not None
        batch, rows, hidden_size = entry.embeds.shape
        self.kv.active, self.kv.rows, self.kv.prefill = batch, rows, True
        text = self.positions[None, :rows].expand(batch, rows)
        rotary = text if entry.positions is None else entry.positions
        hidden = self._layers(entry.embeds, rotary, None, entry.deepstack)
        last = hidden.gather(1, entry.last.view(batch, 1, 1).expand(batch, 1, hidden_size))  # each prompt's own
        self.token[:batch].copy_(self._next_token(last))
        self.position[:batch].copy_(entry.last + 1)

    def _decode_step(self, batch: int, span: int) -> None:
        assert self.kv is not None
        token, position = self.token[:batch], self.position[:batch]
        write = (self.row_base[:batch] + position[:, None]).reshape(-1)  # (batch · kv_heads,) flat cache rows
        self.kv.active, self.kv.write, self.kv.prefill, self.kv.span = batch, write, False, span
        hidden = self.lm.embed_tokens(token)
        ahead = self.positions[None, :span] > position[:, None]  # per sample: what no query may see yet (and padding)
        mask = torch.zeros(ahead.shape, dtype=self.dtype, device=self.device).masked_fill_(
            ahead, torch.finfo(self.dtype).min
        )
        text = position[:, None]
        rotary = (position[None, :] + self.rope_delta[:, :batch])[..., None] if self.mrope else text
        hidden = self._layers(hidden, rotary, mask[:, None, None, :])
        token.copy_(self._next_token(hidden))
        position.add_(1)

    def _run(self, step: Callable[[], None], graph: Any, replay: bool = True) -> Any:
        """Replay ``graph``; without one, run ``step`` (and capture it when graphs are on). Returns the graph.
        ``replay`` False: run ``step`` eagerly, ``graph`` kept as it is."""
        with torch.no_grad():
            if not (self.graphs and replay):
                step()
                return graph
            if graph is not None:
                graph.replay()
                return graph
            self.capturing = True  # the layers' pieces compiled for captures (LeanLayers.scope)
            try:
                return self._capture(step)
            finally:
                self.capturing = False

    def _capture(self, step: Callable[[], None]) -> Any:
        """Run ``step`` once on the capture stream (the warm-up a capture needs), then capture it into a graph."""
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            step()  # the real step, and the warm-up the capture needs on its stream
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # capture_begin/end rather than torch.cuda.graph(), whose entry empties the device and pinned-host
        # caching allocators: every later batch would then allocate its buffers from the driver again
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=self.pool)
            try:
                step()  # recorded, not run: the state the eager step left stands
            finally:
                graph.capture_end()
        self.captures += 1
        return graph

    # ------------------------------------------------------------------ public
    def generate(self, prompt: torch.Tensor | StaticPrompt, max_new_tokens: int, *, replay: bool = True) -> list[int]:
        """Greedy token ids after one prompt (embeddings (L, d) or (1, L, d), or a :class:`StaticPrompt`); stops
        after an end token."""
        return self.generate_batch([prompt], max_new_tokens, replay=replay)[0]

    def generate_batch(
        self,
        prompts: Sequence[torch.Tensor | StaticPrompt],
        max_new_tokens: int,
        *,
        replay: bool = True,
        after_prefill: Callable[[], object] | None = None,
    ) -> list[list[int]]:
        """Greedy token ids after each prompt (embeddings (L_i, d) or (1, L_i, d), or a :class:`StaticPrompt`), each
        as it gets alone.

        A sample's tokens end after its first end token (its later steps run with the batch and are dropped);
        the loop stops when every sample has ended or after ``max_new_tokens``. ``replay`` False: every step runs
        eagerly (no graph captured or replayed), in the call's own shape. ``after_prefill``: host work run once the
        (first) prefill is launched, while the device runs it; work it queues follows the prefill.
        """
        checked = [self._checked(p) for p in prompts]
        largest = BATCH_BUCKETS[-1]
        if len(checked) > largest:  # one chunk after another, each padded to its own bucket
            chunks = [checked[at : at + largest] for at in range(0, len(checked), largest)]
            hooks = [after_prefill] + [None] * (len(chunks) - 1)
            runs = [self.generate_batch(chunk, max_new_tokens, replay=replay, after_prefill=hook)
                    for chunk, hook in zip(chunks, hooks, strict=True)]  # fmt: skip
            return [ids for run in runs for ids in run]
        if not checked or max_new_tokens < 1:
            return [[] for _ in checked]
        lengths = [p.length for p in checked]
        rows = BUCKET * math.ceil(max(lengths) / BUCKET)
        needed = max(rows, max(lengths) + max_new_tokens - 1)
        self._ensure_capacity(batch_bucket(len(checked)), needed)  # a growth drops every graph: then none is reused
        batch, rows = self._shape(batch_bucket(len(checked)), rows, replay)
        # decode steps attend over the positions this call can reach, not the whole cache (a long prompt's earlier
        # call may have grown it tenfold): one decode graph per (batch bucket, span)
        span = CAPACITY_STEP * math.ceil(needed / CAPACITY_STEP)
        entry = self._bucket(batch, rows)
        self._fill(entry, checked, lengths)
        entry.graph = self._run(lambda: self._prefill_step(entry), entry.graph, replay)
        if after_prefill is not None:
            after_prefill()  # overlaps the prefill on the device, off the host's path to its launch
        return self._decode_loop(batch, span, len(checked), max_new_tokens, replay)

    def _checked(self, prompt: torch.Tensor | StaticPrompt) -> StaticPrompt:
        """``prompt`` as a :class:`StaticPrompt` with (L, d) embeddings, after checking its extras fit this decoder."""
        if not isinstance(prompt, StaticPrompt):
            prompt = StaticPrompt(prompt)
        embeds = prompt.embeds if prompt.embeds.dim() == 2 else prompt.embeds.reshape(-1, prompt.embeds.shape[-1])
        inserted = prompt.inserted
        if inserted is not None and (inserted.dim() != 2 or inserted.shape[1] != embeds.shape[1]
                                     or not 0 <= prompt.at <= embeds.shape[0]):  # fmt: skip
            raise ValueError(f"inserted rows {tuple(inserted.shape)} at row {prompt.at} of a prompt's "
                             f"{tuple(embeds.shape)} other rows")  # fmt: skip
        checked = replace(prompt, embeds=embeds)
        length = checked.length
        if prompt.positions is not None and (not self.mrope or tuple(prompt.positions.shape) != (3, length)):
            want = "(3, L) for a multimodal-rope decoder" if self.mrope else "none: the decoder's rope is 1-D"
            raise ValueError(f"prompt positions {tuple(prompt.positions.shape)} for {length} rows; expected {want}")
        if prompt.deepstack is not None:
            want_shape = (self.deepstack_levels, length, self.hidden_size)
            if not self.deepstack_levels or tuple(prompt.deepstack.shape) != want_shape:
                raise ValueError(f"prompt deepstack rows {tuple(prompt.deepstack.shape)}; the decoder takes "
                                 f"{want_shape if self.deepstack_levels else 'none'}")  # fmt: skip
        return checked

    def _fill(self, entry: _Prefill, prompts: Sequence[StaticPrompt], lengths: Sequence[int]) -> None:
        """Write the prompts into the prefill's static inputs (and their rope offsets for decoding); padding rows
        and dummy samples get zeros (no NaN can reach a real row anyway) and positions 0..rows-1.

        Only fills write the entry's own inputs, each prompt over its rows 0..L_i-1: after a fill of prompts of the
        same lengths (with positions where those had them) every other row still holds its zeros and base positions,
        and ``last`` its values, so those are written only when that changes (a launch and more of host time each,
        before the prefill's launch)."""
        batch, rows = int(entry.embeds.shape[0]), int(entry.embeds.shape[1])
        filled = tuple((length, p.positions is not None) for p, length in zip(prompts, lengths, strict=True))
        if filled != entry.filled:
            entry.embeds.zero_()
            last = tuple(length - 1 for length in lengths) + (0,) * (batch - len(prompts))
            entry.last.copy_(torch.tensor(last, dtype=torch.long), non_blocking=True)  # no wait for queued work
            if entry.positions is not None:
                entry.positions.copy_(self.positions[:rows])  # 0..rows-1 broadcast over the rope rows and samples
            entry.filled = filled
        for i, prompt in enumerate(prompts):
            prompt.write(entry.embeds[i, : lengths[i]])
        if entry.positions is not None:
            self.rope_delta.zero_()  # shared by every entry: written at each fill
            for i, prompt in enumerate(prompts):
                if prompt.positions is not None:  # device tensors stay on the device: no host sync
                    entry.positions[:, i, : lengths[i]].copy_(prompt.positions, non_blocking=True)
                    self.rope_delta[:, i].copy_(prompt.positions[:, -1] + (1 - lengths[i]), non_blocking=True)
        if entry.deepstack is not None:
            entry.deepstack.zero_()
            for i, prompt in enumerate(prompts):
                if prompt.deepstack is not None:
                    entry.deepstack[:, i, : lengths[i]].copy_(prompt.deepstack)

    def _decode_loop(self, batch: int, span: int, samples: int, max_new_tokens: int, replay: bool) -> list[list[int]]:
        """Collect each sample's tokens step by step; decode until all ended or ``max_new_tokens`` are out."""
        out: list[list[int]] = [[] for _ in range(samples)]
        running = set(range(samples))
        for step in range(max_new_tokens):
            tokens = self.token[:samples, 0].tolist()  # the one host sync per step
            for i in sorted(running):
                out[i].append(int(tokens[i]))
                if tokens[i] in self.eos:
                    running.discard(i)
            if not running or step == max_new_tokens - 1:
                break
            key = (batch, span)
            self.decodes[key] = self._run(lambda: self._decode_step(batch, span), self.decodes.get(key), replay)
        return out
