"""The library pipeline: one backbone, many images, methods and budgets; plain dataclasses out.

Every command of the CLI and every integration goes through :class:`ReductionPipeline`::

    pipe = ReductionPipeline.from_pretrained("tiny-llava", methods=["care", "visionzip"])
    out = pipe(load_image("examples/astronaut.jpg"), "What is the person holding?", [Budget.keep(64)], csr=True)
    out.runs[0].csr, out.runs[0].result.indices

Per image it encodes once, computes the probes the methods need once, the full-sequence CSR reference
once, then per method x budget: reduce -> project -> CSR and/or answers. The pipeline never prints and
never writes files; stage timings are returned in milliseconds. Answers from ``generate=True`` are one plain
greedy answer each; :meth:`ReductionPipeline.time_answers` is the separate, explicit timed comparison (the
protocol of :func:`care_core.timing.alternating_medians`) that ``care reduce --generate`` and the benchmarks call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from care_core.budget import Budget
from care_core.config import CaReConfig
from care_core.errors import BudgetError, CareError, MethodError, QuestionError
from care_core.timing import StageClock, Timed, alternating_medians
from care_core.vocabulary import DEFAULT_QUESTION

if TYPE_CHECKING:
    import torch
    from PIL import Image

    from care_core.backbones.base import ImageTokens, VLMAdapter
    from care_core.csr import CSRReference
    from care_core.generation import Generation
    from care_core.methods.base import Method, MethodInputs, MethodResult
    from care_core.scoring import Scorer


@dataclass(frozen=True)
class Answer:
    """A greedy answer; from :meth:`ReductionPipeline.time_answers` also what it cost (medians over ``repeats``
    alternating, warmed-up rounds; ``repeats`` 0 and no times for a plain answer of ``generate=True``).

    ``prefill_ms``: the language model's forward over the prompt (all positions' logits, eager).
    ``first_token_ms``: :meth:`generate` with one new token from the projected rows -- the prefill as the
    generate path runs it. ``first_token_from_features_ms``: the same, timed from the vision features: the
    method (none for all tokens) and the projector first. ``total_ms``: the whole answer. ``decoding``:
    ``"cuda-graph"`` (replayed graphs over a static KV cache) or ``"eager"`` (``model.generate``);
    ``eager_reason``: why not graphs (None when graphs ran).
    """

    text: str
    visual_tokens: int  # visual rows the language model received
    decoding: str = "eager"
    eager_reason: str | None = None
    prefill_ms: float | None = None
    total_ms: float | None = None
    repeats: int = 0
    first_token_ms: float | None = None
    first_token_from_features_ms: float | None = None
    token_ids: tuple[int, ...] = ()  # the new tokens (the end token included where decoding stopped at one)

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
    timings_ms: dict[str, float] = field(default_factory=dict)  # stages: features, probes, reference
    batch_size: int = 1  # images that shared these timings (and the runs'): one call of run_batch

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


def build_methods(methods: Sequence[str | Method], config: CaReConfig) -> dict[str, Method]:
    """The methods by canonical name (order kept, duplicates dropped): names are built from ``config``, a
    :class:`~care_core.methods.base.Method` instance is taken as it is (with its own hyperparameters)."""
    from care_core.methods import Method, build_method, canonical_name

    out: dict[str, Method] = {}
    for item in methods:
        name = type(item).name if isinstance(item, Method) else canonical_name(item)
        if name not in out:
            out[name] = item if isinstance(item, Method) else build_method(name, config)
    return out


class ReductionPipeline:
    """A loaded backbone and configured methods; call it on images.

    ``skip_unavailable``: leave out (and list in :attr:`skipped`) methods this backbone cannot serve,
    instead of raising MethodError -- what ``--method all`` wants. ``memoize``: share budget-independent
    work between budgets and methods of one image (same results; off only to measure what it saves).
    :attr:`reduction_graphs`: the CUDA graphs of CaRe's single-image reductions this pipeline keeps
    (docs/design/generation.md §Reduction graphs); :meth:`release_graphs` frees them with the decoding cache.
    """

    def __init__(
        self,
        adapter: VLMAdapter,
        methods: Sequence[str | Method] = ("care",),
        config: CaReConfig | None = None,
        *,
        skip_unavailable: bool = False,
        memoize: bool = True,
    ) -> None:
        from care_core.reduction_graphs import ReductionGraphs  # torch: not at start-up

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
        if not self.methods and methods:
            raise MethodError(f"none of the methods can run on {adapter.name}")
        self.load_timings_ms: dict[str, float] = {}
        self.reduction_graphs = ReductionGraphs()

    def release_graphs(self) -> None:
        """Free what this pipeline's CUDA graphs keep: the reduction graphs and their memory pool, and the adapter's
        decoding cache and graphs (:meth:`~care_core.backbones.base.VLMAdapter.release_decoding_cache`); the next
        calls capture anew."""
        self.reduction_graphs.release()
        self.adapter.release_decoding_cache()

    @property
    def scorer(self) -> Scorer:
        """PRCA's scoring state for the adapter's projector, kept with the projector across images and calls
        (:meth:`~care_core.scoring.Scorer.for_projector`): the float32 copy of the projector, the directions and,
        on CUDA, the second layer's triangular factor (made on first use, rebuilt when the weights change)."""
        from care_core.scoring import Scorer

        return Scorer.for_projector(self.adapter.projector)

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

    @property
    def attention_layers(self) -> int:
        """The most language-model layers' attention maps any configured method reads (0: none)."""
        return max((m.attention_layers() for m in self.methods.values()), default=0)

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
        plan: Mapping[str, Sequence[Budget]] | None = None,
        cuda_graph: bool | None = None,
        timed: bool = True,
    ) -> ImageResult:
        """Run every method at every budget on one image (or on tokens from :meth:`encode`).

        ``csr`` needs ``question``. A method that reads the question, and ``generate``, use
        :data:`DEFAULT_QUESTION` where none is given (``question_defaulted`` says so). ``generate``: one greedy
        answer with all tokens and one with each reduction (:meth:`answer`; untimed -- :meth:`time_answers`
        times them). ``plan`` (method -> budgets) runs only those pairs, e.g. what a resumed run still lacks;
        by default every method runs at every budget. ``cuda_graph`` goes to the adapter's ``generate`` (None:
        graphs where the adapter finds them safe); False also keeps every reduction eager. ``timed``: see
        :meth:`run_batch` (untimed, CaRe's reduction may replay from a CUDA graph). The batch of one of
        :meth:`run_batch`.
        """
        return self.run_batch([image], [question], budgets, csr=csr, generate=generate,
                              max_new_tokens=max_new_tokens, plans=None if plan is None else [plan],
                              cuda_graph=cuda_graph, timed=timed)[0]  # fmt: skip

    def run_batch(
        self,
        images: Sequence[Image.Image | ImageTokens],
        questions: Sequence[str | None] | None = None,
        budgets: Sequence[Budget] = (Budget("ratio", 0.11),),
        *,
        csr: bool = False,
        generate: bool = False,
        max_new_tokens: int = 32,
        plans: Sequence[Mapping[str, Sequence[Budget]] | None] | None = None,
        cuda_graph: bool | None = None,
        timed: bool = True,
    ) -> list[ImageResult]:
        """:meth:`__call__` on several images at once (``questions[i]`` and ``plans[i]`` for image i): per image
        the result it gets alone (docs/design/batches.md §Batches). The vision tower runs once for the batch where the
        backbone allows, each method once per budget for every image (:meth:`Method.batch`), and the answers in
        batches (:meth:`VLMAdapter.generate_batch`). Stage timings are the whole batch's (``batch_size`` says
        how many images shared them), measured with CUDA synchronised around every stage, which is what makes
        them meaningful and what costs: ``timed=False`` synchronises nowhere for timing, leaves every
        ``timings_ms`` empty and hands the methods no stage timer, so that on CUDA CaRe's fresh reduction of a
        batch of one goes through :attr:`reduction_graphs` (captured when its shape comes back, replayed after:
        docs/design/generation.md §Reduction graphs; same results; what callers that ignore timings want, e.g.
        ``care csr``)."""
        import torch

        from care_core.csr import csr_reference

        count = len(images)
        questions, plans = _one_per_image(count, questions, plans)
        asked = [self._question(q, csr=csr, generate=generate) for q in questions]
        if not budgets:
            raise BudgetError("give at least one budget")
        _check_new_tokens(max_new_tokens)
        clock = StageClock(self.adapter.device, timed=timed)
        with torch.no_grad():
            tokens = self._encode_all(images, clock)
            pairs = [list(self._pairs(t, budgets, plan)) for t, plan in zip(tokens, plans, strict=True)]
            inputs = [self.method_inputs(t, q, clock=clock, question_embeddings=csr, cuda_graph=cuda_graph,
                                         planned_keeps=sorted({k for _, _, k in image_pairs}))
                      for t, (q, _), image_pairs in zip(tokens, asked, pairs, strict=True)]  # fmt: skip
            full: list[torch.Tensor] = []
            references: list[CSRReference | None] = [None] * count
            if csr or generate:
                with clock("reference"):
                    full = [self.adapter.projector(t.features) for t in tokens]
                    if csr:
                        references = [csr_reference(rows, one.probes["question"])
                                      for rows, one in zip(full, inputs, strict=True)]  # fmt: skip
            runs = self._run_groups(pairs, inputs, references, timed=timed)
            full_answers: list[Answer | None] = [None] * count
            if generate:
                said = [q or DEFAULT_QUESTION for q, _ in asked]  # generate always has one (see _question)
                options: dict[str, Any] = {"max_new_tokens": max_new_tokens, "cuda_graph": cuda_graph}
                full_answers = list(self.answer_batch(tokens, said, full, [None] * count, **options))
                self._answer_runs(tokens, said, runs, options)
        timings = {key: round(ms, 3) for key, ms in clock.ms.items()}
        return [ImageResult(t, q, d, r, a, dict(timings), batch_size=count)
                for t, (q, d), r, a in zip(tokens, asked, runs, full_answers, strict=True)]  # fmt: skip

    def _encode_all(self, images: Sequence[Image.Image | ImageTokens], clock: StageClock) -> list[ImageTokens]:
        """Every image's tokens: those given as tokens as they are, the others through one batched encode."""
        from care_core.backbones.base import ImageTokens

        todo = [i for i, image in enumerate(images) if not isinstance(image, ImageTokens)]
        out: list[Any] = list(images)
        if todo:
            with clock("features"):
                encoded = self.adapter.encode_images([images[i] for i in todo])  # type: ignore[misc]
            for i, one in zip(todo, encoded, strict=True):
                out[i] = one
        return out

    def _run_groups(
        self,
        pairs: list[list[tuple[str, Budget, int]]],
        inputs: list[MethodInputs],
        references: list[CSRReference | None],
        *,
        timed: bool = True,
    ) -> list[list[MethodRun]]:
        """Each (method, budget) once over every image that has it; per image its runs in :meth:`_pairs` order.
        Every CSR of the call is read back at the end, together (:func:`_read_csr`)."""
        runs: list[list[MethodRun]] = [[] for _ in pairs]
        groups: dict[tuple[str, Budget], list[tuple[int, int]]] = {}
        for i, image_pairs in enumerate(pairs):
            for name, budget, k in image_pairs:
                groups.setdefault((name, budget), []).append((i, k))
        pending: list[tuple[MethodRun, torch.Tensor, CSRReference]] = []
        for (name, budget), members in groups.items():
            items, scores = self._run([inputs[i] for i, _ in members], name, budget, [k for _, k in members],
                                      [references[i] for i, _ in members], timed=timed)  # fmt: skip
            for (i, _), item, score in zip(members, items, scores, strict=True):
                runs[i].append(item)
                reference = references[i]
                if score is not None and reference is not None:
                    pending.append((item, score, reference))
        _read_csr(pending)
        return runs

    def _answer_runs(
        self, tokens: list[ImageTokens], questions: list[Any], runs: list[list[MethodRun]], options: dict[str, Any]
    ) -> None:
        """Every run's answer, one batch per (method, budget) over the images that have it."""
        groups: dict[tuple[str, Budget], list[tuple[int, MethodRun]]] = {}
        for i, image_runs in enumerate(runs):
            for item in image_runs:
                groups.setdefault((item.method, item.budget), []).append((i, item))
        for members in groups.values():
            answers = self.answer_batch([tokens[i] for i, _ in members], [questions[i] for i, _ in members],
                                        [item.projected for _, item in members],
                                        [item.result.token_index for _, item in members], **options)  # fmt: skip
            for (_, item), answer in zip(members, answers, strict=True):
                item.answer = answer

    def _question(self, question: str | None, *, csr: bool, generate: bool) -> tuple[str | None, bool]:
        """(the question used, whether :data:`DEFAULT_QUESTION` stood in for a missing one)."""
        if question is not None and not question.strip():
            raise QuestionError("is empty", parameter="question")
        if csr and question is None:
            raise QuestionError("CSR needs a question")
        defaulted = question is None and (bool(self.needs & {"question", "language_model"}) or generate)
        return (DEFAULT_QUESTION if defaulted else question), defaulted

    def _pairs(
        self, tokens: ImageTokens, budgets: Sequence[Budget], plan: Mapping[str, Sequence[Budget]] | None
    ) -> Iterator[tuple[str, Budget, int]]:
        """(method, budget, K) in run order: every method at every budget, or only the pairs of ``plan``."""
        ks = {b: b.resolve(tokens.num_tokens) for b in budgets}
        for name in self.methods:
            wanted = ks if plan is None else {b: ks[b] for b in plan.get(name, ()) if b in ks}
            for budget, k in wanted.items():
                yield name, budget, k

    def method_inputs(
        self,
        tokens: ImageTokens,
        question: str | None,
        *,
        clock: StageClock | None = None,
        question_embeddings: bool = False,
        memo: bool = True,
        planned_keeps: Sequence[int] = (),
        cuda_graph: bool | None = None,
    ) -> MethodInputs:
        """The methods' inputs for one image: the probes the methods need (timed as "probes" on ``clock``), the
        question's embeddings where a method reads them (or ``question_embeddings``), the pipeline's scorer, its
        :attr:`reduction_graphs` (not with ``cuda_graph=False``: then every reduction runs eagerly) and,
        with ``memo`` (and :attr:`memoize`), a memo that shares budget-independent work (PRCA's psi_bar,
        ZOO-Prune's sensitivity, the greedy orders, computed at the largest of ``planned_keeps``, the budgets' K
        the caller will ask for) between every budget and method of the image."""
        from care_core.methods.base import MethodInputs

        vision_needs = sorted(self.needs - {"question"})
        probes: dict[str, Any] = {}
        if vision_needs:
            with clock("probes") if clock is not None else nullcontext():
                probes = self.adapter.probe_inputs(tokens, vision_needs, question=question)
        if question is not None and ("question" in self.needs or question_embeddings):
            probes["question"] = self.adapter.question_embeddings(question)
        return MethodInputs(tokens.features, self.adapter.projector, tokens.positions, grid=tokens.grid,
                            probes=probes, seed=self.config.seed, memo={} if self.memoize and memo else None,
                            scorer=self.scorer, planned_keeps=tuple(planned_keeps),
                            graphs=None if cuda_graph is False else self.reduction_graphs)  # fmt: skip

    def _run(
        self,
        inputs: list[MethodInputs],
        name: str,
        budget: Budget,
        keeps: list[int],
        references: list[CSRReference | None],
        *,
        timed: bool = True,
    ) -> tuple[list[MethodRun], list[torch.Tensor | None]]:
        """Method ``name`` at K = ``keeps[i]`` on every image of ``inputs`` at once, then the projector per image,
        then CSR against ``references[i]`` (where given); timed for the whole group (unless not ``timed``). The
        runs, and their CSR as 0-dim tensors (None without a reference), not yet read: the caller reads them all
        at once (:func:`_read_csr`), so that the host never waits for the GPU between groups."""
        from care_core.csr import csr_tensor_from_reference

        adapter = self.adapter
        clock = StageClock(adapter.device, timed=timed)
        # copies of the inputs carry this call's timer (none when untimed: CaRe's single-image reduction may then
        # replay from a CUDA graph, which has no stages to time); the shared memo stays shared
        timer = clock if clock.timed else None
        with clock("method"):
            results = self.methods[name].batch([dataclasses.replace(one, stage_timer=timer) for one in inputs], keeps)
        inner = sum(ms for stage, ms in clock.ms.items() if stage != "method")
        if inner:  # the method timed its own stages: "method" keeps only the time outside them
            clock.ms["method"] -= inner
        with clock("projection"):  # per image: a taller product would round differently from the batch of one
            projected = [adapter.projector(result.tokens.to(adapter.dtype)) for result in results]
        items = [MethodRun(name, budget, k, result, rows)
                 for k, result, rows in zip(keeps, results, projected, strict=True)]  # fmt: skip
        scores: list[torch.Tensor | None] = [None] * len(items)
        for i, (item, reference) in enumerate(zip(items, references, strict=True)):
            if reference is not None:  # per image: a batched product would round differently from the batch of one
                with clock("csr"):  # timed: the clock's sync waits for the kernels, not the read-back (_read_csr)
                    scores[i] = csr_tensor_from_reference(reference, item.projected)
        timings = {key: round(ms, 3) for key, ms in clock.ms.items()}
        for item in items:
            item.timings_ms = dict(timings)
        return items, scores

    def answer(
        self,
        tokens: ImageTokens,
        question: str,
        projected: torch.Tensor,
        kept: torch.Tensor | None = None,
        *,
        max_new_tokens: int = 32,
        cuda_graph: bool | None = None,
    ) -> Answer:
        """The greedy answer of the language model fed ``projected`` (``kept``: each row's token index, see
        :meth:`~care_core.backbones.base.VLMAdapter.generate`); one plain, untimed ``generate``."""
        out = self.adapter.generate(question, tokens, projected, max_new_tokens=max_new_tokens, kept=kept,
                                    cuda_graph=cuda_graph)  # fmt: skip
        fed = self.adapter.visual_tokens_fed(tokens, int(projected.shape[0]), kept)
        return Answer(out.text, fed, out.decoding, out.eager_reason, token_ids=out.token_ids)

    def answer_batch(
        self,
        tokens: Sequence[ImageTokens],
        questions: Sequence[str],
        projected: Sequence[torch.Tensor],
        kept: Sequence[torch.Tensor | None],
        *,
        max_new_tokens: int = 32,
        cuda_graph: bool | None = None,
    ) -> list[Answer]:
        """:meth:`answer` for several samples in one :meth:`~care_core.backbones.base.VLMAdapter.generate_batch`
        (device ``kept`` stays there: the batch's prompts and prefill are queued before anything is read back)."""
        outs = self.adapter.generate_batch(list(questions), list(tokens), list(projected), list(kept),
                                           max_new_tokens=max_new_tokens, cuda_graph=cuda_graph)  # fmt: skip
        return [Answer(out.text, self.adapter.visual_tokens_fed(t, int(rows.shape[0]), k), out.decoding,
                       out.eager_reason, token_ids=out.token_ids)
                for out, t, rows, k in zip(outs, tokens, projected, kept, strict=True)]  # fmt: skip

    def time_answers(
        self, result: ImageResult, *, max_new_tokens: int = 32, repeats: int = 3, cuda_graph: bool | None = None
    ) -> ImageResult:
        """``result`` with timed answers: with all tokens and with each run's rows, each side timed for its
        prefill, its first token (from the rows, and from the vision features: the method re-run without memo,
        then the projector) and its whole answer, by :func:`~care_core.timing.alternating_medians` (untimed warm-up
        rounds that also capture every CUDA graph, then ``repeats`` alternating rounds; medians). ``cuda_graph``: the
        answers' decoding (see :meth:`answer`); and, unless False, CaRe's re-run on CUDA replays its reduction from
        :attr:`reduction_graphs` (bitwise the eager result; captured at a key's
        :data:`~care_core.reduction_graphs.CAPTURE_ON_SIGHTING`-th call, so that many warm-up rounds, else one).

        The question is the result's, or :data:`DEFAULT_QUESTION` where it had none. What ``care reduce
        --generate`` reports; the answers' texts are those of :meth:`answer`.
        """
        import torch

        from care_core.reduction_graphs import CAPTURE_ON_SIGHTING

        _check_new_tokens(max_new_tokens)
        tokens = result.tokens
        question = result.question if result.question is not None else DEFAULT_QUESTION
        adapter = self.adapter
        # a reduction graph is captured at its key's CAPTURE_ON_SIGHTING-th call: as many warm-up rounds where the
        # re-runs may go through the graphs, so that every timed round replays
        graphs_used = cuda_graph is not False and adapter.device.type == "cuda"
        warmup = CAPTURE_ON_SIGHTING if graphs_used else 1
        with torch.no_grad():
            inputs = self.method_inputs(tokens, question, memo=False, cuda_graph=cuda_graph)
            full = adapter.projector(tokens.features)
            sides: list[tuple[torch.Tensor, torch.Tensor | None, Callable[[], tuple[torch.Tensor, Any]]]] = [
                (full, None, lambda: (adapter.projector(tokens.features), None))
            ]
            sides += [(item.projected, item.result.token_index, self._rerun(item, inputs)) for item in result.runs]
            feeds = [self._timed_feed(tokens, question, rows, kept, prepare, max_new_tokens, cuda_graph)
                     for rows, kept, prepare in sides]  # fmt: skip
            timed = alternating_medians(feeds, repeats, warmup=warmup, device=adapter.device)
        answers = [_timed_answer(one, adapter.visual_tokens_fed(tokens, int(rows.shape[0]), kept))
                   for one, (rows, kept, _) in zip(timed, sides, strict=True)]  # fmt: skip
        runs = [dataclasses.replace(item, answer=answer) for item, answer in zip(result.runs, answers[1:], strict=True)]
        defaulted = result.question_defaulted or result.question is None
        return dataclasses.replace(result, question=question, question_defaulted=defaulted, runs=runs,
                                   full_answer=answers[0])  # fmt: skip

    def _timed_feed(
        self,
        tokens: ImageTokens,
        question: str,
        projected: torch.Tensor,
        kept: torch.Tensor | None,
        prepare: Callable[[], tuple[torch.Tensor, torch.Tensor | None]],
        max_new_tokens: int,
        cuda_graph: bool | None,
    ) -> Callable[[StageClock], Generation]:
        """One side of :meth:`time_answers`: its stages on the clock it is given; returns the whole answer."""
        adapter = self.adapter

        def generate(rows: torch.Tensor, rows_kept: torch.Tensor | None, new_tokens: int) -> Generation:
            return adapter.generate(question, tokens, rows, max_new_tokens=new_tokens, kept=rows_kept,
                                    cuda_graph=cuda_graph)  # fmt: skip

        def run(clock: StageClock) -> Generation:
            with clock("prefill"):
                adapter.language_model_logits(question, tokens, projected, kept=kept)
            with clock("first_token"):
                generate(projected, kept, 1)
            with clock("first_token_from_features"):
                rows, rows_kept = prepare()
                generate(rows, rows_kept, 1)
            with clock("total"):
                return generate(projected, kept, max_new_tokens)

        return run

    def _rerun(self, item: MethodRun, inputs: MethodInputs) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """``item``'s method again from the features (nothing memoised, nothing timed inside: a fresh reduction, which
        CaRe replays from the inputs' graphs where they are given), then the projector."""
        method, adapter, k = self.methods[item.method], self.adapter, item.keep
        fresh = dataclasses.replace(inputs, memo=None, stage_timer=None)

        def run() -> tuple[torch.Tensor, torch.Tensor]:
            result = method(fresh, k)
            return adapter.projector(result.tokens.to(adapter.dtype)), result.token_index

        return run


def _read_csr(pending: list[tuple[MethodRun, torch.Tensor, CSRReference]]) -> None:
    """Each run's CSR from its 0-dim tensor (and whether its reference's weights are uniform), all in one host
    sync instead of one per image and group: ``torch.stack(...).tolist()`` gives each the float that
    ``float(tensor)`` would (the same values, read exactly)."""
    import torch

    if not pending:
        return
    values = torch.stack([score for _, score, _ in pending]).tolist()
    for (item, _, reference), value in zip(pending, values, strict=True):
        item.csr = value
        item.uniform_weights = reference.uniform  # read once per reference (cached), after the queue has drained


def _one_per_image(
    count: int, questions: Sequence[str | None] | None, plans: Sequence[Mapping[str, Sequence[Budget]] | None] | None
) -> tuple[list[str | None], list[Mapping[str, Sequence[Budget]] | None]]:
    """:meth:`ReductionPipeline.run_batch`'s questions and plans, one per image (None: none for any image)."""
    asked: list[str | None] = [None] * count if questions is None else list(questions)
    planned: list[Mapping[str, Sequence[Budget]] | None] = [None] * count if plans is None else list(plans)
    if count == 0 or len(asked) != count or len(planned) != count:
        raise CareError(f"need one question and plan per image: {count} images, {len(asked)} questions, "
                        f"{len(planned)} plans", parameter="images")  # fmt: skip
    return asked, planned


def _check_new_tokens(max_new_tokens: int) -> None:
    if max_new_tokens < 1:
        raise CareError(f"must be at least 1, got {max_new_tokens}", parameter="max_new_tokens")


def _timed_answer(timed: Timed[Generation], visual_tokens: int) -> Answer:
    out, ms = timed.value, timed.medians_ms
    return Answer(
        text=out.text,
        visual_tokens=visual_tokens,
        decoding=out.decoding,
        eager_reason=out.eager_reason,
        prefill_ms=ms["prefill"],
        total_ms=ms["total"],
        repeats=timed.rounds,
        first_token_ms=ms["first_token"],
        first_token_from_features_ms=ms["first_token_from_features"],
        token_ids=out.token_ids,
    )


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
