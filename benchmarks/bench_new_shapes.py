"""One request at a time on images of several sizes, as a server meets them: each answer's wall time from CaRe's
projected rows, with the default decoding (CUDA graphs: the first answer at a shape runs the step and captures its
graphs, later answers at that shape replay them) and eagerly, each decoding in a process of its own (so its first
answer also pays that process's one-time costs: the decoder pieces' compile, cuBLAS handles, Triton kernels).

    python -m benchmarks.bench_new_shapes                                   # qwen2.5-vl and qwen3-vl, one GPU
    python -m benchmarks.bench_new_shapes --families qwen3-vl --sides 672,896,672
    python -m benchmarks.bench_new_shapes --tiny --device cpu --families qwen3-vl --sides 56,84,56   # smoke test

Per family (:mod:`benchmarks.models`' full-size build, random weights in bf16) and decoding: for each side of
``--sides`` in turn, ``examples/astronaut.jpg`` resized to that square, CaRe at K = floor(N/9) (untimed), then one
``adapter.generate(question, tokens, rows, max_new_tokens=8, kept=...)`` timed (host wall ms, the device idle at the
start). A Qwen image's N follows its size, so a new side is a new prompt length, which the static loop pads to its
bucket. What it shows: what the first answer at a shape costs against a replay and against eager decoding, that is,
the price of capturing graphs for a shape a request may never bring again. Run from the repository root.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    ResultsWriter,
    child_result,
    comma_list,
    fail,
    free_device_memory,
    make_parser,
    pick_device,
    print_table,
    run_main,
    say,
    source_state,
)
from benchmarks.gpu.context import card_slug, environment
from benchmarks.latency import KEPT, NEW_TOKENS, QUESTION, example_image, families_option
from benchmarks.models import full_size_adapter
from care_core.budget import Budget, keep_from_ratio

DEFAULT_FAMILIES = "qwen2.5-vl,qwen3-vl"
#: sides in px: three new sizes, two of them again, then a fourth new one
DEFAULT_SIDES = "672,896,1008,672,1008,1120"
DECODINGS = {"default": None, "eager": False}  # name -> the cuda_graph argument of generate
DURATION = "two families, two decodings: about 3-4 minutes on one H200 (each full-size build is most of it)"


def answer_ms(adapter: Any, side: int, cuda_graph: bool | None) -> dict[str, Any]:
    """One request at ``side`` px: CaRe's rows at K = floor(N/9) (untimed), then its answer timed."""
    from care_core.pipeline import ReductionPipeline

    tokens = adapter.encode_image(example_image(side))
    keep = keep_from_ratio(KEPT, tokens.num_tokens)
    run = ReductionPipeline(adapter, ["care"])(tokens, QUESTION, [Budget.keep(keep)], cuda_graph=cuda_graph).runs[0]
    cuda = adapter.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(adapter.device)
    start = time.perf_counter()
    with torch.no_grad():
        out = adapter.generate(QUESTION, tokens, run.projected, max_new_tokens=NEW_TOKENS,
                               kept=run.result.token_index, cuda_graph=cuda_graph)  # fmt: skip
    wall_ms = (time.perf_counter() - start) * 1e3  # generate returns token ids on the host: the device is done
    return {"side": side, "N": tokens.num_tokens, "K": keep, "decoding": out.decoding, "wall_ms": wall_ms}


def bench_process(family: str, decoding: str, sides: list[int], device: torch.device, tiny: bool) -> dict[str, Any]:
    """One family and decoding, in the process the parent started for them: a request per side, in order."""
    adapter = full_size_adapter(family, device, tiny=tiny)
    rows = [answer_ms(adapter, side, DECODINGS[decoding]) for side in sides]
    free_device_memory(device)
    return {"family": family, "decoding": decoding, "requests": rows}


def in_own_process(family: str, decoding: str, args: Any, folder: Path) -> dict[str, Any]:
    """:func:`bench_process` in a child process: nothing compiled, captured or tuned by another run reaches it."""
    out = folder / f"{family}-{decoding}.json"
    command = [sys.executable, "-m", "benchmarks.bench_new_shapes", "--families", family, "--decodings", decoding,
               "--sides", ",".join(map(str, args.sides)), "--device", str(args.device), "--child-out", str(out),
               *(["--tiny"] if args.tiny else [])]  # fmt: skip
    return child_result(command, out, {"family": family, "decoding": decoding})


def print_runs(runs: list[dict[str, Any]]) -> None:
    header = ["family", "decoding", "request", "side", "N", "K", "decoded", "answer ms"]
    rows = []
    for run in runs:
        if "error" in run:
            rows.append([run["family"], run["decoding"], "-", "-", "-", "-", run["error"], "-"])
            continue
        for index, r in enumerate(run["requests"], 1):
            rows.append([run["family"], run["decoding"], str(index), str(r["side"]), str(r["N"]), str(r["K"]),
                         r["decoding"], f"{r['wall_ms']:.1f}"])  # fmt: skip
    print_table(f"One request at a time, {NEW_TOKENS} new tokens: each answer from CaRe's rows", header, rows)


def parse(argv: list[str] | None) -> Any:
    parser = make_parser(__doc__ or "", quick="the first two sides only", duration=DURATION, device="cuda")
    parser.add_argument("--families", default=DEFAULT_FAMILIES, help=f"comma-separated (default {DEFAULT_FAMILIES})")
    parser.add_argument("--sides", default=DEFAULT_SIDES, help=f"image sides in px, in order (default {DEFAULT_SIDES})")
    parser.add_argument("--decodings", default=",".join(DECODINGS), help="comma-separated: default, eager")
    parser.add_argument("--tiny", action="store_true", help="the demo widths (smoke test of this benchmark)")
    parser.add_argument("--child-out", type=Path, default=None, help=argparse.SUPPRESS)  # the parent's, for a child
    args = parser.parse_args(argv)
    args.families = families_option(args.families)
    try:
        args.sides = [int(side) for side in comma_list(args.sides)]
    except ValueError:
        raise fail(f"--sides takes whole numbers of px, got {args.sides!r}") from None
    if not args.sides or min(args.sides) < 28:
        raise fail(f"--sides takes sides of at least 28 px, got {args.sides!r}")
    args.decodings = comma_list(args.decodings)
    unknown = [name for name in args.decodings if name not in DECODINGS]
    if unknown or not args.decodings:
        raise fail(f"--decodings takes {', '.join(DECODINGS)}, got {args.decodings!r}")
    if args.quick:
        args.sides = args.sides[:2]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    device = pick_device(args.device)
    if args.child_out is not None:  # one family and decoding, in the process the parent started for them
        result = bench_process(args.families[0], args.decodings[0], args.sides, device, args.tiny)
        args.child_out.write_text(json.dumps(result) + "\n", encoding="utf-8")
        return
    env = environment(device)
    writer = ResultsWriter(args, f"gpu-{card_slug(env['card'])}-new-shapes")
    results: dict[str, Any] = {"environment": env, "source": source_state(), "question": QUESTION,
                               "new_tokens": NEW_TOKENS, "sides": args.sides, "tiny": args.tiny,
                               "weights": "random (timings do not depend on weight values)", "runs": []}  # fmt: skip
    decodings = [name for name in args.decodings if device.type == "cuda" or DECODINGS[name] is False]
    if len(decodings) < len(args.decodings):
        say("no CUDA: the default decoding is eager here, so only the eager runs are made")
    with tempfile.TemporaryDirectory(prefix="care-new-shapes-") as folder:
        for family in args.families:
            for decoding in decodings:
                say(f"{family}, {decoding} decoding ...")
                results["runs"].append(in_own_process(family, decoding, args, Path(folder)))
                writer.save(results)
    print_runs(results["runs"])
    writer.finish(results)


if __name__ == "__main__":
    run_main(main)
