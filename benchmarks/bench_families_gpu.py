"""GPU benchmark of the Qwen3-VL, LLaVA-OneVision and InternVL3 families at full size (random weights, bf16).

    python -m benchmarks.bench_families_gpu                        # all three on one H100: about 4 minutes
    python -m benchmarks.bench_families_gpu --families internvl3   # one family
    python -m benchmarks.bench_families_gpu --quick                # one image, one budget, 2 repetitions
    python -m benchmarks.bench_families_gpu --tiny --quick --device cpu   # smoke test (the demo widths)

Per family (Qwen3-VL-8B, LLaVA-OneVision-7B, InternVL3-8B, built one at a time from the flops specs' dims with the
demos' processors) and image (the example photo at the spec's default size, and at its own 512x512 unless
``--quick``): N; the vision tower (processor + tower, ``adapter.encode_image``); ``care_reduce`` through the
adapter's projector with a caller's ``Scorer`` against its floor; then at K = floor(N/9) and floor(2N/9) (88.9 % and
77.8 % pruned, ``care_core.budget``) the pipeline's timed answers (``ReductionPipeline.time_answers``, 8 new
tokens): prefill and first token from the vision features with all tokens and with CaRe, decoded from CUDA graphs
where the adapter allows (else eagerly, with its reason).

The floor of ``care_reduce``: the jvp engine's multiply-adds at the measured tf32 rate. LLaVA-OneVision's projector
is Linear-GELU-Linear: m N d_h d_out (the dense second layer, as ``benchmarks.gpu``; the triangular factor the
default Scorer uses on CUDA needs about half). Qwen3-VL's merger and InternVL's projector start with a LayerNorm:
they take the generic ``torch.func.jvp`` path, whose tangents go through both linears, m N (d_in d_h + d_h d_out).
Weights are random (timings do not depend on their values). Run from the repository root.
"""

from __future__ import annotations

import gc
import time
from fractions import Fraction
from typing import Any

import torch

from benchmarks.common import (
    EXAMPLES,
    Clock,
    ResultsWriter,
    comma_list,
    fail,
    fmt,
    make_parser,
    pick_device,
    print_table,
    say,
)
from benchmarks.gpu.context import M_DIRECTIONS, QUESTION, Workload, card_slug, environment
from benchmarks.gpu.generate import answer_row
from benchmarks.gpu.scoring import Micro, floor_ms, matmul_rates
from benchmarks.models import FAMILY_MODELS, build_family

KEPT = (Fraction(1, 9), Fraction(2, 9))  # 88.9 % and 77.8 % of the tokens pruned
NEW_TOKENS = 8
DECODING = {"auto": None, "eager": False, "graphs": True}
DURATION = (
    "full run: about 4 minutes on one H100 (builds included; at most 6); --quick: about 2 minutes; "
    "--tiny --quick --device cpu: about a minute on a 2-core CPU."
)


def parse(argv: list[str] | None) -> Any:
    parser = make_parser(__doc__, quick="one image, one budget (88.9 %% pruned), 2 repetitions",
                         duration=DURATION, device="cuda")  # fmt: skip
    parser.add_argument(
        "--families", default=",".join(FAMILY_MODELS), help="comma-separated: " + ", ".join(FAMILY_MODELS)
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--decoding", choices=tuple(DECODING), default="auto",
                        help="auto: CUDA graphs where the adapter allows, else eager (default)")  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="the demo widths (smoke test of this benchmark)")
    args = parser.parse_args(argv)
    args.families = comma_list(args.families)
    unknown = [f for f in args.families if f not in FAMILY_MODELS]
    if unknown or not args.families:
        raise fail(
            f"--families: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(FAMILY_MODELS)}"
        )
    if args.reps < 1:
        raise fail(f"--reps must be at least 1, got {args.reps}")
    if args.quick:
        args.reps = min(args.reps, 2)
    return args


def spec_of(family: str) -> Any:
    from care_core.flops.specs import KNOWN_BACKBONES

    return KNOWN_BACKBONES[FAMILY_MODELS[family][0]]


def images(family: str, quick: bool) -> list[tuple[str, Any]]:
    """(label, image): the photo resized to the spec's default size, and (unless ``quick``) the photo itself."""
    from PIL import Image

    photo = Image.open(EXAMPLES / "astronaut.jpg").convert("RGB")
    height, width = spec_of(family).default_image
    out = [(f"{width}x{height}", photo.resize((width, height)))]
    if not quick and photo.size != (width, height):
        out.append((f"{photo.size[0]}x{photo.size[1]}", photo))
    return out


def make_adapter(family: str, device: torch.device, tiny: bool) -> Any:
    from care_core import backbones

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    began = time.perf_counter()
    model, processor = build_family(family, device, dtype, tiny)
    adapter = getattr(backbones, FAMILY_MODELS[family][3])(model, processor, name=f"{spec_of(family).name} (random)")
    params = sum(p.numel() for p in model.parameters())
    say(f"== {family}: built {params / 1e9:.2f} B parameters in {time.perf_counter() - began:.1f} s")
    return adapter


def floor_of(family: str, projector: torch.nn.Module, n: int) -> tuple[int, str]:
    """The jvp engine's multiply-adds for N tokens through ``projector`` (m directions), and what they count."""
    linears = [mod for mod in projector.modules() if isinstance(mod, torch.nn.Linear)]
    if spec_of(family).projector.kind == "mlp2x_gelu":
        second = linears[-1]
        return M_DIRECTIONS * n * second.in_features * second.out_features, "m N d_h d_out (dense 2nd layer)"
    per_token = sum(mod.in_features * mod.out_features for mod in linears)
    return M_DIRECTIONS * n * per_token, "m N (d_in d_h + d_h d_out) (generic jvp)"


def bench_care_reduce(family: str, w: Workload, micro: Micro) -> dict[str, Any]:
    """``care_reduce`` at the smallest budget through the adapter's projector and a caller's Scorer."""
    from functools import partial

    from care_core import care_reduce
    from care_core.scoring import Scorer

    projector = w.adapter.projector
    v, positions, n = w.tokens.features.float(), w.tokens.positions, w.tokens.num_tokens
    run = partial(care_reduce, v, projector, positions, keep=w.budgets[0], scorer=Scorer(projector))
    macs, counted = floor_of(family, projector, n)
    row: dict[str, Any] = {"floor_counts": counted, "floor_macs": macs, "floor_ms": floor_ms(macs, micro.rates["tf32"])}
    try:
        row["care_reduce_ms"] = micro.clock.median(run, reps=max(micro.reps, 3), warmup=2)
        row["x_floor"] = row["care_reduce_ms"] / row["floor_ms"]
    except Exception as exc:  # keep going: the answers still get timed
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
    return row


def bench_answers(w: Workload, tower_ms: float, reps: int, decoding: str) -> list[dict[str, Any]]:
    """All tokens against CaRe at each budget: the pipeline's timed answers (medians of alternating rounds)."""
    from care_core.budget import Budget
    from care_core.pipeline import ReductionPipeline

    pipe = ReductionPipeline(w.adapter, ["care"])
    graphs = DECODING[decoding]
    rows = []
    for keep in w.budgets:
        base = {"workload": w.name, "K": keep, "pruned_pct": 100 * (1 - keep / w.tokens.num_tokens)}
        try:
            out = pipe(w.tokens, QUESTION, [Budget.keep(keep)], generate=True, max_new_tokens=NEW_TOKENS,
                       cuda_graph=graphs)  # fmt: skip
            out = pipe.time_answers(out, max_new_tokens=NEW_TOKENS, repeats=reps, cuda_graph=graphs)
        except Exception as exc:
            rows.append({**base, "note": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        full, red = out.full_answer, out.runs[0].answer
        assert full is not None and red is not None  # generate=True answers with all tokens and with the K kept
        row = {**base, **answer_row(w, out, red.decoding, keep, tower_ms, NEW_TOKENS)}
        row["eager_reason"] = [full.eager_reason, red.eager_reason]
        rows.append(row)
        say(f"  K={keep} ({row['decoding']}): first token from features {row['full_first_token_from_features_ms']:.2f}"
            f" -> {row['care_first_token_from_features_ms']:.2f} ms")  # fmt: skip
    return rows


def bench_family(family: str, args: Any, device: torch.device, micro: Micro) -> dict[str, Any]:
    """Build the family's model, measure every image, free the model."""
    adapter = make_adapter(family, device, args.tiny)
    out: dict[str, Any] = {
        "family": family,
        "spec": spec_of(family).name,
        "display": spec_of(family).display,
        "images": [],
    }
    try:
        for label, image in images(family, args.quick):
            tokens = adapter.encode_image(image)
            n = tokens.num_tokens
            keeps = tuple(keep_for(ratio, n) for ratio in (KEPT[:1] if args.quick else KEPT))
            w = Workload(f"{family} {label}", adapter, image, tokens, keeps, {})
            tower_ms = micro.clock.median(w.tower, reps=micro.reps)
            say(f"  {label}: N = {n}, tower {tower_ms:.1f} ms")
            entry = {"image": label, "N": n, "tower_ms": tower_ms, **bench_care_reduce(family, w, micro)}
            entry["answers"] = bench_answers(w, tower_ms, micro.reps, args.decoding)
            out["images"].append(entry)
    finally:
        del adapter
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def keep_for(ratio: Fraction, n: int) -> int:
    from care_core.budget import keep_from_ratio

    return keep_from_ratio(ratio, n)


def print_family(result: dict[str, Any]) -> None:
    entries = result["images"]
    counted = entries[0]["floor_counts"] if entries else ""
    rows = [[e["image"], e["N"], fmt(e["tower_ms"], 1), fmt(e.get("care_reduce_ms")), fmt(e["floor_ms"]),
             fmt(e.get("x_floor"), 1)] for e in entries]  # fmt: skip
    print_table(f"{result['display']}: care_reduce (m = {M_DIRECTIONS}) vs its floor, {counted} at tf32",
                ["image", "N", "tower ms", "care_reduce ms", "floor ms", "x floor"], rows)  # fmt: skip
    header = ["image", "K (pruned)", "prefill all", "prefill CaRe", "first all", "first CaRe", "speed-up",
              f"{NEW_TOKENS} tok all", f"{NEW_TOKENS} tok CaRe"]  # fmt: skip
    rows = []
    for e in entries:
        for a in e["answers"]:
            key = [e["image"], f"{a['K']} ({a['pruned_pct']:.1f}%)"]
            if "note" in a:
                rows.append([*key, a["note"]])
                continue
            rows.append([*key, fmt(a["full_prefill_forward_ms"]), fmt(a["care_prefill_forward_ms"]),
                         fmt(a["full_first_token_from_features_ms"]), fmt(a["care_first_token_from_features_ms"]),
                         fmt(a["speedup_first_token_incl_care"]), fmt(a["full_total_ms"]),
                         fmt(a["care_total_ms"])])  # fmt: skip
    print_table(f"{result['display']}: ms; prefill, first token from the vision features and {NEW_TOKENS} tokens "
                "with all tokens and with CaRe", header, rows, keys=2)  # fmt: skip
    decodings = sorted({d for e in entries for a in e["answers"] for d in a.get("answer_decoding", [])})
    reasons = sorted({r for e in entries for a in e["answers"] for r in a.get("eager_reason", []) if r})
    say(f"  {result['display']} decoding: {', '.join(decodings) or '-'}" + "".join(f"; eager: {r}" for r in reasons))


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    device = pick_device(args.device)
    env = environment(device)
    writer = ResultsWriter(args, f"gpu-{card_slug(env['card'])}-families")
    clock = Clock(device)
    started = time.perf_counter()
    size = 256 if args.tiny or device.type == "cpu" else 8192
    micro = Micro(clock, args.reps, matmul_rates(device, clock, size))
    results: dict[str, Any] = {"environment": env, "m": M_DIRECTIONS, "kept_fractions": [str(r) for r in KEPT],
                               "quick": args.quick, "tiny": args.tiny, "decoding": args.decoding,
                               "max_new_tokens": NEW_TOKENS, "question": QUESTION, "matmul_size": size,
                               "matmul_tflops": micro.rates, "floor_rate": "tf32",
                               "weights": "random, seed 0 (timings do not depend on weight values)",
                               "dtype": "bfloat16 model on CUDA (float32 on the CPU), float32 CaRe maths",
                               "families": []}  # fmt: skip
    say(
        f"{env['card']} torch {env['torch']} transformers {env['transformers']}; tf32 {micro.rates['tf32']:.0f} TFLOP/s"
    )
    for family in args.families:
        results["families"].append(bench_family(family, args, device, micro))
        writer.save(results)
    results["wall_s"] = time.perf_counter() - started
    for result in results["families"]:
        print_family(result)
    writer.finish(results)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        raise SystemExit(130) from None
