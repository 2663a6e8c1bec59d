"""`care reduce IMAGE`: run CaRe on one image, report K, anchors, signals and time per stage."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from care_cli import options as opt
from care_cli import render
from care_cli.errors import UserError

ImageArg = Annotated[Path, typer.Argument(help="Image file (any size, mode or EXIF orientation).", show_default=False)]
Question = Annotated[
    str | None,
    typer.Option("--question", "-q", help="A question about the image: adds the CSR (Supp. A) of the reduction."),
]
Out = Annotated[
    Path | None,
    typer.Option("--out", "-o", help="Write the reduced tokens, anchors, signals and psi_bar as safetensors."),
]
Force = Annotated[bool, typer.Option("--force", help="Replace --out if it exists.")]
MethodName = Annotated[str, typer.Option("--method", help="Registered method (see 'care methods'); default care.")]
Generate = Annotated[
    bool, typer.Option("--generate", help="Answer --question twice: with all visual tokens, then the reduced ones.")
]
MaxNewTokens = Annotated[int, typer.Option("--max-new-tokens", help="Tokens generated per answer (greedy).")]


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
    out: Out = None,
    force: Force = False,
    json_output: opt.Json = False,
    h: opt.H = opt._DEFAULT.h,
    m: opt.M = opt._DEFAULT.m,
    lam: opt.Lam = opt._DEFAULT.lam,
    eta: opt.Eta = opt._DEFAULT.eta,
    theta_s: opt.ThetaS = opt._DEFAULT.theta_s,
    theta_c: opt.ThetaC = opt._DEFAULT.theta_c,
    alpha: opt.Alpha = opt._DEFAULT.alpha,
    sigma_p: opt.SigmaP = opt._DEFAULT.sigma_p,
    tau_g: opt.TauG = opt._DEFAULT.tau_g,
    tau_c: opt.TauC = opt._DEFAULT.tau_c,
    tau_s: opt.TauS = opt._DEFAULT.tau_s,
    eps: opt.Eps = opt._DEFAULT.eps,
    seed: opt.Seed = opt._DEFAULT.seed,
    engine: opt.Engine = opt._DEFAULT.engine,
    matmul_precision: opt.MatmulPrecision = opt._DEFAULT.matmul_precision,
) -> None:
    """Reduce one image's visual tokens with CaRe (or --method) and report what was kept and what it cost."""
    from care_cli.io import check_output_path, load_image
    from care_core import CaReConfig

    opt.check_budget(ratio, keep)
    config = CaReConfig(
        h=h, m=m, lam=lam, eta=eta, theta_s=theta_s, theta_c=theta_c, alpha=alpha, sigma_p=sigma_p,
        tau_g=tau_g, tau_c=tau_c, tau_s=tau_s, eps=eps, seed=seed, engine=engine,  # type: ignore[arg-type]
        matmul_precision=matmul_precision,  # type: ignore[arg-type]
    )  # fmt: skip
    out_path = check_output_path(out, [image], force) if out is not None else None
    if question is not None and not question.strip():
        from care_core.errors import QuestionError

        raise QuestionError("--question is empty")
    picture = load_image(image)
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    result = run_reduce(picture, ratio=ratio, keep=keep, model=model, device=device, dtype=dtype,
                        question=question, config=config, method=method, generate=generate,
                        max_new_tokens=max_new_tokens)  # fmt: skip
    summary = result["summary"]
    summary["image"] = {"path": str(image), "height": picture.height, "width": picture.width}
    if out_path is not None:
        write_reduction(out_path, result)
        summary["out"] = str(out_path)
    if json_output:
        render.print_json(summary)
    else:
        show_summary(summary)


def _care_result(reduction: Any) -> Any:
    """CaRe's Reduction seen through the method contract (anchors, signals, where signals feed)."""
    import torch

    from care_core.methods import MethodResult

    anchors = reduction.indices
    n = reduction.psi_bar.shape[0]
    assignment = torch.full((n,), -1, dtype=torch.long, device=anchors.device)
    assignment[anchors] = torch.arange(anchors.numel(), device=anchors.device)
    assignment[reduction.signals] = torch.searchsorted(anchors, reduction.signal_targets)
    return MethodResult(
        tokens=reduction.tokens,
        token_index=anchors,
        scores=reduction.psi_bar,
        assignment=assignment,
        signals=reduction.signals,
        info={"selection_order": reduction.anchor_order, "residuals": reduction.residuals,
              "confidence": reduction.confidence},
    )  # fmt: skip


def run_reduce(
    picture: Any,
    *,
    ratio: float | None,
    keep: int | None,
    model: str | None,
    device: str,
    dtype: str,
    question: str | None,
    config: Any,
    method: str = "care",
    generate: bool = False,
    max_new_tokens: int = 32,
) -> dict[str, Any]:
    """Load the backbone, encode, reduce, project (and answer); returns tensors and a JSON-ready summary."""
    import torch

    from care_cli.commands.csr import configured_method
    from care_cli.versions import versions
    from care_core import care_reduce, csr_score, resolve_budget
    from care_core.backbones import load_backbone
    from care_core.methods import MethodInputs, canonical_name

    method = canonical_name(method)
    clock = render.StageClock()
    with render.stderr.status("Loading backbone (the demo is built on first use)…"), clock("load"):
        adapter = load_backbone(model, device=device, dtype=None if dtype == "auto" else dtype)
    clock.device = adapter.device
    with torch.no_grad():
        with clock("features"):
            tokens = adapter.encode_image(picture)
        n = tokens.num_tokens
        k = resolve_budget(n, ratio, keep)
        if method == "care":
            reduction = care_reduce(tokens.features, adapter.projector, tokens.positions, keep=k, config=config,
                                    stage_timer=clock)  # fmt: skip
            result = _care_result(reduction)
        else:
            runner = configured_method(method, config.seed)
            needs = sorted(set(runner.needs) - {"question"})
            adapter.check_probes(needs, method)
            with clock("probes"):
                probes = adapter.probe_inputs(tokens, needs, question=question) if needs else {}
            if "question" in runner.needs:
                probes["question"] = adapter.question_embeddings(question or "Describe the image.")
            inputs = MethodInputs(tokens.features, adapter.projector, tokens.positions, grid=tokens.grid,
                                  probes=probes, seed=config.seed)  # fmt: skip
            with clock("method"):
                result = runner(inputs, k)
        with clock("projection"):
            projected = adapter.projector(result.tokens.to(adapter.dtype))
        csr = None
        full = None
        if question is not None:
            with clock("csr"):
                full = adapter.projector(tokens.features)
                csr = 100 * csr_score(full, projected, adapter.question_embeddings(question))
        answers = None
        if generate:
            answers = _answers(adapter, tokens, question or "Describe the image.", full, projected, result,
                               max_new_tokens)  # fmt: skip
    timings = {name: round(value, 3) for name, value in clock.ms.items()}
    timings["total"] = round(sum(clock.ms.values()), 3)
    indices = result.indices
    residual = n - indices.numel()
    signals = [] if result.signals is None else result.signals.tolist()
    order = result.info.get("selection_order")
    summary: dict[str, Any] = {
        "command": "reduce",
        "method": method,
        "backbone": {
            "name": adapter.name,
            "family": adapter.family,
            "demo": adapter.is_demo,
            "note": render.DEMO_NOTE if adapter.is_demo else None,
            "device": str(adapter.device),
            "dtype": str(adapter.dtype).removeprefix("torch."),
        },
        "N": n,
        "K": k,
        "tokens_out": result.num_tokens,
        "kept_share": k / n,
        "grid": list(tokens.grid) if tokens.grid else None,
        "anchors": indices.tolist(),
        "anchor_order": order.tolist() if order is not None else indices.tolist(),
        "token_index": result.token_index.tolist(),
        "signals": signals,
        "num_signals": len(signals),
        "signal_share": len(signals) / residual if residual else 0.0,
        "question": question,
        "csr": csr,
        "answers": answers,
        "timings_ms": timings,
        "config": config.to_dict() if method == "care" else {"seed": config.seed},
        "versions": versions(),
    }
    return {"summary": summary, "result": result, "tokens": tokens, "projected": projected}


def _answers(
    adapter: Any, tokens: Any, question: str, full: Any, projected: Any, result: Any, max_new_tokens: int
) -> dict[str, Any]:
    """Greedy answers with all N visual tokens and with the K reduced ones; prefill and total time."""
    if full is None:
        full = adapter.projector(tokens.features)
    runs = {}
    for label, feed, kept in (("full", full, None), ("reduced", projected, result.token_index)):
        clock = render.StageClock(adapter.device)
        with clock("prefill"):
            adapter.language_model_logits(question, tokens, feed, kept=kept)
        with clock("total"):
            text = adapter.generate(question, tokens, feed, max_new_tokens=max_new_tokens, kept=kept)
        runs[label] = {
            "visual_tokens": adapter.visual_tokens_fed(tokens, int(feed.shape[0]), kept),
            "answer": text,
            "prefill_ms": round(clock.ms["prefill"], 3),
            "total_ms": round(clock.ms["total"], 3),
        }
    runs["question"] = question
    runs["max_new_tokens"] = max_new_tokens
    return runs


def write_reduction(path: Path, result: dict[str, Any]) -> None:
    """Atomically write the reduction as safetensors; config, backbone and versions go in the metadata."""
    from care_cli.io import save_safetensors_atomic

    res, tok, summary = result["result"], result["tokens"], result["summary"]
    tensors = {
        "calibrated_tokens": res.tokens,
        "projected_tokens": result["projected"],
        "anchors": res.indices,
        "anchor_order": res.info.get("selection_order", res.indices),
        "token_index": res.token_index,
        "signals": res.signals if res.signals is not None else res.indices.new_empty(0),
        "positions": tok.positions,
        "boxes": tok.boxes,
    }
    if res.scores is not None:
        tensors["psi_bar" if summary["method"] == "care" else "scores"] = res.scores
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
    n, k = summary["N"], summary["K"]
    residual = n - len(summary["anchors"])
    grid = summary["grid"]
    is_care = summary["method"] == "care"
    kept = f"K = {k}  ({100 * summary['kept_share']:.1f}% of N)"
    if summary["tokens_out"] != k:
        kept += f", {summary['tokens_out']} output rows"
    rows = [
        ("image", f"{summary['image']['path']}  ({summary['image']['width']}×{summary['image']['height']} px)"),
        ("backbone", f"{backbone['name']} ({backbone['family']}, {backbone['device']}, {backbone['dtype']})"),
        ("method", summary["method"]),
        ("visual tokens", f"N = {n}" + (f"  (grid {grid[0]}×{grid[1]})" if grid else "")),
        ("kept", kept),
        ("anchors" if is_care else "kept tokens", render.short_list(summary["anchors"])),
    ]
    if is_care or summary["num_signals"]:
        rows.append(("calibration signals", f"{summary['num_signals']} of {residual} residual tokens "
                                            f"({100 * summary['signal_share']:.1f}%)"))  # fmt: skip
    if is_care:
        config = summary["config"]
        rows.append(("engine", f"{config['engine']}, m = {config['m']}, seed = {config['seed']}"))
    if summary["csr"] is not None:
        rows.append(("CSR (×100)", f"{summary['csr']:.2f}  for “{summary['question']}”"))
    if summary.get("out"):
        rows.append(("saved", summary["out"]))
    title = f"care reduce — {summary['method']}"
    render.stdout.print(render.key_value_table(title, rows, caption=backbone["note"]))
    render.stdout.print(render.timings_table(summary["timings_ms"]))
    answers = summary.get("answers")
    if answers:
        from rich.table import Table

        table = Table(title=f"Answers to “{answers['question']}” (greedy, ≤ {answers['max_new_tokens']} tokens)",
                      title_justify="left", caption=backbone["note"], caption_style="bold yellow")  # fmt: skip
        for col in ("visual tokens fed", "prefill ms", "total ms", "answer"):
            table.add_column(col, justify="right" if col != "answer" else "left", overflow="fold")
        for label in ("full", "reduced"):
            run = answers[label]
            table.add_row(f"{run['visual_tokens']} ({label})", f"{run['prefill_ms']:,.1f}", f"{run['total_ms']:,.1f}",
                          repr(run["answer"]))  # fmt: skip
        render.stdout.print(table)
