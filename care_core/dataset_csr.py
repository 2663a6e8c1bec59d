"""CSR over a data set of image-question pairs: the library function behind ``care csr --data`` and
``examples/dataset_csr.py``.

:func:`read_pairs` reads a JSONL file of ``{"image": ..., "question": ...}`` lines; :func:`dataset_csr` computes
every method x budget on every pair through a loaded :class:`care_core.pipeline.ReductionPipeline`, this process's
share of the pairs (:class:`care_core.runs.DatasetRun`), in batches (care_core.batch_sizes: out-of-memory splitting, a
failing pair retried alone), each finished batch appended to the run's shard at once, so that a resumed run computes
only what is missing. Rank 0 gets every result back.

No torch at import (``care --help`` imports the command that calls it).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from care_core.batch_sizes import (
    BatchChoice,
    Batches,
    BatchSize,
    choose_batch_size,
    peak_gpu_memory_gib,
    reset_peak_gpu_memory,
)
from care_core.errors import CareError, failure_line, one_line
from care_core.runs import FAILED, DatasetRun, csr_summary, pair_id

if TYPE_CHECKING:
    from PIL import Image

    from care_core.budget import Budget
    from care_core.pipeline import ImageResult, ReductionPipeline
    from care_core.prefetch import Prefetcher

#: the fields of a data-set line
PAIR_FIELDS = ("image", "question")


class PairsFileError(CareError):
    """A JSONL file of pairs cannot be read, or a line of it is no image-question pair."""


class PairFailedError(CareError):
    """A pair failed alone (an image the model cannot take) and the run was not asked to skip it."""


@dataclass(frozen=True)
class Pair:
    line: int | None  # 1-based line in the JSONL file, None for a single pair
    image: Path
    question: str

    @property
    def pair_id(self) -> str:
        """What names the pair in a run's records (care_core.runs.pair_id)."""
        return pair_id(self.line, self.image, self.question)


@dataclass(frozen=True)
class BadPairs:
    """What a run does with a pair that fails alone: stop with its error, or ``skip`` it (recorded as bad in the
    run's folder); ``retry``: compute again the pairs an earlier run recorded as bad (else they stay skipped)."""

    skip: bool = False
    retry: bool = False


def read_pairs(path: Path, *, skip_bad: bool = False) -> tuple[list[Pair], list[dict[str, Any]]]:
    """The pairs of a JSONL file (image paths relative to the file) and the bad lines skipped (line, reason); a bad
    line stops with its line number unless ``skip_bad``. PairsFileError (one line)."""
    if not path.exists():
        raise PairsFileError(f"{path}: no such file")
    if path.is_dir():
        raise PairsFileError(f"{path}: is a folder, expected a JSONL file")
    try:
        text = path.read_text(encoding="utf-8-sig")  # a UTF-8 BOM is not part of the data
    except (OSError, UnicodeDecodeError) as exc:
        raise PairsFileError(f"{path}: cannot read it ({exc})") from exc
    pairs: list[Pair] = []
    skipped: list[dict[str, Any]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            pairs.append(_parse_line(path, number, line))
        except PairsFileError as exc:
            if not skip_bad:
                raise
            skipped.append({"line": number, "reason": str(exc)})
    if not pairs:
        raise PairsFileError(f"{path}: no usable image-question pairs")
    return pairs, skipped


def _parse_line(path: Path, number: int, line: str) -> Pair:
    where = f"{path}:{number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise PairsFileError(f"{where}: not valid JSON ({exc.msg})") from exc
    if not isinstance(record, dict):
        raise PairsFileError(f"{where}: expected a JSON object with 'image' and 'question'")
    for key in PAIR_FIELDS:
        if key not in record:
            raise PairsFileError(f"{where}: missing field {key!r}")
        if not isinstance(record[key], str):
            raise PairsFileError(f"{where}: field {key!r} must be a string, got {type(record[key]).__name__}")
        if not record[key].strip():
            raise PairsFileError(f"{where}: field {key!r} is empty")
    image = Path(record["image"]).expanduser()
    if not image.is_absolute():
        image = path.parent / image
    return Pair(number, image, record["question"])


def run_manifest(model: str | None, dtype: str, config: dict[str, Any]) -> dict[str, Any]:
    """What must match for results of two runs to be mixed (a :class:`DatasetRun`'s manifest): the model as given
    (a folder by its absolute path; None: the default demo), the dtype asked for and the hyperparameters."""
    from care_core.backbones.families import DEFAULT_DEMO

    shown = model or DEFAULT_DEMO
    folder = Path(shown).expanduser()
    if folder.exists():
        shown = str(folder.resolve())
    return {"model": shown, "dtype": dtype, "config": config}


@dataclass(frozen=True)
class DatasetCSR:
    """What :func:`dataset_csr` gave. ``results``: on rank 0 every saved result of the pairs given (this run's and
    earlier runs' in the folder; one record per pair x method x budget, in pair, method and budget order), elsewhere
    none. ``skipped``: the pairs skipped as bad, of every process (line, reason)."""

    results: list[dict[str, Any]]
    skipped: list[dict[str, Any]]
    methods: list[str]  # those the pipeline serves
    budgets: list[str]  # the budgets' labels
    computed: int  # pairs this process computed now
    batch: BatchChoice  # the batch size used, what was asked for, the device rule's pick
    final_batch_size: int  # after any out-of-memory split
    compute_seconds: float  # from after every process loaded its model to the slowest one's end
    peak_gpu_memory_gib: float | None  # the most any process held for tensors meanwhile; None off CUDA

    @property
    def pairs(self) -> int:
        """How many pairs have results."""
        return len({r["line"] if r["line"] is not None else r["image"] for r in self.results})

    def summary(self) -> list[dict[str, Any]]:
        """Per method x budget: mean, std, count, 95% half-width and kept share of 100 x CSR (csr_summary)."""
        return csr_summary(self.results, self.methods, self.budgets)


@dataclass(frozen=True)
class _Failed:
    """What a pair that failed alone gives instead of its records: the error, on one line."""

    reason: str


_Item = tuple[str, Pair, dict[str, list["Budget"]]]  # (pair id, pair, the budgets per method not saved yet)
_Progress = Callable[[int, int, str], None]


def dataset_csr(
    run: DatasetRun,
    pipe: ReductionPipeline,
    pairs: Sequence[Pair],
    budgets: Sequence[Budget],
    *,
    batch_size: BatchSize = BatchSize(),
    bad: BadPairs = BadPairs(),
    on_progress: _Progress | None = None,
    on_notice: Callable[[str], None] | None = None,
) -> DatasetCSR:
    """Every method of ``pipe`` at every budget on this process's share of ``pairs``, CSR x 100 per result.

    ``run`` (entered, not started: this starts it, recording the backbone) saves each finished batch and knows what
    earlier runs saved, which is not computed again. ``batch_size`` is resolved on the loaded backbone (auto: the
    device rule for CSR, no answers). A pair that fails inside a batch is retried alone; failing alone, it raises
    PairFailedError, or with ``bad.skip`` it is skipped and recorded as bad, and a resumed run skips it again
    unless ``bad.retry``. ``on_progress(done, total, image name)`` after every batch (and once before the first);
    ``on_notice(line)`` once if batches were split for memory. Every process must call it."""
    backbone = pipe.backbone.to_dict()
    run.start(backbone={k: backbone[k] for k in ("name", "family", "demo")})
    choice = choose_batch_size(batch_size, pipe.adapter, max_new_tokens=None, attention_layers=pipe.attention_layers)
    batches = Batches(choice.size, device=pipe.adapter.device, on_notice=on_notice)
    todo, skipped = _todo(run, list(pipe.methods), [(p.pair_id, p) for p in pairs], budgets, bad.retry)
    reset_peak_gpu_memory(pipe.adapter.device)
    run.processes.barrier()  # every process has loaded its model: the clock measures the computing only
    start = time.perf_counter()
    skipped += _compute(run, pipe, todo, budgets, batches, bad=bad, on_progress=on_progress)
    skipped = [s for part in run.processes.gather(skipped) for s in part]  # also waits for the slowest process
    seconds = time.perf_counter() - start
    peaks = [p for p in run.processes.gather(peak_gpu_memory_gib(pipe.adapter.device)) if p is not None]
    done = run.merge()
    labels = [b.label for b in budgets]
    results = [{k: v for k, v in done[(p.pair_id, m, label)].items() if k != "pair_id"}
               for p in pairs for m in pipe.methods for label in labels if (p.pair_id, m, label) in done]  # fmt: skip
    return DatasetCSR(results, skipped, list(pipe.methods), labels, len(todo), choice, batches.size, seconds,
                      max(peaks) if peaks else None)  # fmt: skip


def _todo(
    run: DatasetRun, methods: list[str], items: list[tuple[str, Pair]], budgets: Sequence[Budget], retry_bad: bool
) -> tuple[list[_Item], list[dict[str, Any]]]:
    """This process's (pair id, pair, plan: the budgets per method not saved yet) to compute, and the pairs an
    earlier run recorded as bad, skipped (as they were then) unless ``retry_bad``."""
    done = run.done_keys()
    bad = {} if retry_bad else run.failures()
    todo = []
    skipped: list[dict[str, Any]] = []
    for pid, pair in run.shard(items):
        plan = {m: [b for b in budgets if (pid, m, b.label) not in done] for m in methods}
        if not any(plan.values()):
            continue
        if pid in bad:
            skipped.append({"line": pair.line, "reason": bad[pid][FAILED]})
        else:
            todo.append((pid, pair, plan))
    return todo, skipped


def _compute(
    run: DatasetRun, pipe: ReductionPipeline, todo: list[_Item], budgets: Sequence[Budget], batches: Batches, *,
    bad: BadPairs, on_progress: _Progress | None,
) -> list[dict[str, Any]]:  # fmt: skip
    """``todo`` in batches, each finished batch saved at once (results, and failure records of the pairs that
    failed alone with ``bad.skip``); the pairs skipped as bad now."""
    from care_core.prefetch import image_prefetcher

    skipped: list[dict[str, Any]] = []
    done = 0
    if on_progress is not None:
        on_progress(0, len(todo), "")
    with image_prefetcher(pipe.adapter, _open_image, todo, batches.size, key=_item_key) as loader:

        def failing(item: _Item, exc: Exception) -> _Failed:
            pair = item[1]
            if not bad.skip or pair.line is None:
                raise _pair_error(pair, exc) from exc
            return _Failed(failure_line(exc))

        def finished(chunk: list[_Item], outputs: list[list[dict[str, Any]] | _Failed]) -> None:
            nonlocal done
            loader.release(chunk)
            run.append(record for output in outputs if not isinstance(output, _Failed) for record in output)
            failed = [(pid, pair, output.reason) for (pid, pair, _), output in zip(chunk, outputs, strict=True)
                      if isinstance(output, _Failed)]  # fmt: skip
            run.append_failures(_failure_record(pid, pair, reason) for pid, pair, reason in failed)
            skipped.extend({"line": pair.line, "reason": reason} for _, pair, reason in failed)
            done += len(chunk)
            if on_progress is not None:
                on_progress(done, len(todo), chunk[-1][1].image.name)

        def work(chunk: list[_Item]) -> list[list[dict[str, Any]] | _Failed]:
            return list(_csr_batch(pipe, loader, chunk, budgets, ahead=batches.size))

        batches.run(todo, work, finished, failing)
    return skipped


def _pair_error(pair: Pair, exc: Exception) -> PairFailedError:
    """The one-line error of a pair that failed alone (a CareError's parameters kept, for the CLI's flags)."""
    where = f"{pair.image}" if pair.line is None else f"line {pair.line} ({pair.image})"
    return PairFailedError(f"{where}: {one_line(exc.template) if isinstance(exc, CareError) else failure_line(exc)}")


def _failure_record(pid: str, pair: Pair, reason: str) -> dict[str, Any]:
    """The shard line recording a bad pair (care_core.runs.FAILED)."""
    return {"pair_id": pid, "line": pair.line, "image": str(pair.image), "question": pair.question, FAILED: reason}


def _open_image(item: _Item) -> Image.Image:
    """An item's image, decoded (on a loader thread); ImageError if it is not a readable image."""
    from care_core.images import load_image

    return load_image(item[1].image)


def _item_key(item: _Item) -> str:
    return item[0]  # the pair id: unique within a run


def _csr_batch(
    pipe: ReductionPipeline, loader: Prefetcher[Any, Any], chunk: list[_Item], budgets: Sequence[Budget], *,
    ahead: int,
) -> list[list[dict[str, Any]]]:  # fmt: skip
    """The records of one batch, with CSR. The images come prepared from ``loader``, which then starts the ``ahead``
    pairs after the batch. Records, not the pipeline's results: those hold the batch's tensors on the device, and a
    run keeps what its batches return until it ends."""
    from care_core.prefetch import encoded_inputs

    images = encoded_inputs(pipe.adapter, loader.inputs(chunk, ahead))
    # untimed: the records hold no timings, and the stage clocks' CUDA syncs would leave the GPU idle
    results = pipe.run_batch(images, [pair.question for _, pair, _ in chunk], list(budgets), csr=True,
                             plans=[plan for _, _, plan in chunk], timed=False)  # fmt: skip
    name, demo = pipe.backbone.name, pipe.backbone.demo
    return [_records(pid, pair, name, demo, result) for (pid, pair, _), result in zip(chunk, results, strict=True)]


def _records(pid: str, pair: Pair, backbone: str, demo: bool, output: ImageResult) -> list[dict[str, Any]]:
    """One pair's results, one record per method x budget (the shard's line format)."""
    return [{
        "pair_id": pid, "line": pair.line, "image": str(pair.image), "question": pair.question,
        "backbone": backbone, "demo": demo,
        "method": run.method, "budget": run.budget.label, "N": output.num_tokens, "K": run.keep,
        "tokens_out": run.result.num_tokens, "csr": _x100(run.csr), "uniform_weights": run.uniform_weights,
    } for run in output.runs]  # fmt: skip


def _x100(csr: float | None) -> float:
    if csr is None:
        raise AssertionError("the pipeline ran with csr=True, so every run has a CSR")
    return 100 * csr
