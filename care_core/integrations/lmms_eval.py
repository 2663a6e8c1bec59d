"""lmms-eval models that answer with a reduced set of visual tokens, and the helpers ``care eval`` runs on.

Registered through the entry point group ``lmms_eval.models`` (see :func:`manifests`), one model per id:

* ``care`` (alias ``care_vtr``): any backbone care loads;
* each ``lmms_eval_model`` id that a family record names (``care_llava``, ``care_qwen2_5_vl``, ...), with the
  ``lmms_eval_aliases`` of its records: the checkpoints of those families only. These classes are made from
  :class:`CareLMM` on first use (:func:`model_class`; lmms-eval reaches them as this module's attribute of the
  id's name), so a family registered with ``register_family`` before lmms-eval reads the entry point gets its own.

``model_args``: ``pretrained`` (a local folder, a cached repo id or a demo name such as ``tiny-llava``),
``method`` (any registered method, or ``none`` for all visual tokens), ``keep=K`` or ``ratio=R``, ``device``,
``dtype`` and CaRe's hyperparameters by their CaReConfig names (``lam``, ``m``, ``seed``, ...)::

    lmms-eval --model care --model_args pretrained=tiny-llava,method=visionzip,keep=64 \\
        --include_path examples/tasks/care_pope_examples --tasks care_pope_examples

Each sample is answered through the library's reduced-token path, the same code as ``care reduce --generate``:
the image is encoded once, :class:`care_core.pipeline.ReductionPipeline` reduces its N visual tokens to K and
projects them, and the adapter's ``generate(question, tokens, projected, kept=...)`` decodes greedily with exactly
those K rows as the image. Requests are answered in batches of ``batch_size`` (lmms-eval's ``--batch_size``; each
sample still has its own reduction and gets the answer a batch of one gives, docs/design/batches.md §Batches). A request
that fails inside a batch is retried alone; failing alone (an image the backbone cannot take), it is answered with
an empty string, which lmms-eval scores as a wrong answer, and named in a notice; the other requests keep theirs.
This is the only module of care that imports ``lmms_eval``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from care_core.backbones.families import backbone_family, families, served_families
from care_core.batch_sizes import (
    BatchChoice,
    Batches,
    BatchSize,
    choose_batch_size,
    peak_gpu_memory_gib,
    reset_peak_gpu_memory,
)
from care_core.errors import CareError, GenerationError, MethodError, ModelLoadError, failure_line
from care_core.integrations import broken_torchvision, missing_task_path
from care_core.integrations.settings import EvalSpec, ModelArgsError, batch_arguments, parse_model_args
from care_core.prefetch import (
    PreparedImage,
    encoded_inputs,
    image_prefetcher,
    in_flight_copies,
    uses_processor_pool,
)
from care_core.runs import Processes, World
from care_core.vocabulary import DEFAULT_QUESTION

#: the model id that serves every family, and its aliases (the family records name the others)
GENERIC_MODEL = "care"
GENERIC_ALIASES = ("care_vtr",)


def model_ids() -> dict[str, tuple[str, ...]]:
    """lmms-eval model id -> its aliases: :data:`GENERIC_MODEL`, then every ``lmms_eval_model`` of the registered
    family records with the ``lmms_eval_aliases`` of the records naming it (in the records' listing order)."""
    ids: dict[str, tuple[str, ...]] = {GENERIC_MODEL: GENERIC_ALIASES}
    for family in families():
        ids[family.lmms_eval_model] = (*ids.get(family.lmms_eval_model, ()), *family.lmms_eval_aliases)
    return ids


def manifests() -> list[Any]:
    """The entry point of group ``lmms_eval.models``: one ``ModelManifest`` per model id of :func:`model_ids`; a
    family's class is this module's attribute named after its id (made on first use, see :func:`__getattr__`).

    Defined before this module imports lmms_eval, and reads only the family registry: importing
    ``lmms_eval.models`` builds its registry, which loads this entry point, possibly while this very module is
    still being imported.
    """
    from lmms_eval.models.registry_v2 import ModelManifest

    return [
        ModelManifest(model_id=model_id, simple_class_path=f"{__name__}.{_class_name(model_id)}", aliases=aliases)
        for model_id, aliases in model_ids().items()
    ]


def _class_name(model_id: str) -> str:
    """The attribute of this module that holds model ``model_id``'s class: ``CareLMM`` or the id itself."""
    return "CareLMM" if model_id == GENERIC_MODEL else model_id


from lmms_eval.api.model import lmms  # noqa: E402

if TYPE_CHECKING:
    import torch
    from PIL import Image

    from care_core.backbones.base import VLMAdapter

DEFAULT_MAX_NEW_TOKENS = 128
#: px: the warm-up's grey picture (CareLMM.warm_up), doubled while a keep budget exceeds its N. A benchmark photo's
#: size (COCO's are 640 px on their long side): its pixels take the pinned-memory size class, and its anyres crops
#: the tower batch, that a run's images take (at 336 px LLaVA-NeXT gets 3 crops, not the 5 of a photo)
WARM_UP_SIDE = 672
WARM_UP_MAX_SIDE = 2688  # px: the largest it grows to
_Answer = tuple[str, int, int, float]  # (answer, visual rows fed, N, seconds) of one request


class EvalTaskError(CareError):
    """A task cannot be evaluated: unknown, needs the hub while offline, or asks for something care cannot do."""


def _log_notice(line: str) -> None:
    """A notice of a model built by lmms-eval: a warning in lmms-eval's log (loguru)."""
    from loguru import logger

    logger.warning(f"care: {line}")


@dataclass(frozen=True)
class SampleRecord:
    """One answered request: what the language model saw and how long the sample took.

    ``seconds``: the sample's share of its batch's wall time (encode + reduce + generate of the whole batch, divided
    equally among its ``batch_size`` samples); with batch size 1, the sample's own time.
    """

    task: str
    doc_id: int
    visual_tokens: int  # visual rows the language model received
    num_tokens: int  # N, the image's visual tokens before reduction
    seconds: float
    answer: str
    batch_size: int = 1  # samples answered together with this one (itself included)


@dataclass(frozen=True)
class SampleFailure:
    """One request that failed alone and was answered with an empty string: its document and the error."""

    task: str
    doc_id: int
    reason: str


@dataclass(frozen=True)
class _Request:
    """One generate_until request, read once: its place in the input, its document and generation settings."""

    index: int
    context: str
    doc_to_visual: Any
    doc_id: Any
    task: Any
    split: Any
    max_new_tokens: int
    stops: tuple[str, ...]

    @classmethod
    def read(cls, index: int, request: Any) -> _Request:
        context, gen_kwargs, doc_to_visual, doc_id, task, split = request.args
        kwargs = dict(gen_kwargs or {})
        max_new = int(kwargs.get("max_new_tokens") or kwargs.get("max_gen_toks") or DEFAULT_MAX_NEW_TOKENS)
        until = kwargs.get("until")
        stops = tuple(s for s in ([until] if isinstance(until, str) else list(until or [])) if isinstance(s, str))
        return cls(index, context, doc_to_visual, doc_id, task, split, max_new, stops)


def _request_key(item: _Request) -> int:
    """What tells requests apart in the image loader: their place in the input."""
    return item.index


class CareLMM(lmms):
    """An lmms-eval "simple" model: a care backbone answering with K visual tokens (or all of them).

    Build it from ``model_args`` (what lmms-eval does), or with :meth:`from_spec` around an adapter that is
    already loaded (what ``care eval`` does, to evaluate many methods and budgets on one loaded model).
    ``batch_size`` is how many requests are answered at once (care_core.batch_sizes; per sample the answer of a batch
    of one): from ``model_args``, lmms-eval's ``--batch_size`` (a number, ``auto`` or ``auto:N``;
    ``max_batch_size`` caps ``auto``), read once on construction; with :meth:`from_spec`, a parsed
    :class:`care_core.batch_sizes.BatchSize`. It is resolved once, for this setting, on construction
    (:attr:`batch_choice`).
    """

    is_simple = True
    model_id: ClassVar[str] = "care"
    #: backbone families this model id serves (None: every family care can load)
    families: ClassVar[tuple[str, ...] | None] = None

    def __init__(self, **model_args: Any) -> None:
        super().__init__()
        size = batch_arguments(model_args)
        self._setup(parse_model_args(model_args), None, size)

    @classmethod
    def from_spec(
        cls,
        spec: EvalSpec,
        adapter: VLMAdapter | None = None,
        *,
        on_batch: Callable[[int, int, list[SampleRecord]], None] | None = None,
        batch_size: BatchSize = BatchSize(1),
        on_notice: Callable[[str], None] | None = None,
        answered: Mapping[tuple[str, int], str] | None = None,
    ) -> CareLMM:
        """The model for ``spec``; ``adapter`` (a loaded backbone) is reused instead of loading ``spec.pretrained``.

        ``on_batch(done, total, records)`` is called after every answered batch with its requests' records (a
        progress bar's and a saver's hook: one save per batch); ``on_notice(line)`` once if a batch ran out of GPU
        memory and batches were split, and for every request that failed alone (default: a warning in lmms-eval's
        log). ``answered``: answers an interrupted run saved, by (task, document); those requests are answered
        with them and not computed again.
        """
        self = cls.__new__(cls)
        lmms.__init__(self)
        self._setup(spec, adapter, batch_size)
        self.on_batch = on_batch
        self.answered = dict(answered or {})
        if on_notice is not None:
            self.on_notice = on_notice
        return self

    def _setup(self, spec: EvalSpec, adapter: VLMAdapter | None, batch_size: BatchSize) -> None:
        from care_core.pipeline import ReductionPipeline

        self.spec = spec
        self.on_batch: Callable[[int, int, list[SampleRecord]], None] | None = None
        self.on_notice: Callable[[str], None] = _log_notice
        self.records: list[SampleRecord] = []
        self.failures: list[SampleFailure] = []  # requests answered with an empty string: they failed alone
        self.answered: dict[tuple[str, int], str] = {}  # (task, document) -> an answer saved before (from_spec)
        # seconds generate_until waited for a batch's prepared images (the first batch's, and any the prefetcher
        # had not finished while the device answered the one before)
        self.input_wait_seconds = 0.0
        world = World.from_env()
        self._rank = world.rank
        self._world_size = world.size
        if adapter is None:
            broken = broken_torchvision()
            if broken:
                raise ModelLoadError(broken)
            adapter = load_adapter(spec)
        self.adapter = adapter
        self._check_family()
        if spec.cuda_graph:
            reason = adapter.graph_generation_reason()
            if reason is not None:
                raise GenerationError(f"cuda_graph=true: {reason}")
        # "none" is a pipeline without methods: its full answer is the answer
        self.pipeline = ReductionPipeline(adapter, [spec.method] if spec.method else [], spec.config)
        # auto: for answers of up to DEFAULT_MAX_NEW_TOKENS read from this setting's kept tokens
        self.batch_choice: BatchChoice = choose_batch_size(batch_size, adapter, max_new_tokens=DEFAULT_MAX_NEW_TOKENS,
                                                           attention_layers=self.pipeline.attention_layers,
                                                           budget=spec.budget)  # fmt: skip
        #: the batch runner: smaller after an out-of-memory split
        self.batches = Batches(
            self.batch_choice.size, device=adapter.device, on_notice=lambda line: self.on_notice(line)
        )

    def _check_family(self) -> None:
        family = self.adapter.family
        if self.families is not None and family not in self.families:
            served = " and ".join(self.families)
            raise ModelArgsError(
                f"model {self.model_id!r} serves {served} checkpoints; {self.spec.pretrained} is a {family} model "
                f"(use the model id {model_id_for(family)!r} or 'care')"
            )

    # ------------------------------------------------------------------ what lmms-eval reads
    def __str__(self) -> str:  # the response cache keys on str(model) when it is given an instance
        return f"care({self.spec.fingerprint()})"

    @property
    def device(self) -> torch.device:
        return self.adapter.device

    @property
    def config(self) -> Any:
        return self.adapter.model.config

    @property
    def tokenizer(self) -> Any:
        return getattr(self.adapter, "tokenizer", None)

    @property
    def batch_size(self) -> int:
        """The number of requests answered at once now."""
        return self.batches.size

    @property
    def batch_sizes(self) -> dict[str, int]:  # lmms-eval records these values in its results' config
        return {"batch_size": self.batch_size}

    def clean(self) -> None:
        """Keep the model: ``care eval`` evaluates several settings on the same loaded backbone."""

    # ------------------------------------------------------------------ answering
    def answer(self, image: Image.Image, question: str, max_new_tokens: int) -> tuple[str, int, int]:
        """Greedy answer to ``question`` about ``image`` from the reduced visual tokens (a batch of one).

        Returns (answer, visual rows the language model received, N visual tokens before reduction).
        """
        return self.answer_batch([image], [question], max_new_tokens)[0]

    def answer_batch(
        self, images: Sequence[Image.Image | PreparedImage], questions: Sequence[str], max_new_tokens: int
    ) -> list[tuple[str, int, int]]:
        """:meth:`answer` for several images at once: ``pipeline.run_batch`` (one encode, one method call per
        budget), then the reduced rows' answers in one ``answer_batch``; per sample what a batch of one gives.
        Images already through the image processor (a loader's) go straight to the vision tower."""
        from care_core.budget import Budget

        pipe, cuda_graph = self.pipeline, self.spec.cuda_graph
        inputs = encoded_inputs(self.adapter, images)
        budget = self.spec.budget if self.spec.method is not None else Budget.ratio(1.0)  # no method: unused
        if not pipe.methods:  # all tokens: the pipeline's full answers (nothing else is generated)
            results = pipe.run_batch(inputs, questions, [budget], generate=True, max_new_tokens=max_new_tokens,
                                     cuda_graph=cuda_graph)  # fmt: skip
            answers = [r.full_answer for r in results]
        else:  # the reduced rows only: run_batch's generate would also answer with all tokens
            results = pipe.run_batch(inputs, questions, [budget])
            runs = [r.runs[0] for r in results]
            answers = list(pipe.answer_batch([r.tokens for r in results], questions, [run.projected for run in runs],
                                             [run.result.token_index for run in runs], max_new_tokens=max_new_tokens,
                                             cuda_graph=cuda_graph))  # fmt: skip
        out = []
        for answer, result in zip(answers, results, strict=True):
            assert answer is not None  # generate=True gives every result its full answer
            out.append((answer.text, answer.visual_tokens, result.num_tokens))
        return out

    def warm_up(self) -> None:
        """One untimed, unrecorded batch (of the batch size the run uses) on plain grey pictures, prepared as a run's
        loader prepares its images (:func:`~care_core.prefetch.in_flight_copies`).

        The first calls on a GPU pay one-time costs (CUDA context, cuBLAS handles, Triton kernels being compiled,
        CUDA graphs captured for this batch size, page-locked memory for two batches of pixels) that would otherwise
        land on the first timed samples of the first setting. A batch that runs out of memory here is split as in a
        run, so the run starts at a size that fits.
        """
        grey = self._warm_up_picture()
        adapter: Any = self.adapter
        if uses_processor_pool(adapter):  # start the workers now, untimed
            pool = adapter.processor_pool()
            for future in [pool.submit(grey) for _ in range(pool.workers)]:
                future.result()
        pictures = in_flight_copies(adapter, grey, 2 * self.batch_size)
        self.batches.run(pictures[: self.batch_size], lambda chunk: self.answer_batch(chunk, [DEFAULT_QUESTION] *
                                                                                      len(chunk), 2))  # fmt: skip
        if self.batch_size > 1:  # and one image: the kernels tune once per size class (kernels.shapes.size_class),
            self.answer_batch(pictures[-1:], [DEFAULT_QUESTION], 2)  # and a run's last, smaller batch can fall in it

    def _warm_up_picture(self) -> Image.Image:
        """A grey picture of :data:`WARM_UP_SIDE` px, its side doubled (up to :data:`WARM_UP_MAX_SIDE`) while a keep
        budget's K exceeds its N: where N grows with the image (Qwen, InternVL's tiles), 336 px give Qwen3-VL 100
        tokens, fewer than the K = 113 of a 1024 px task, and the warm-up would fail a run its images allow. A
        backbone whose N is fixed keeps its N, and a K above it fails here as it would on every sample."""
        from PIL import Image

        budget = self.spec.budget if self.spec.method is not None else None
        side = WARM_UP_SIDE
        while True:
            grey = Image.new("RGB", (side, side), (128, 128, 128))
            if budget is None or budget.kind != "keep" or side >= WARM_UP_MAX_SIDE:
                return grey
            if self.adapter.encode_image(grey).num_tokens >= int(budget.value):
                return grey
            side *= 2

    def generate_until(self, requests: Sequence[Any]) -> list[str]:
        """Answers in request order. Requests are grouped by generation settings (max_new_tokens, until) and
        answered in batches of :attr:`batch_size`; each keeps its own task, split and document. A request that
        fails alone is answered with an empty string (:attr:`failures`, :meth:`_failed`)."""
        items = [_Request.read(i, request) for i, request in enumerate(requests)]
        answers: list[str] = [""] * len(items)
        groups: dict[tuple[int, tuple[str, ...]], list[_Request]] = {}
        for item in items:
            saved = self.answered.get((str(item.task), int(item.doc_id)))
            if saved is not None:  # an interrupted run answered it: its batch was saved
                answers[item.index] = saved
                continue
            groups.setdefault((item.max_new_tokens, item.stops), []).append(item)
        order = [item for members in groups.values() for item in members]
        done = len(items) - len(order)

        def finished(chunk: list[_Request], results: list[_Answer | SampleFailure]) -> None:
            nonlocal done
            loader.release(chunk)
            records = []
            for item, result in zip(chunk, results, strict=True):
                if isinstance(result, SampleFailure):
                    self.failures.append(result)
                    continue
                text, fed, n, seconds = result
                answers[item.index] = text = cut_at_stop(text, list(item.stops))
                records.append(SampleRecord(item.task, int(item.doc_id), fed, n, seconds, text, batch_size=len(chunk)))
            self.records.extend(records)
            done += len(chunk)
            if self.on_batch is not None:
                self.on_batch(done, len(items), records)

        batches = self.batches
        with image_prefetcher(self.adapter, self._image, order, batches.size, key=_request_key) as loader:

            def answer(chunk: list[_Request]) -> list[_Answer | SampleFailure]:
                start = time.perf_counter()
                images = loader.inputs(chunk, batches.size)
                self.input_wait_seconds += time.perf_counter() - start
                return self._answer_chunk(chunk, images)

            for members in groups.values():
                batches.run(members, answer, finished, self._failed)
        return answers

    def _failed(self, item: _Request, exc: Exception) -> SampleFailure:
        """A request that failed alone: answered with an empty string and named in a notice; a task care cannot
        evaluate (EvalTaskError) still stops the run."""
        if isinstance(exc, EvalTaskError):
            raise exc
        failure = SampleFailure(str(item.task), int(item.doc_id), failure_line(exc))
        self.on_notice(f"task {failure.task}, document {failure.doc_id}: answered with an empty string, the sample "
                       f"failed: {failure.reason}")  # fmt: skip
        return failure

    def _answer_chunk(
        self, chunk: list[_Request], images: list[Image.Image | PreparedImage]
    ) -> list[_Answer | SampleFailure]:
        """(answer, visual rows fed, N, seconds) per request of one batch of equal generation settings; the seconds
        are the batch's wall time shared out equally. (Typed with SampleFailure, what :meth:`_failed` gives a request
        instead: the batch runner takes one result type.)"""
        start = time.perf_counter()
        out = self.answer_batch(images, [item.context for item in chunk], chunk[0].max_new_tokens)
        seconds = (time.perf_counter() - start) / len(chunk)
        return [(text, fed, n, seconds) for text, fed, n in out]

    def _image(self, item: _Request) -> Image.Image:
        """The request's one image, decoded (run in the loader's thread)."""
        image = _one_image(item.doc_to_visual(self._document(item.task, item.split, item.doc_id)), item.task,
                           item.doc_id)  # fmt: skip
        image.load()
        return image

    def _document(self, task: Any, split: Any, doc_id: Any) -> Any:
        """The document a request is about; EvalTaskError when lmms-eval gave the request no known task."""
        if task is None or task not in self.task_dict:
            raise EvalTaskError(
                f"lmms-eval passed a request of task {task!r}, which it did not load by name: lmms-eval loads a task "
                "folder or YAML file named as a task without its name. Give lmms-eval the folder as its include "
                "path and the task's name (its YAML's 'task:' key) as the task, e.g. include path "
                "examples/tasks/care_shapes_examples, task care_shapes_examples"
            )
        return self.task_dict[task][split][doc_id]

    def loglikelihood(self, requests: Sequence[Any]) -> list[tuple[float, bool]]:
        task = requests[0].args[-2] if requests else "?"
        raise EvalTaskError(
            f"task {task} scores answers by log-likelihood (multiple choice); care models answer generate_until "
            "tasks only"
        )

    def generate_until_multi_round(self, requests: Sequence[Any]) -> list[str]:
        raise EvalTaskError("multi-round generation is not supported by care models")


def model_class(model_id: str) -> type[CareLMM]:
    """The class of lmms-eval model id or alias ``model_id``: :class:`CareLMM` for :data:`GENERIC_MODEL`, else the
    :class:`CareLMM` that serves only the families whose records name the id; ModelArgsError for an unknown id."""
    for canonical, aliases in model_ids().items():
        if model_id == canonical or model_id in aliases:
            return CareLMM if canonical == GENERIC_MODEL else _family_model(canonical, served_families(canonical))
    raise ModelArgsError(f"unknown care model {model_id!r} (known: {', '.join(model_ids())})")


@functools.cache
def _family_model(model_id: str, served: tuple[str, ...]) -> type[CareLMM]:
    """The model ``model_id`` serving the families ``served`` (one class per pair: lmms-eval's registry and a
    pickle find the same class again by this module's attribute of the id's name)."""
    if model_id in globals():  # the attribute lmms-eval resolves would be that name, not this class
        raise RuntimeError(f"lmms-eval model id {model_id!r} (of {', '.join(served)}) is a name in {__name__}")
    namespace = {"__module__": __name__, "__qualname__": model_id, "model_id": model_id, "families": served,
                 "__doc__": f"``{model_id}``: {' and '.join(served)} checkpoints only."}  # fmt: skip
    return type(model_id, (CareLMM,), namespace)


def __getattr__(name: str) -> type[CareLMM]:
    """A family model's class by its model id (what a manifest's class path names), made on first use."""
    if not name.startswith("__") and name != GENERIC_MODEL and name in model_ids():
        return model_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def model_id_for(family: str) -> str:
    """The lmms-eval model id serving backbone ``family`` (its record's ``lmms_eval_model``)."""
    return backbone_family(family).lmms_eval_model


# ---------------------------------------------------------------------------------------------- one setting
@dataclass(frozen=True)
class SettingRun:
    """What evaluating one setting gave (:func:`evaluate_setting`), on every process."""

    spec: EvalSpec
    results: dict[str, Any]  # lmms-eval's (on rank 0 with the metrics and the logged samples)
    computed: dict[str, tuple[int, int]]  # per task: documents answered now (every process's), and of them failed
    wall_seconds: float
    warmed_up: bool  # one untimed batch answered first (on a GPU)
    batch: BatchChoice  # the size the setting started at, what was asked for, the device rule's pick
    final_batch_size: int  # at its end: smaller after an out-of-memory split
    peak_gpu_memory_gib: float | None  # the most any process held for tensors (warm-up included); None off CUDA
    input_wait_seconds: float  # the longest any process waited for prepared images inside wall_seconds


#: bootstrap iterations of a metric's standard error where lmms-eval bootstraps it (``simple_evaluate``'s
#: ``bootstrap_iters``)
BOOTSTRAP_ITERS = 1000


def import_lmms_eval_aggregation() -> None:
    """What lmms-eval imports on its first metric aggregation, imported now: ``stderr_for_metric`` imports optional
    task modules on its first call (0.5 s on a 2-core CPU), inside ``simple_evaluate``. Paid before a setting's clock
    starts, so that the first setting, always the one with all tokens, is not charged with it (its seconds per
    sample too high, and every method's speed-up over it too); later calls find the modules imported."""
    from lmms_eval.api.metrics import stderr_for_metric

    stderr_for_metric(None, BOOTSTRAP_ITERS)  # a metric it knows nothing of: it imports, then gives no error function


def evaluate_setting(
    spec: EvalSpec, adapter: VLMAdapter, selection: TaskSelection, manager: Any, processes: Processes, *,
    batch_size: BatchSize, limit: float | None, cache: Path | None, stamp: str,
    on_batch: Callable[[int, int, list[SampleRecord]], None] | None = None,
    on_notice: Callable[[str], None] | None = None,
    answered: Mapping[tuple[str, int], str] | None = None,
) -> SettingRun:  # fmt: skip
    """lmms-eval's ``simple_evaluate`` once for ``spec`` on the loaded ``adapter``, this process's share of the
    documents (``cache``: lmms-eval's response cache folder, None: none; ``on_batch``, ``on_notice``,
    ``answered``: as :meth:`CareLMM.from_spec`). The previous setting's decoding cache is released first, the batch
    size chosen and the peak GPU memory counted from there; on a GPU one untimed batch answers first
    (:meth:`CareLMM.warm_up`), and lmms-eval's one-time imports come before the clock
    (:func:`import_lmms_eval_aggregation`), so that the timings are steady-state. Every process must call it."""
    from lmms_eval.evaluator import simple_evaluate

    adapter.release_decoding_cache()  # a cache sized for the previous setting's rows would count (and be in the way)
    lm = CareLMM.from_spec(spec, adapter, on_batch=on_batch, batch_size=batch_size, on_notice=on_notice,
                           answered=answered)  # fmt: skip
    reset_peak_gpu_memory(adapter.device)
    warm_up = adapter.device.type == "cuda"  # the one-time costs (CUDA context, kernels, graphs) land untimed
    if warm_up:
        lm.warm_up()
    import_lmms_eval_aggregation()
    start = time.perf_counter()
    results = simple_evaluate(
        model=lm, model_args=spec.model_args_string(), tasks=list(selection.names), task_manager=manager,
        limit=limit, use_cache=str(cache) if cache is not None else None, log_samples=True,
        bootstrap_iters=BOOTSTRAP_ITERS, verbosity="ERROR", distributed_executor_backend="torchrun",
        process_docs_parallel=1, datetime_str=stamp,
    )  # fmt: skip
    wall = time.perf_counter() - start
    peaks = [p for p in processes.gather(peak_gpu_memory_gib(adapter.device)) if p is not None]
    waits = processes.gather(lm.input_wait_seconds)
    answered_now = set().union(*processes.gather({(r.task, r.doc_id) for r in lm.records}))
    failed = set().union(*processes.gather({(f.task, f.doc_id) for f in lm.failures}))
    processes.barrier()  # rank 0 has merged this setting's cache before anyone opens it again
    computed = {task: (sum(1 for t, _ in answered_now | failed if t == task), sum(1 for t, _ in failed if t == task))
                for task in selection.names}  # fmt: skip
    return SettingRun(spec, results, computed, wall, warm_up, lm.batch_choice, lm.batches.size,
                      max(peaks) if peaks else None, max(waits))  # fmt: skip


# ---------------------------------------------------------------------------------------------- quiet
@contextlib.contextmanager
def quiet(verbose: bool = False) -> Iterator[None]:
    """lmms-eval's log lines and progress bars, and datasets', off the terminal for the block; all restored after.

    lmms-eval logs through loguru, to stdout (a sink it adds on import): its messages are disabled for the block
    (errors still raise), or with ``verbose`` its INFO lines go to stderr through a sink of our own, removed after.
    Its progress bars pass ``disable=`` themselves and have no argument to turn them off, so the two names they
    are built through are replaced for the block and put back after.
    """
    from unittest import mock

    import lmms_eval.api.task as task_module
    import lmms_eval.evaluator as evaluator
    from loguru import logger

    with contextlib.ExitStack() as stack:
        if verbose:
            sink = logger.add(sys.stderr, level="INFO", format="{level}: {message}", filter=_lmms_eval_info)
            stack.callback(logger.remove, sink)
        else:
            logger.disable("lmms_eval")
            stack.callback(logger.enable, "lmms_eval")
            stack.enter_context(mock.patch.object(evaluator, "tqdm", _silent_tqdm))
            stack.enter_context(mock.patch.object(task_module, "tqdm", _silent_tqdm))
        stack.enter_context(_quiet_datasets())
        yield


def _lmms_eval_info(record: Any) -> bool:
    """lmms-eval's lines below WARNING (its own stdout sink shows the others)."""
    return str(record["name"]).startswith("lmms_eval") and int(record["level"].no) < 30


def _silent_tqdm(*args: Any, **kwargs: Any) -> Any:
    from tqdm import tqdm

    return tqdm(*args, **{**kwargs, "disable": True})


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """datasets' progress bars and warnings off for the block (its own switches, restored after)."""
    try:
        import datasets
    except ImportError:
        yield
        return
    bars_were_off = datasets.utils.are_progress_bars_disabled()
    level = datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    try:
        yield
    finally:
        datasets.logging.set_verbosity(level)
        if not bars_were_off:
            datasets.enable_progress_bars()


# ---------------------------------------------------------------------------------------------- loading
def load_adapter(spec: EvalSpec) -> VLMAdapter:
    """The backbone of ``spec`` (offline), on this process's device."""
    from care_core.backbones import load_backbone

    dtype = None if spec.dtype == "auto" else spec.dtype
    return load_backbone(spec.pretrained, device=World.from_env().device(spec.device), dtype=dtype)


def check_methods(specs: Iterable[EvalSpec], adapter: VLMAdapter) -> None:
    """MethodError (one line) for the first method the loaded backbone cannot serve."""
    from care_core.methods import build_method
    from care_core.pipeline import unavailable_reason

    for spec in specs:
        if spec.method is None:
            continue
        reason = unavailable_reason(build_method(spec.method, spec.config), adapter)
        if reason is not None:
            raise MethodError(reason)


# ---------------------------------------------------------------------------------------------- answers
def _one_image(visuals: Any, task: str, doc_id: Any) -> Image.Image:
    from PIL import Image

    items = list(visuals) if isinstance(visuals, (list, tuple)) else [visuals]
    flat: list[Any] = []
    for item in items:
        flat.extend(item if isinstance(item, (list, tuple)) else [item])
    flat = [item for item in flat if item is not None]
    if len(flat) != 1:
        raise EvalTaskError(f"task {task}, document {doc_id}: {len(flat)} images; care models take exactly one image")
    item = flat[0]
    if isinstance(item, (str, Path)):
        from care_core.images import load_image

        return load_image(Path(item))
    if not isinstance(item, Image.Image):
        raise EvalTaskError(f"task {task}, document {doc_id}: the visual is a {type(item).__name__}, not an image")
    return item


def cut_at_stop(text: str, until: Any) -> str:
    """``text`` up to the first of the stop strings ``until`` (a string or a list of strings)."""
    stops = [until] if isinstance(until, str) else list(until or [])
    for stop in stops:
        if isinstance(stop, str) and stop:
            text = text.split(stop, 1)[0]
    return text


# ---------------------------------------------------------------------------------------------- tasks
@dataclass(frozen=True)
class TaskSelection:
    """What ``--tasks`` named: task names, the local folders that hold user tasks, and each local task's file."""

    names: list[str]
    include_paths: list[str]
    local: dict[str, str]  # task name -> its YAML file


def _index(paths: list[str]) -> dict[str, dict[str, Any]]:
    from lmms_eval.tasks import TaskManager

    return dict(TaskManager("ERROR", include_path=paths, include_defaults=False).task_index) if paths else {}


def select_tasks(specs: Sequence[str]) -> TaskSelection:
    """Task names from ``--tasks`` entries: lmms-eval task names, local task folders and task YAML files.

    ``--tasks file.yaml`` is broken in lmms-eval 0.7.3, so a file's folder becomes an include path and the task is
    selected by the name its YAML gives. EvalTaskError for a path that does not exist or holds no task.
    """
    names: list[str] = []
    include: list[str] = []
    local: dict[str, str] = {}
    for raw in specs:
        spec = raw.strip()
        if not spec:
            continue
        path = Path(spec).expanduser()
        missing = missing_task_path(spec)
        if missing:
            raise EvalTaskError(missing, parameter="tasks")
        if not path.exists():
            names.append(spec)
            continue
        folder = path.resolve() if path.is_dir() else path.resolve().parent
        index = _index([str(folder)])
        if path.is_dir():
            found = sorted(n for n, e in index.items() if e.get("type") in ("task", "group"))
        else:
            found = sorted(n for n, e in index.items() if Path(str(e.get("yaml_path", ""))).resolve() == path.resolve())
        if not found:
            raise EvalTaskError(f"{spec}: holds no lmms-eval task (a YAML file with a 'task:' name)", parameter="tasks")
        if str(folder) not in include:
            include.append(str(folder))
        for name in found:
            local[name] = str(index[name].get("yaml_path"))
            names.append(name)
    if not names:
        raise EvalTaskError("{tasks}: give at least one task")
    return TaskSelection(list(dict.fromkeys(names)), include, local)


def task_manager(selection: TaskSelection) -> Any:
    """A TaskManager that knows the selected tasks: built-in tasks are indexed only when one is named by name.

    EvalTaskError for an unknown name, and for a local task whose name a built-in task would silently replace.
    """
    import difflib

    from lmms_eval.tasks import TaskManager

    builtin = [n for n in selection.names if n not in selection.local]
    manager = TaskManager("ERROR", include_path=selection.include_paths or None, include_defaults=bool(builtin))
    if builtin:
        clash = [n for n in selection.local if manager.task_index.get(n, {}).get("yaml_path") != selection.local[n]]
        if clash:
            raise EvalTaskError(f"local task {clash[0]} ({selection.local[clash[0]]}) has the name of a built-in "
                                "lmms-eval task, which would replace it; rename it (its 'task:' key)")  # fmt: skip
        matched = set(manager.match_tasks(builtin))
        for name in builtin:
            if name not in matched and "*" not in name:
                close = difflib.get_close_matches(name, manager.all_tasks, n=3, cutoff=0.7)
                hint = f" (did you mean {', '.join(close)}?)" if close else ""
                raise EvalTaskError(f"unknown task {name!r}{hint}; list lmms-eval's tasks with 'lmms-eval --tasks "
                                    "list', or pass a local task folder or YAML file")  # fmt: skip
    return manager


def load_tasks(names: Sequence[str], manager: Any) -> dict[str, Any]:
    """Build the tasks (downloads nothing when offline); a missing hub dataset is an EvalTaskError saying what to do."""
    from lmms_eval.tasks import get_task_dict

    try:
        return get_task_dict(list(names), manager)
    except CareError:
        raise
    except Exception as exc:
        raise task_error(exc, names, manager) from exc


def task_error(exc: BaseException, names: Sequence[str], manager: Any) -> CareError:
    """A one-line error for an exception raised while building tasks: for data that is not in the local cache (the
    hub unreachable, offline, or asking for a token), which data set a task needs and how to fetch it."""
    text = " ".join(str(exc).split())
    if _needs_hub(exc):
        datasets = []
        for name in names:
            config = _task_config(name, manager)
            path = config.get("dataset_path")
            if isinstance(path, str) and path not in ("json", "csv", "parquet", "text", "arrow", "pandas"):
                datasets.append((name, path, config.get("dataset_name")))
        if datasets:
            name, path, subset = datasets[0]
            subset_arg = f", '{subset}'" if subset else ""
            folder = datasets_cache()
            return EvalTaskError(
                f"task {name} needs the dataset {path} from the Hugging Face hub, which is not in the local cache "
                f"({folder}); on a machine that reaches the hub, fetch it with: HF_DATASETS_CACHE={folder} python -c "
                f"\"import datasets; datasets.load_dataset('{path}'{subset_arg})\", then copy that folder here"
            )
    return EvalTaskError(f"cannot load the task(s) {', '.join(names)}: {type(exc).__name__}: {text[:300]}")


def datasets_cache() -> str:
    """The datasets cache lmms-eval prepares its tasks' data in (its own rule: ``LMMS_EVAL_DATASETS_CACHE``, else
    ``HF_DATASETS_CACHE``, else ``HF_HOME``'s; ``care eval`` sets ``HF_DATASETS_CACHE`` under ``CARE_HOME`` where
    none is set, :mod:`care_core.home`)."""
    from lmms_eval.api.task import _resolve_hf_datasets_cache_dir

    return str(_resolve_hf_datasets_cache_dir())


_HUB_WORDS = ("offline", "connect", "couldn't reach", "not found on the hub", "huggingface.co", "localentrynotfound",
              "localtokennotfound", "cannot find the requested files", "doesn't exist on the hub")  # fmt: skip


def _needs_hub(exc: BaseException) -> bool:
    """Whether building a task failed for want of the hub: offline mode, or a hub error anywhere in the chain
    (also inside a retry wrapper, whose text names the exception of its last attempt)."""
    if os.environ.get("HF_HUB_OFFLINE", "0").strip().lower() in ("1", "true", "yes", "on"):
        return True
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        words = f"{type(current).__name__} {current}".lower()
        if any(word in words for word in _HUB_WORDS):
            return True
        last = getattr(getattr(current, "last_attempt", None), "exception", None)
        inner = last() if callable(last) else None
        current = inner if isinstance(inner, BaseException) else (current.__cause__ or current.__context__)
    return False


def _task_config(name: str, manager: Any) -> dict[str, Any]:
    entry = manager.task_index.get(name, {})
    yaml_path = entry.get("yaml_path")
    if not isinstance(yaml_path, str):
        return {}
    try:
        from lmms_eval import utils

        return dict(utils.load_yaml_config(yaml_path, mode="simple"))
    except Exception:
        return {}


# ---------------------------------------------------------------------------------------------- results
def primary_metrics(results: dict[str, Any], task: str) -> list[str]:
    """The task's metric names in its metric_list order (the first is the one ``care eval`` tabulates)."""
    config = results.get("configs", {}).get(task, {})
    names = [m.get("metric") for m in config.get("metric_list", []) if isinstance(m, dict) and m.get("metric")]
    values = task_metrics(results, task)
    ordered = [n for n in names if n in values] + [n for n in values if n not in names]
    return ordered


def task_metrics(results: dict[str, Any], task: str) -> dict[str, float]:
    """``{metric: value}`` of one task (the "none" filter; stderr entries left out)."""
    out: dict[str, float] = {}
    for key, value in results.get("results", {}).get(task, {}).items():
        if "," not in key or "_stderr" in key or not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        metric, _, filt = key.partition(",")
        if filt == "none" or metric not in out:
            out[metric] = float(value)
    return out


def sample_answers(results: dict[str, Any], task: str) -> dict[str, str]:
    """``{doc_id: answer}`` from the logged samples of one task (the model's raw answers)."""
    answers: dict[str, str] = {}
    for sample in results.get("samples", {}).get(task, []):
        resps = sample.get("resps") or [[""]]
        first = resps[0]
        answers[str(sample["doc_id"])] = first[0] if isinstance(first, list) else str(first)
    return answers


def merge_leftover_cache(cache_root: Path) -> int:
    """Merge the per-rank response databases of earlier runs (also killed ones) into ``cache_root/cache.db``.

    lmms-eval merges a run's databases only when the run succeeds; merging what a killed run left lets a rerun with
    any number of processes find every finished sample. Returns the number of rows merged.
    """
    from glob import glob

    from lmms_eval.caching.response_cache import ResponseCache

    shards = sorted(glob(str(cache_root / "runs" / "*" / "rank_*.db")))
    if not shards:
        return 0
    return int(ResponseCache.merge_shards(shards, str(cache_root / "cache.db")))
