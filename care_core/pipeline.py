"""The library pipeline: one backbone, many images, methods and budgets; plain dataclasses out.

Every command of the CLI and every integration goes through :class:`ReductionPipeline`::

    pipe = ReductionPipeline.from_pretrained("tiny-llava", methods=["care", "visionzip"])
    out = pipe(load_image("examples/astronaut.jpg"), "What is the person holding?", [Budget.keep(64)], csr=True)
    out.runs[0].csr, out.runs[0].result.indices

Per image it encodes once, computes the probes the methods need once, the full-sequence CSR reference
once, then per method x budget: reduce -> project -> CSR and/or answers. The pipeline never prints and
never writes files; stage timings are returned in milliseconds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from care_core.budget import Budget
from care_core.config import CaReConfig
from care_core.errors import BudgetError, CareError, MethodError, QuestionError
from care_core.timing import StageClock, median_ms

if TYPE_CHECKING:
    import torch
    from PIL import Image

    from care_core.backbones.base import ImageTokens, VLMAdapter
    from care_core.methods.base import Method, MethodInputs, MethodResult
    from care_core.scoring import Scorer

#: The question used where one is needed (a question-reading method, ``generate``) and none is given.
DEFAULT_QUESTION = "Describe the image."


@dataclass(frozen=True)
class Answer:
    """A greedy answer and what it cost: medians over ``repeats`` alternating, warmed-up runs.

    ``prefill_ms``: the language model's forward over the prompt (all positions' logits, eager).
    ``first_token_ms``: :meth:`generate` with one new token from the projected rows -- the prefill as the
    generate path runs it. ``first_token_from_features_ms``: the same, timed from the vision features: the
    method (none for all tokens) and the projector first. ``total_ms``: the whole answer. ``decoding``:
    ``"cuda-graph"`` (replayed graphs over a static KV cache) or ``"eager"`` (``model.generate``).
    """

    text: str
    visual_tokens: int  # visual rows the language model received
    prefill_ms: float
    total_ms: float
    repeats: int
    first_token_ms: float | None = None
    first_token_from_features_ms: float | None = None
    decoding: str = "eager"

    def to_dict(self) -> dict[str, Any]:
        return {"visual_tokens": self.visual_tokens, "answer": self.text, "decoding": self.decoding,
                "prefill_ms": self.prefill_ms, "first_token_ms": self.first_token_ms,
                "first_token_from_features_ms": self.first_token_from_features_ms, "total_ms": self.total_ms,
                "repeats": self.repeats}  # fmt: skip


@dataclass
class MethodRun:
    """One method at one budget on one image."""

    method: str
    budget: Budget
    keep: int  # K
    result: MethodResult
    projected: torch.Tensor  # (K_out, d_t) rows handed to the language model
    csr: float | None = None  # CSR in [0, 1] (Supp. A); None without a question
    uniform_weights: bool | None = None  # the CSR reference fell back to uniform weights
    answer: Answer | None = None
    timings_ms: dict[str, float] = field(default_factory=dict)

    @property
    def category(self) -> str:
        from care_core.methods import method_class

        return method_class(self.method).category


@dataclass
class ImageResult:
    """Everything the pipeline computed for one image."""

    tokens: ImageTokens
    question: str | None  # the question used (None where nothing needed one)
    question_defaulted: bool  # True when DEFAULT_QUESTION stood in for a missing question
    runs: list[MethodRun]
    full_answer: Answer | None = None
    timings_ms: dict[str, float] = field(default_factory=dict)  # per-image stages: features, probes, reference

    @property
    def num_tokens(self) -> int:
        return self.tokens.num_tokens

    def run(self, method: str, budget: Budget | None = None) -> MethodRun:
        for item in self.runs:
            if item.method == method and (budget is None or item.budget == budget):
                return item
        raise KeyError((method, budget))


@dataclass(frozen=True)
class BackboneInfo:
    """How every output names the backbone: what was loaded, and whether it is a demo."""

    name: str
    family: str
    demo: bool
    note: str | None  # the demo's caption (random or trained weights); None for a real model
    device: str
    dtype: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "family": self.family, "demo": self.demo, "note": self.note,
                "device": self.device, "dtype": self.dtype}  # fmt: skip


def backbone_info(adapter: VLMAdapter) -> BackboneInfo:
    from care_core.backbones.demo import RANDOM_DEMO_NOTE

    note = adapter.demo_note
    if note is None and adapter.is_demo:  # an adapter built by hand with is_demo=True
        note = RANDOM_DEMO_NOTE
    return BackboneInfo(
        name=str(adapter.name),
        family=adapter.family,
        demo=bool(adapter.is_demo),
        note=note,
        device=str(adapter.device),
        dtype=str(adapter.dtype).removeprefix("torch."),
    )


def build_methods(names: Sequence[str], config: CaReConfig) -> dict[str, Method]:
    """The named methods (canonical names, order kept, duplicates dropped) configured from ``config``."""
    from care_core.methods import build_method, canonical_name

    canonical = list(dict.fromkeys(canonical_name(n) for n in names))
    return {name: build_method(name, config) for name in canonical}


class ReductionPipeline:
    """A loaded backbone and configured methods; call it on images.

    ``skip_unavailable``: leave out (and list in :attr:`skipped`) methods this backbone cannot serve,
    instead of raising MethodError -- what ``--method all`` wants. ``memoize``: share budget-independent
    work between budgets and methods of one image (same results; off only to measure what it saves).
    """

    def __init__(
        self,
        adapter: VLMAdapter,
        methods: Sequence[str] = ("care",),
        config: CaReConfig | None = None,
        *,
        skip_unavailable: bool = False,
        memoize: bool = True,
    ) -> None:
        self.adapter = adapter
        self.memoize = memoize
        self.config = config or CaReConfig()
        self.skipped: list[dict[str, str]] = []
        self.methods: dict[str, Method] = {}
        for name, method in build_methods(methods, self.config).items():
            reason = unavailable_reason(method, adapter)
            if reason is None:
                self.methods[name] = method
            elif skip_unavailable:
                self.skipped.append({"method": name, "reason": reason})
            else:
                raise MethodError(reason)
        if not self.methods:
            raise MethodError(f"none of the methods can run on {adapter.name}")
        self.load_timings_ms: dict[str, float] = {}
        self._scorer: Scorer | None = None

    @property
    def scorer(self) -> Scorer:
        """PRCA's scoring state for the adapter's projector, kept across images: the float32 copy of the
        projector, the directions and, on CUDA, the second layer's triangular factor (made on first use)."""
        if self._scorer is None or self._scorer.projector is not self.adapter.projector:
            from care_core.scoring import Scorer

            self._scorer = Scorer(self.adapter.projector)
        return self._scorer

    @classmethod
    def from_pretrained(
        cls,
        model: str | None = None,
        *,
        methods: Sequence[str] = ("care",),
        config: CaReConfig | None = None,
        device: str = "auto",
        dtype: str | None = None,
        skip_unavailable: bool = False,
    ) -> ReductionPipeline:
        """Load ``model`` offline (a demo name, a local folder or a cached repo id) and configure the methods.

        Method names are checked before anything heavy is imported. ``load_timings_ms`` then holds
        ``import`` (torch + transformers) and ``load`` (building or reading the weights) separately.
        """
        config = config or CaReConfig()
        build_methods(methods, config)  # unknown names fail before torch is imported
        clock = StageClock()
        with clock("import"):
            import torch  # noqa: F401
            import transformers  # noqa: F401

            from care_core.backbones import load_backbone
        with clock("load"):
            adapter = load_backbone(model, device=device, dtype=None if dtype in (None, "auto") else dtype)
        pipe = cls(adapter, methods, config, skip_unavailable=skip_unavailable)
        pipe.load_timings_ms = {name: round(ms, 3) for name, ms in clock.ms.items()}
        return pipe

    @property
    def backbone(self) -> BackboneInfo:
        return backbone_info(self.adapter)

    @property
    def needs(self) -> frozenset[str]:
        """Every probe the configured methods read."""
        return frozenset().union(*(m.needs for m in self.methods.values()))

    def encode(self, image: Image.Image) -> ImageTokens:
        import torch

        with torch.no_grad():
            return self.adapter.encode_image(image)

    def __call__(
        self,
        image: Image.Image | ImageTokens,
        question: str | None = None,
        budgets: Sequence[Budget] = (Budget("ratio", 0.11),),
        *,
        csr: bool = False,
        generate: bool = False,
        max_new_tokens: int = 32,
        repeats: int = 3,
        plan: Mapping[str, Sequence[Budget]] | None = None,
        cuda_graph: bool | None = None,
    ) -> ImageResult:
        """Run every method at every budget on one image (or on tokens from :meth:`encode`).

        ``csr`` needs ``question``. A method that reads the question, and ``generate``, use
        :data:`DEFAULT_QUESTION` where none is given (``question_defaulted`` says so). ``generate`` answers
        with all tokens and with each reduction: one untimed warm-up each, then ``repeats`` rounds in
        alternating order; times are medians. ``plan`` (method -> budgets) runs only those pairs, e.g. what a
        resumed run still lacks; by default every method runs at every budget. ``cuda_graph`` goes to the
        adapter's ``generate`` (None: graphs where the adapter finds them safe).
        """
        import torch

        from care_core.backbones.base import ImageTokens
        from care_core.csr import csr_from_reference, csr_reference
        from care_core.methods.base import MethodInputs

        if question is not None and not question.strip():
            raise QuestionError("is empty", parameter="question")
        if csr and question is None:
            raise QuestionError("CSR needs a question")
        if not budgets:
            raise BudgetError("give at least one budget")
        if max_new_tokens < 1:
            raise CareError(f"must be at least 1, got {max_new_tokens}", parameter="max_new_tokens")
        if repeats < 1:
            raise CareError(f"must be at least 1, got {repeats}", parameter="repeats")
        reads_question = bool(self.needs & {"question", "language_model"})
        defaulted = question is None and (reads_question or generate)
        asked = DEFAULT_QUESTION if defaulted else question
        adapter = self.adapter
        clock = StageClock(adapter.device)
        with torch.no_grad():
            if isinstance(image, ImageTokens):
                tokens = image
            else:
                with clock("features"):
                    tokens = adapter.encode_image(image)
            n = tokens.num_tokens
            ks = {b: b.resolve(n) for b in budgets}
            vision_needs = sorted(self.needs - {"question"})
            probes: dict[str, Any] = {}
            if vision_needs:
                with clock("probes"):
                    probes = adapter.probe_inputs(tokens, vision_needs, question=asked)
            question_embeds = None
            if asked is not None and ("question" in self.needs or csr):
                question_embeds = adapter.question_embeddings(asked)
                probes["question"] = question_embeds
            full = None
            reference = None
            if csr or generate:
                with clock("reference"):
                    full = adapter.projector(tokens.features)
                    if csr:
                        assert question_embeds is not None
                        reference = csr_reference(full, question_embeds)
            runs: list[MethodRun] = []
            # one set of inputs per image: its memo lets budget-independent work (PRCA's psi_bar, ZOO-Prune's
            # sensitivity) run once for every budget and every method that shares it
            inputs = MethodInputs(tokens.features, adapter.projector, tokens.positions, grid=tokens.grid,
                                  probes=probes, seed=self.config.seed, memo={} if self.memoize else None,
                                  scorer=self.scorer)  # fmt: skip
            for name, method in self.methods.items():
                wanted = ks if plan is None else {b: ks[b] for b in plan.get(name, ()) if b in ks}
                for budget, k in wanted.items():
                    run_clock = StageClock(adapter.device)
                    inputs.stage_timer = run_clock
                    with run_clock("method"):
                        result = method(inputs, k)
                    inner = sum(ms for stage, ms in run_clock.ms.items() if stage != "method")
                    if inner:  # the method timed its own stages: "method" keeps only the time outside them
                        run_clock.ms["method"] -= inner
                    with run_clock("projection"):
                        projected = adapter.projector(result.tokens.to(adapter.dtype))
                    item = MethodRun(name, budget, k, result, projected)
                    if reference is not None:
                        with run_clock("csr"):
                            item.csr = csr_from_reference(reference, projected)
                        item.uniform_weights = bool(reference.uniform)
                    item.timings_ms = {key: round(ms, 3) for key, ms in run_clock.ms.items()}
                    runs.append(item)
            full_answer = None
            if generate:
                assert asked is not None and full is not None
                feeds: list[tuple[Any, torch.Tensor, torch.Tensor | None]] = [(None, full, None)]
                feeds += [(item, item.projected, item.result.token_index) for item in runs]
                features = tokens.features

                def project_all() -> tuple[torch.Tensor, None]:
                    return adapter.projector(features), None

                prepare = [project_all] + [self._rerun(item, inputs) for item in runs]
                answers = self._answers(tokens, asked, feeds, max_new_tokens, repeats, prepare=prepare,
                                        cuda_graph=cuda_graph)  # fmt: skip
                full_answer = answers[0]
                for item, answer in zip(runs, answers[1:], strict=True):
                    item.answer = answer
        return ImageResult(tokens, asked, defaulted, runs, full_answer,
                           {key: round(ms, 3) for key, ms in clock.ms.items()})  # fmt: skip

    def _rerun(self, item: MethodRun, inputs: MethodInputs) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """``item``'s method again from the features (nothing memoised, nothing timed inside), then the projector."""
        import dataclasses

        method, adapter, k = self.methods[item.method], self.adapter, item.keep
        fresh = dataclasses.replace(inputs, memo=None, stage_timer=None)

        def run() -> tuple[torch.Tensor, torch.Tensor]:
            result = method(fresh, k)
            return adapter.projector(result.tokens.to(adapter.dtype)), result.token_index

        return run

    def _answers(
        self,
        tokens: ImageTokens,
        question: str,
        feeds: list[tuple[Any, torch.Tensor, torch.Tensor | None]],
        max_new_tokens: int,
        repeats: int,
        *,
        prepare: Sequence[Callable[[], tuple[torch.Tensor, torch.Tensor | None]]] | None = None,
        cuda_graph: bool | None = None,
    ) -> list[Answer]:
        """Greedy answers for each feed: warm-ups first (a prefill and a whole answer each, which also captures
        any CUDA graphs), then rounds in alternating order; medians. ``prepare[i]`` recomputes feed i's rows
        from the features for the timed first token from features."""
        adapter = self.adapter
        options: dict[str, Any] = {} if cuda_graph is None else {"cuda_graph": cuda_graph}

        def generate(projected: torch.Tensor, kept: torch.Tensor | None, new_tokens: int) -> str:
            return adapter.generate(question, tokens, projected, max_new_tokens=new_tokens, kept=kept, **options)

        for _, projected, kept in feeds:  # warm-up: first-call costs (allocations, kernels) stay out of the times
            adapter.language_model_logits(question, tokens, projected, kept=kept)
        for _, projected, kept in feeds:
            generate(projected, kept, max_new_tokens)
        times: dict[str, list[list[float]]] = {}
        texts: list[str] = ["" for _ in feeds]
        decoding: list[str] = ["eager" for _ in feeds]
        order = list(range(len(feeds)))
        for round_index in range(repeats):
            for i in order if round_index % 2 == 0 else order[::-1]:
                _, projected, kept = feeds[i]
                clock = StageClock(adapter.device)
                with clock("prefill"):
                    adapter.language_model_logits(question, tokens, projected, kept=kept)
                with clock("first_token"):
                    generate(projected, kept, 1)
                if prepare is not None:
                    with clock("first_token_from_features"):
                        rows, rows_kept = prepare[i]()
                        generate(rows, rows_kept, 1)
                with clock("total"):
                    texts[i] = generate(projected, kept, max_new_tokens)
                decoding[i] = getattr(adapter, "last_decoding", "eager")
                for stage, ms in clock.ms.items():
                    times.setdefault(stage, [[] for _ in feeds])[i].append(ms)

        def med(stage: str, i: int) -> float | None:
            return median_ms(times[stage][i]) if stage in times else None

        return [
            Answer(
                text=texts[i],
                visual_tokens=adapter.visual_tokens_fed(tokens, int(projected.shape[0]), kept),
                prefill_ms=median_ms(times["prefill"][i]),
                total_ms=median_ms(times["total"][i]),
                repeats=repeats,
                first_token_ms=med("first_token", i),
                first_token_from_features_ms=med("first_token_from_features", i),
                decoding=decoding[i],
            )
            for i, (_, projected, kept) in enumerate(feeds)
        ]


def unavailable_reason(method: Method, adapter: VLMAdapter) -> str | None:
    """Why ``method`` cannot run on ``adapter`` (one line), or None when it can."""
    name = type(method).name
    try:  # the probes a method needs say most precisely what is missing (e.g. a CLS token)
        adapter.check_probes(sorted(set(method.needs) - {"question"}), name)
    except MethodError as exc:
        return str(exc)
    lacking = method.why_not_served(adapter.family)
    if lacking is None:
        return None
    why = f": it needs {lacking}, which this backbone does not offer"
    return f"method {name!r} cannot run on {adapter.name} ({adapter.family} backbone){why}"


def method_unavailable(name: str, config: CaReConfig, adapter: VLMAdapter) -> str | None:
    """Why the registered method ``name`` cannot run on ``adapter`` (one line), or None when it can."""
    from care_core.methods import build_method

    return unavailable_reason(build_method(name, config), adapter)
