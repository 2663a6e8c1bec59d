"""`care reduce IMAGE`: one method on one image; K, anchors, calibration signals, CSR, answers, time per stage."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from care_cli import options as opt
from care_cli import render
from care_cli.errors import UserError
from care_core.config import CaReConfig
from care_core.errors import one_line
from care_core.vocabulary import DEFAULT_QUESTION

ImageArg = Annotated[Path, typer.Argument(help="Image file (any size, mode or EXIF orientation).", show_default=False)]
Question = Annotated[
    str | None,
    typer.Option("--question", "-q", help="A question about the image: adds the CSR (Supp. A) of the reduction."),
]
Out = Annotated[
    Path | None,
    typer.Option("--out", "-o", help="Write the reduced tokens, anchors, signals and scores as .safetensors."),
]
MethodName = Annotated[str, typer.Option("--method", help="Registered method (see 'care methods'); default care.")]
Generate = Annotated[
    bool,
    typer.Option("--generate", metavar="",
                 help=f"Answer --question (default {DEFAULT_QUESTION!r}) with all visual tokens and with the "
                      "reduced ones; times are medians over --repeats alternating runs after a warm-up."),
]  # fmt: skip
MaxNewTokens = Annotated[int, typer.Option("--max-new-tokens", help="Tokens generated per answer (greedy).")]
Repeats = Annotated[int, typer.Option("--repeats", help="Timed rounds per --generate answer (median reported).")]


def _check_answer_options(generate: bool, max_new_tokens: int, repeats: int, cuda_graphs: bool | None) -> None:
    """The timed answers' options, before any work: counts of at least 1, graphs only with --generate."""
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if repeats < 1:
        raise UserError(f"--repeats must be at least 1, got {repeats}")
    if cuda_graphs is not None and not generate:
        raise UserError("--cuda-graphs/--no-cuda-graphs apply to --generate answers; add --generate")


@opt.with_config
def reduce(
    image: ImageArg,
    ratio: opt.Ratio = None,
    keep: opt.Keep = None,
    model: opt.Model = None,
    device: opt.Device = "auto",
    dtype: opt.Dtype = "auto",
    question: Question = None,
    method: MethodName = "care",
    generate: Generate = False,
    max_new_tokens: MaxNewTokens = 32,
    repeats: Repeats = 3,
    cuda_graphs: opt.CudaGraphs = None,
    out: Out = None,
    force: opt.Force = False,
    json_output: opt.Json = False,
    config: CaReConfig | None = None,
) -> None:
    """Reduce one image's visual tokens with CaRe (or --method) and report what was kept and what it cost.

    A budget is required: --ratio R or --keep K.
    """
    from care_cli.io import check_output_path, load_image
    from care_core.methods import canonical_name

    assert config is not None
    budget = opt.budget(ratio, keep)
    opt.check_question(question)
    _check_answer_options(generate, max_new_tokens, repeats, cuda_graphs)
    out_path = check_output_path(out, [image], force, suffixes=(".safetensors",)) if out is not None else None
    name = canonical_name(method)
    picture = load_image(image)

    from care_core.pipeline import ReductionPipeline

    with render.status("Loading backbone (the demo is built on first use)…", quiet=json_output):
        pipe = ReductionPipeline.from_pretrained(model, methods=[name], config=config, device=device, dtype=dtype)
    render.print_notices(pipe.adapter.notices)
    pipe.adapter.check_image(picture, name=one_line(image))
    if cuda_graphs:
        reason = pipe.adapter.graph_generation_reason()
        if reason is not None:
            raise UserError(f"--cuda-graphs: {reason}")
    output = pipe(picture, question, [budget], csr=question is not None)
    if generate:  # the timed comparison: all tokens against the reduction (care_core.timing's protocol)
        output = pipe.time_answers(output, max_new_tokens=max_new_tokens, repeats=repeats, cuda_graph=cuda_graphs)
    summary = summarise(pipe, output, max_new_tokens, cuda_graphs=cuda_graphs)
    summary["image"] = {"path": str(image), "height": picture.height, "width": picture.width}
    if out_path is not None:
        write_reduction(out_path, output, summary)
        summary["out"] = str(out_path)
    if json_output:
        render.print_json(summary)
    else:
        show_summary(summary)


def summarise(pipe: Any, output: Any, max_new_tokens: int, cuda_graphs: bool | None = None) -> dict[str, Any]:
    """The JSON-ready report of one reduction."""
    from care_cli.versions import versions
    from care_core.methods import method_class

    run = output.runs[0]
    result = run.result
    n = output.num_tokens
    indices = result.indices
    residual = n - indices.numel()
    signals = [] if result.signals is None else result.signals.tolist()
    order = result.info.get("selection_order")
    cls = method_class(run.method)
    timings = {**pipe.load_timings_ms, **output.timings_ms, **run.timings_ms}
    timings["total"] = round(sum(timings.values()), 3)
    answers = None
    if run.answer is not None:
        full, reduced = output.full_answer, run.answer
        answers = {"full": full.to_dict(), "reduced": reduced.to_dict(),
                   "question": output.question, "max_new_tokens": max_new_tokens}  # fmt: skip
        if full.first_token_from_features_ms and reduced.first_token_from_features_ms:
            answers["speedup_first_token"] = full.first_token_from_features_ms / reduced.first_token_from_features_ms
        if full.decoding != "cuda-graph":
            answers["cuda_graphs_off"] = "--no-cuda-graphs" if cuda_graphs is False else full.eager_reason
    return {
        "command": "reduce",
        "method": run.method,
        "category": cls.category,
        "backbone": pipe.backbone.to_dict(),
        "N": n,
        "K": run.keep,
        "tokens_out": result.num_tokens,
        "kept_share": run.keep / n,
        "grid": list(output.tokens.grid) if output.tokens.grid else None,
        "anchors": indices.tolist(),
        "anchor_order": order.tolist() if order is not None else indices.tolist(),
        "token_index": result.token_index.tolist(),
        "signals": signals,
        "num_signals": len(signals),
        "signal_share": len(signals) / residual if residual else 0.0,
        "question": output.question,
        "question_defaulted": output.question_defaulted,
        "csr": None if run.csr is None else 100 * run.csr,
        "answers": answers,
        "timings_ms": timings,
        "config": pipe.config.to_dict(),
        "hyperparameters_used": sorted(cls.hyperparameters),
        "versions": versions(),
    }


def write_reduction(path: Path, output: Any, summary: dict[str, Any]) -> None:
    """Atomically write the reduction as safetensors; config, backbone and versions go in the metadata."""
    from care_cli.io import save_safetensors_atomic
    from care_core.methods import method_class

    run = output.runs[0]
    res, tok = run.result, output.tokens
    tensors = {
        "calibrated_tokens": res.tokens,
        "projected_tokens": run.projected,
        "anchors": res.indices,
        "anchor_order": res.info.get("selection_order", res.indices),
        "token_index": res.token_index,
        "signals": res.signals if res.signals is not None else res.indices.new_empty(0),
        "positions": tok.positions,
        "boxes": tok.boxes,
    }
    if res.scores is not None:
        tensors[getattr(method_class(run.method), "score_label", None) or "scores"] = res.scores
    if res.assignment is not None:
        tensors["assignment"] = res.assignment
    for key in ("residuals", "confidence"):
        if key in res.info:
            tensors["residual_confidence" if key == "confidence" else key] = res.info[key]
    metadata = {
        "format": "care.reduce/1",
        "method": summary["method"],
        "N": str(summary["N"]),
        "K": str(summary["K"]),
        "config": json.dumps(summary["config"]),
        "backbone": json.dumps(summary["backbone"]),
        "versions": json.dumps(summary["versions"]),
        "image": json.dumps(summary.get("image")),
    }
    save_safetensors_atomic(path, {k: v.detach() for k, v in tensors.items()}, metadata)


def show_summary(summary: dict[str, Any]) -> None:
    backbone = summary["backbone"]
    n = summary["N"]
    residual = n - len(summary["anchors"])
    grid = summary["grid"]
    calibrates = summary["category"] == "calibration"
    rows = [
        ("image", f"{summary['image']['path']}  ({summary['image']['width']}×{summary['image']['height']} px)"),
        ("backbone", f"{backbone['name']} ({backbone['family']}, {backbone['device']}, {backbone['dtype']})"),
        ("method", summary["method"]),
        ("visual tokens", f"N = {n}" + (f"  (grid {grid[0]}×{grid[1]})" if grid else "")),
        ("kept", _kept_line(summary)),
        ("anchors" if calibrates else "kept patches", render.short_list(summary["anchors"])),
    ]
    if calibrates or summary["num_signals"]:
        rows.append(("calibration signals", f"{summary['num_signals']} of {residual} residual tokens "
                                            f"({100 * summary['signal_share']:.1f}%)"))  # fmt: skip
    config = summary["config"]
    if "engine" in summary["hyperparameters_used"]:
        rows.append(("engine", f"{config['engine']}, m = {config['m']}, seed = {config['seed']}"))
    if summary["csr"] is not None:
        rows.append(("CSR (×100)", f"{summary['csr']:.2f}  for “{summary['question']}”"))
    if summary.get("out"):
        rows.append(("saved", summary["out"]))
    title = f"care reduce — {summary['method']}"
    render.stdout.print(render.key_value_table(title, rows, caption=backbone["note"]))
    render.timings_table(summary["timings_ms"])
    if summary.get("answers"):
        show_answers(summary)


def _kept_line(summary: dict[str, Any]) -> str:
    """K and its share of N, and where the output rows sit when they are not one per listed patch: rows tied to
    no patch (``token_index`` -1: a CLS token, a merged summary) or several rows at one patch."""
    k, rows = summary["K"], summary["token_index"]
    line = f"K = {k}  ({100 * summary['kept_share']:.1f}% of N)"
    if len(rows) != k:
        line += f", {len(rows)} output rows"
    at_patches = sum(1 for index in rows if index >= 0)
    patches = len(summary["anchors"])
    if at_patches == len(rows) and patches == at_patches:
        return line
    where = [f"{patches} patches" + (f" ({at_patches} rows)" if at_patches != patches else "")]
    if at_patches != len(rows):
        where.append(f"{len(rows) - at_patches} row{'s' if len(rows) - at_patches != 1 else ''} at no patch "
                     "(a CLS or merged token)")  # fmt: skip
    return f"{line}: {' + '.join(where)}"


def show_answers(summary: dict[str, Any]) -> None:
    """The answers with all and with the reduced visual tokens, their times, and the first-token speed-up."""
    answers = summary["answers"]
    asked = answers["question"] + ("  (default question)" if summary["question_defaulted"] else "")
    reps = answers["full"]["repeats"]
    how = ("replayed CUDA graphs over a static KV cache" if answers["full"]["decoding"] == "cuda-graph"
           else "transformers' generate" + (f" ({answers['cuda_graphs_off']})" if answers.get("cuda_graphs_off")
                                            else ""))  # fmt: skip
    columns = [
        render.Column("visual tokens\nfed", "name", key=True),
        render.Column("first token\nms"),
        render.Column("from\nfeatures ms"),
        render.Column("total\nms"),
        render.Column("answer", "text"),
    ]
    rows = [[f"{answers[label]['visual_tokens']} ({label})", _ms(answers[label]["first_token_ms"]),
             _ms(answers[label]["first_token_from_features_ms"]), _ms(answers[label]["total_ms"]),
             repr(answers[label]["answer"])] for label in ("full", "reduced")]  # fmt: skip
    render.print_table(f"Answers to “{asked}” (greedy, {how}; ms = median of {reps} alternating runs after a "
                       "warm-up)", columns, rows, caption=summary["backbone"]["note"],
                       caption_style="bold yellow")  # fmt: skip
    speedup = answers.get("speedup_first_token")
    if speedup:
        render.stdout.print(
            f"first token from the features with {summary['method']} against all tokens: {speedup:.2f}× "
            f"({'faster' if speedup >= 1 else 'slower'}; method + projector + prefill against projector + "
            "prefill)"
        )


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:,.1f}"
