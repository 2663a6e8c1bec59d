"""`care reduce IMAGE`: run CaRe on one image, report K, anchors, signals and time per stage."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from care_cli import options as opt
from care_cli import render

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


def reduce(
    image: ImageArg,
    ratio: opt.Ratio = None,
    keep: opt.Keep = None,
    model: opt.Model = None,
    device: opt.Device = "auto",
    dtype: opt.Dtype = "auto",
    question: Question = None,
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
    """Reduce one image's visual tokens with CaRe and report what was kept and what it cost."""
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
    result = run_reduce(picture, ratio=ratio, keep=keep, model=model, device=device, dtype=dtype,
                        question=question, config=config)  # fmt: skip
    summary = result["summary"]
    summary["image"] = {"path": str(image), "height": picture.height, "width": picture.width}
    if out_path is not None:
        write_reduction(out_path, result)
        summary["out"] = str(out_path)
    if json_output:
        render.print_json(summary)
    else:
        show_summary(summary)


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
) -> dict[str, Any]:
    """Load the backbone, encode, reduce, project; returns tensors and a JSON-ready summary."""
    import torch

    from care_cli.versions import versions
    from care_core import care_reduce, csr_score, resolve_budget
    from care_core.backbones import load_backbone

    clock = render.StageClock()
    with render.stderr.status("Loading backbone (the demo is built on first use)…"), clock("load"):
        adapter = load_backbone(model, device=device, dtype=None if dtype == "auto" else dtype)
    clock.device = adapter.device
    with torch.no_grad():
        with clock("features"):
            tokens = adapter.encode_image(picture)
        n = tokens.num_tokens
        k = resolve_budget(n, ratio, keep)
        reduction = care_reduce(tokens.features, adapter.projector, tokens.positions, keep=k, config=config,
                                stage_timer=clock)  # fmt: skip
        with clock("projection"):
            projected = adapter.projector(reduction.tokens.to(adapter.dtype))
        csr = None
        if question is not None:
            with clock("csr"):
                full = adapter.projector(tokens.features)
                csr = 100 * csr_score(full, projected, adapter.question_embeddings(question))
    timings = {name: round(value, 3) for name, value in clock.ms.items()}
    timings["total"] = round(sum(clock.ms.values()), 3)
    residual = n - k
    signals = reduction.signals.tolist()
    summary: dict[str, Any] = {
        "command": "reduce",
        "method": "care",
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
        "kept_share": k / n,
        "grid": list(tokens.grid) if tokens.grid else None,
        "anchors": reduction.indices.tolist(),
        "anchor_order": reduction.anchor_order.tolist(),
        "signals": signals,
        "num_signals": len(signals),
        "signal_share": len(signals) / residual if residual else 0.0,
        "question": question,
        "csr": csr,
        "timings_ms": timings,
        "config": config.to_dict(),
        "versions": versions(),
    }
    return {"summary": summary, "reduction": reduction, "tokens": tokens, "projected": projected}


def write_reduction(path: Path, result: dict[str, Any]) -> None:
    """Atomically write the reduction as safetensors; config, backbone and versions go in the metadata."""
    from care_cli.io import save_safetensors_atomic

    red, tok, summary = result["reduction"], result["tokens"], result["summary"]
    tensors = {
        "calibrated_tokens": red.tokens,
        "projected_tokens": result["projected"],
        "anchors": red.indices,
        "anchor_order": red.anchor_order,
        "signals": red.signals,
        "signal_targets": red.signal_targets,
        "psi_bar": red.psi_bar,
        "residuals": red.residuals,
        "residual_confidence": red.confidence,
        "positions": tok.positions,
        "boxes": tok.boxes,
    }
    metadata = {
        "format": "care.reduce/1",
        "method": "care",
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
    residual = n - k
    grid = summary["grid"]
    rows = [
        ("image", f"{summary['image']['path']}  ({summary['image']['width']}×{summary['image']['height']} px)"),
        ("backbone", f"{backbone['name']} ({backbone['family']}, {backbone['device']}, {backbone['dtype']})"),
        ("visual tokens", f"N = {n}" + (f"  (grid {grid[0]}×{grid[1]})" if grid else "")),
        ("kept", f"K = {k}  ({100 * summary['kept_share']:.1f}% of N)"),
        ("anchors", render.short_list(summary["anchors"])),
        ("calibration signals", f"{summary['num_signals']} of {residual} residual tokens "
                                f"({100 * summary['signal_share']:.1f}%)"),
        ("engine", f"{summary['config']['engine']}, m = {summary['config']['m']}, seed = {summary['config']['seed']}"),
    ]  # fmt: skip
    if summary["csr"] is not None:
        rows.append(("CSR (×100)", f"{summary['csr']:.2f}  for “{summary['question']}”"))
    if summary.get("out"):
        rows.append(("saved", summary["out"]))
    caption = backbone["note"]
    render.stdout.print(render.key_value_table("care reduce — CaRe", rows, caption=caption))
    render.stdout.print(render.timings_table(summary["timings_ms"]))
