"""Host work of the drop-in's reduced ``model.generate`` call, step by step, on the tiny demos (CPU, float32).

    python -m benchmarks.bench_dropin_host            # tiny-qwen3-vl and tiny-llava-next, batch 8, 10 repetitions
    python -m benchmarks.bench_dropin_host --quick    # tiny-qwen3-vl only, 3 repetitions

The call is ``benchmarks/latency.py --part dropin``'s: ``model.generate`` on the processor's outputs for a batch of
copies of ``examples/astronaut.jpg`` (resized to the family's gate side, :func:`benchmarks.latency.gate_image`),
:data:`~benchmarks.latency.NEW_TOKENS` new tokens, inside ``reduce_visual_tokens(method="care", keep=K)``,
K = floor(N/9). Its steps are the drop-in's own functions and methods (:data:`STEPS`), each wrapped where it is
looked up, so a step's figures include those of the steps it calls (``reduced_inputs`` holds all but ``generate``).

Per step: the torch operators dispatched inside it (counted with bench_host_path's ``OpCounter`` over one call) and
its host ms (median over the repetitions, one torch thread, summed over a step's calls within one generate). On a GPU
every dispatched operator costs about 5-15 us of host time, and reads of device values (``.item()``, ``.tolist()``,
``nonzero``, boolean masks) wait for the queued work: ``syncs`` counts the operators among them that read a device
value back on CUDA (:data:`SYNC_OPS`; on the CPU none waits). ``--sides`` times other image sides too, to show
which steps grow with N.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from statistics import median
from typing import Any

import torch

import care_core.dropin
from benchmarks.bench_host_path import OpCounter
from benchmarks.common import (
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
from benchmarks.latency import KEPT, NEW_TOKENS, dropin_generate, dropin_inputs, gate_image
from care_core import reduce_visual_tokens
from care_core.backbones import load_backbone
from care_core.budget import keep_from_ratio
from care_core.dropin import VisualTokenReduction

DEMOS = ("tiny-qwen3-vl", "tiny-llava-next")
BATCH = 8
#: steps: (owner, attribute) looked up when the call runs; "module" is care_core.dropin, "reduction" the context
#: manager, "adapter", "method" and "pipeline" its parts
STEPS: tuple[tuple[str, str], ...] = (
    ("reduction", "reduced_inputs"),
    ("module", "_image_sizes"),
    ("module", "_image_span"),
    ("adapter", "encode_processed"),
    ("reduction", "_reduce"),
    ("reduction", "_question"),
    ("pipeline", "method_inputs"),
    ("method", "batch"),
    ("adapter", "_lm_inputs"),
    ("module", "_image_run_inputs"),
    ("reduction", "_rope_positions"),
    ("reduction", "_batch"),
    ("generate", "generate"),
)
#: operators that read a value back to the host (a sync on CUDA)
SYNC_OPS = frozenset({"_local_scalar_dense", "nonzero", "item", "is_nonzero", "equal", "_to_copy_cpu"})


class StepMeter:
    """Per step: calls, host seconds of the current repetition, and ops while an :class:`OpCounter` is attached."""

    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.ops: dict[str, Counter[str]] = {}
        self.counter: OpCounter | None = None

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            before = Counter(self.counter.ops) if self.counter is not None else None
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - began
                if self.counter is not None and before is not None:
                    self.ops.setdefault(name, Counter()).update(self.counter.ops - before)

        return timed


@contextmanager
def metered(reduction: VisualTokenReduction, meter: StepMeter) -> Iterator[None]:
    """The drop-in's steps and the model's own ``generate`` wrapped with ``meter`` for the block; enter it before
    ``reduction``'s block, which keeps the model's generate as it finds it."""
    owners = {"module": care_core.dropin, "reduction": reduction, "adapter": reduction.adapter,
              "method": reduction.method, "pipeline": reduction._pipeline}  # fmt: skip
    patched: list[tuple[Any, str, bool, Any]] = []
    for owner_name, attribute in STEPS:
        if owner_name == "generate":
            continue
        owner = owners[owner_name]
        if not hasattr(owner, attribute):
            continue
        own = attribute in vars(owner)  # a module's functions, or an instance's own attribute
        original = getattr(owner, attribute)
        patched.append((owner, attribute, own, original))
        _set(owner, attribute, meter.wrap(attribute, original))
    model_class = type(reduction.model)
    class_generate = model_class.generate
    model_class.generate = meter.wrap("generate", class_generate)
    try:
        yield
    finally:
        model_class.generate = class_generate
        for owner, attribute, own, original in patched:
            if own:
                _set(owner, attribute, original)
            else:
                object.__delattr__(owner, attribute)


def _set(owner: Any, attribute: str, value: Any) -> None:
    """``owner.attribute = value``, on a frozen dataclass (a method) too."""
    object.__setattr__(owner, attribute, value)


def family_of(demo: str) -> str:
    """The gate family a demo stands for (its image side)."""
    return demo.removeprefix("tiny-")


def bench_demo(demo: str, side: int | None, reps: int) -> dict[str, Any]:
    """Ops, device reads and median host ms per step of the reduced call, and the whole call beside the unreduced
    one."""
    adapter = load_backbone(demo)
    image = gate_image(family_of(demo))
    if side is not None:
        image = image.resize((side, side))
    inputs = dropin_inputs(adapter, image, BATCH)
    n = adapter.encode_image(image).num_tokens
    keep = keep_from_ratio(KEPT, n)
    call = lambda: dropin_generate(adapter.model, inputs)  # noqa: E731
    call()
    host_ms = Clock("cpu").once  # the host's wall time of a call (what this benchmark measures, on any device)
    unreduced_ms = median(host_ms(call) for _ in range(reps))
    meter = StepMeter()
    reduction = reduce_visual_tokens(adapter.model, processor=adapter.processor, method="care", keep=keep)
    with metered(reduction, meter), reduction:
        call()  # warm: memos, caches
        times: dict[str, list[float]] = {}
        for _ in range(reps):
            meter.seconds.clear()
            total = host_ms(call)
            for name, seconds in [*meter.seconds.items(), ("call", total / 1e3)]:
                times.setdefault(name, []).append(seconds * 1e3)
        with torch.no_grad(), OpCounter() as counter:
            meter.counter = counter
            call()
        meter.counter = None
        call_ops = counter.ops
    steps = [{"step": name, "ops": sum(meter.ops.get(name, Counter()).values()),
              "syncs": sum(v for k, v in meter.ops.get(name, Counter()).items() if k in SYNC_OPS),
              "host_ms": median(times[name]), "op_names": dict(meter.ops.get(name, Counter()).most_common(12))}
             for _, name in STEPS if name in times]  # fmt: skip
    syncs = sum(v for k, v in call_ops.items() if k in SYNC_OPS)
    steps.append({"step": "reduced call", "ops": sum(call_ops.values()), "syncs": syncs,
                  "host_ms": median(times["call"])})  # fmt: skip
    steps.append({"step": "unreduced call", "ops": None, "syncs": None, "host_ms": unreduced_ms})
    return {"demo": demo, "N": n, "K": keep, "batch": BATCH, "side": image.size[0], "steps": steps}


def main(argv: list[str] | None = None) -> None:
    parser = make_parser(__doc__, quick="tiny-qwen3-vl only, 3 repetitions (about 20 s on a 2-core CPU)",
                         duration="2 demos, 10 repetitions: about 1-2 minutes on a 2-core CPU")  # fmt: skip
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions (default: 10)")
    parser.add_argument("--demos", default=",".join(DEMOS), help=f"comma-separated (default: {','.join(DEMOS)})")
    parser.add_argument("--sides", default="", help="comma-separated image sides besides the gate's (px)")
    args = parser.parse_args(argv)
    demos = demos_option(args.demos, DEMOS, args.quick)
    at_least_one("--reps", args.reps)
    try:
        sides = [None, *(int(s) for s in args.sides.split(",") if s.strip())]
    except ValueError:
        raise fail(f"--sides: whole numbers of pixels, got {args.sides!r}") from None
    writer = ResultsWriter(args, "cpu-bench_dropin_host")
    torch.set_num_threads(1)
    reps = 3 if args.quick else args.reps
    results = [bench_demo(demo, side, reps) for demo in demos for side in sides]
    cells = [(f"{r['demo']} N={r['N']} K={r['K']}", s["step"], "" if s["ops"] is None else str(s["ops"]),
              "" if s["syncs"] is None else str(s["syncs"]), f"{s['host_ms']:.2f}")
             for r in results for s in r["steps"]]  # fmt: skip
    print_table(f"Drop-in reduced generate, batch {BATCH}, {NEW_TOKENS} new tokens: host work per step "
                f"(CPU, float32, one thread, median of {reps})", ("call", "step", "ops", "syncs", "host ms"),
                cells, keys=2)  # fmt: skip
    writer.finish({"date": stamp(), "machine": host(), "source": source_state(), "reps": reps, "batch": BATCH,
                   "new_tokens": NEW_TOKENS, "results": results})  # fmt: skip


if __name__ == "__main__":
    run_main(main)
