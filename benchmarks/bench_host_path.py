"""Host work of one request's first token from the features, stage by stage, on the tiny demos (CPU, float32).

    python -m benchmarks.bench_host_path            # from the repository root: 4 tiny demos, 50 repetitions
    python -m benchmarks.bench_host_path --quick    # tiny-qwen3-vl only, 10 repetitions

The steps are those of ``ReductionPipeline.time_answers``' ``first_token_from_features`` (CaRe at K = N/9 re-run
from the features, the projector, then ``generate`` with one new token), through the pipeline's and the adapter's own
pieces, each timed on the previous one's output:

- ``reduce``: the method call. On a GPU CaRe replays it from a CUDA graph, so of this row only ``reduction_result``
  (timed apart, on the same reduction) is host work there.
- ``projector``: the projector on the reduced rows.
- ``generate``: the adapter's ``generate`` with one new token as it runs on a GPU, where the static loop decodes
  (this adapter's device check is skipped, the loop runs without its prefill step: on a GPU that step is one graph
  replay, on the CPU the loop would run the decoder eagerly). Of it, apart: ``prompt`` (the prompt in parts,
  ``_prompt_parts``), ``static_prompt`` (the loop's prompt from them, ``_loop_prompt``) and ``static_loop``
  (``StaticGreedy.generate_batch``: its staleness check, the prefill's inputs filled, the first token read).

Per stage: the torch operators it dispatches (counted with a ``TorchDispatchMode``, once) and its median host ms
(one torch thread by default). The op count is the figure that carries over to a GPU: there every dispatched
operator costs about 5-15 us of host time (a kernel launch or a view's bookkeeping), and the first token waits on
the host wherever the host path outlasts the GPU's work. The CPU milliseconds add Python's own time (which a GPU's
host pays too), the kernels themselves (the projector's, mostly) and, on a shared machine, noise. ``host total``:
``reduction_result``, ``projector`` and ``generate``. Prints a table and writes its JSON into --results-dir
(default: a new scratch folder; --out FILE writes a copy there too, never over an existing file).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.common import (
    EXAMPLES,
    Clock,
    ResultsWriter,
    at_least_one,
    demos_option,
    fail,
    host,
    make_parser,
    print_table,
    run_main,
    source_state,
    stamp,
)
from care_core.backbones.chat_adapter import ChatAdapter
from care_core.backbones.static_generation import StaticGreedy
from care_core.budget import Budget
from care_core.care import care_reduce
from care_core.images import load_image
from care_core.methods.care_family import reduction_result
from care_core.pipeline import ReductionPipeline

DEMOS = ("tiny-qwen3-vl", "tiny-qwen2.5-vl", "tiny-internvl3", "tiny-llava-next")
QUESTION = "What is the person holding in the picture?"
IMAGE = "astronaut.jpg"
STAGES = ("reduce", "reduction_result", "projector", "generate", "prompt", "static_prompt", "static_loop")
#: the stages whose sum is the request's host work on a GPU after the reduction's launch (the last three are parts
#: of ``generate``)
HOST_STAGES = ("reduction_result", "projector", "generate")


class OpCounter(TorchDispatchMode):
    """Counts the aten operators dispatched inside it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def counted(fn: Callable[[], Any]) -> Counter[str]:
    """The operators ``fn()`` dispatches, by name."""
    with torch.no_grad(), OpCounter() as counter:
        fn()
    return counter.ops


def without_prefill(greedy: StaticGreedy) -> StaticGreedy:
    """``greedy`` with its prefill step left out (its inputs are still filled): what a graph replay leaves to the
    host."""
    greedy._prefill_step = lambda entry: None  # type: ignore[method-assign]
    return greedy


def as_on_a_gpu(adapter: ChatAdapter) -> None:
    """``adapter``'s ``generate`` as on a GPU where the static loop decodes: no reason against the loop (the CPU's
    device check skipped), and its loop one without the prefill step (:func:`without_prefill`), kept where the
    adapter keeps its own (so that ``generate`` checks it for staleness as it does its own)."""
    adapter.graph_generation_reason = lambda length=None: None  # type: ignore[method-assign]
    adapter._greedy_graphs = without_prefill(StaticGreedy(adapter.model, graphs=False))


def stage_calls(pipe: ReductionPipeline, question: str) -> dict[str, Callable[[], Any]]:
    """Each stage as a call on the previous stage's output (computed once here, as the pipeline computes it)."""
    adapter = pipe.adapter
    if not isinstance(adapter, ChatAdapter):  # every demo's adapter is one
        raise fail(f"{adapter.name}: not a chat adapter, whose prompt parts this benchmark times")
    tokens = pipe.encode(load_image(EXAMPLES / IMAGE))
    keep = Budget.keep(max(1, tokens.num_tokens // 9)).resolve(tokens.num_tokens)
    inputs = pipe.method_inputs(tokens, question, memo=False)
    fresh = dataclasses.replace(inputs, memo=None, stage_timer=None)  # as ReductionPipeline._rerun
    method = pipe.methods["care"]
    with torch.no_grad():
        result = method(fresh, keep)
        reduction = care_reduce(fresh.features, fresh.projector, fresh.positions, keep=keep, config=pipe.config,
                                scorer=fresh.scorer)  # fmt: skip
        rows = adapter.projector(result.tokens.to(adapter.dtype))
        parts = adapter._prompt_parts(question, tokens, rows, result.token_index)
        prompt = adapter._loop_prompt(parts)
    as_on_a_gpu(adapter)
    kept = result.token_index

    def static_loop() -> Any:
        return adapter._static_greedy().generate_batch([prompt], 1)

    return {
        "reduce": lambda: method(fresh, keep),
        "reduction_result": lambda: reduction_result(reduction),
        "projector": lambda: adapter.projector(result.tokens.to(adapter.dtype)),
        "generate": lambda: adapter.generate(question, tokens, rows, max_new_tokens=1, kept=kept),
        "prompt": lambda: adapter._prompt_parts(question, tokens, rows, kept),
        "static_prompt": lambda: adapter._loop_prompt(parts),
        "static_loop": static_loop,
    }


def bench_demo(name: str, reps: int) -> dict[str, Any]:
    """Ops and median host ms per stage of one demo."""
    pipe = ReductionPipeline.from_pretrained(name, methods=["care"], device="cpu", dtype="float32")
    calls = stage_calls(pipe, QUESTION)
    clock = Clock(torch.device("cpu"))
    stages: list[dict[str, Any]] = []
    for stage, call in calls.items():
        with torch.no_grad():
            call()  # warm: the adapter's prompt and position memos, the loop's buffers
            ms = clock.median(call, reps=reps, warmup=1)
        ops = counted(call)
        stages.append({"stage": stage, "ops": sum(ops.values()), "host_ms": ms, "op_names": dict(ops.most_common())})
    host_rows = [row for row in stages if row["stage"] in HOST_STAGES]
    total = {"stage": "host total", "ops": sum(r["ops"] for r in host_rows),
             "host_ms": sum(r["host_ms"] for r in host_rows)}  # fmt: skip
    return {"backbone": name, "stages": [*stages, total]}


def main(argv: list[str] | None = None) -> None:
    parser = make_parser(__doc__, quick="tiny-qwen3-vl only, 10 repetitions (about 15 s on a 2-core CPU)",
                         duration="4 demos, 50 repetitions: about 1 minute on a 2-core CPU")  # fmt: skip
    parser.add_argument("--reps", type=int, default=50, help="timed repetitions per stage (default: 50)")
    parser.add_argument("--demos", default=",".join(DEMOS), help=f"comma-separated (default: {','.join(DEMOS)})")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch's CPU threads (default: 1, so that host overhead, not thread wake-ups, is timed)",
    )
    args = parser.parse_args(argv)
    demos = demos_option(args.demos, DEMOS, args.quick)
    at_least_one("--reps", args.reps)
    at_least_one("--threads", args.threads)
    writer = ResultsWriter(args, "cpu-bench_host_path")
    torch.set_num_threads(args.threads)
    reps = 10 if args.quick else args.reps
    results = [bench_demo(name, reps) for name in demos]
    cells = [(r["backbone"], s["stage"], str(s["ops"]), f"{s['host_ms']:.3f}") for r in results for s in r["stages"]]
    print_table(f"First token from features, host work per stage (CPU, float32, K = N/9, median of {reps})",
                ("backbone", "stage", "ops", "host ms"), cells, keys=2)  # fmt: skip
    writer.finish({"date": stamp(), "machine": host(), "source": source_state(), "reps": reps,
                   "torch_threads": torch.get_num_threads(), "question": QUESTION, "image": IMAGE,
                   "results": results})  # fmt: skip


if __name__ == "__main__":
    run_main(main)
