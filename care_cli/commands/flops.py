"""`care flops`: analytic TFLOPs (paper Supp. B) with the counting convention stated, beside the paper's tables."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich import box

from care_cli import options as opt
from care_cli import render
from care_core._chunks import SecondLayer
from care_core.backbones.families import DEFAULT_DEMO, demo_backbones, family_names
from care_core.config import CaReConfig, Engine
from care_core.flops.formulas import Convention

_COUNT = "What is counted"
DEFAULT_FAMILY = demo_backbones()[DEFAULT_DEMO].family  # the default demo's family, as everywhere
_PAPER = "Paper comparison"
# rich's SIMPLE_HEAD with a dotted rule between sections (SIMPLE_HEAD's own is blank and reads as an empty row)
_SECTIONED = box.Box("    \n    \n ── \n    \n ┈┈ \n    \n    \n    \n")


Backbone = Annotated[
    str,
    typer.Option(
        "--backbone", "-b",
        help=f"A backbone family ({', '.join(family_names())}: its 7B model), a full name such as llava-1.5-13b "
        "or qwen2.5-vl-3b, or a local config.json / model folder.",
    ),
]  # fmt: skip
Tokens = Annotated[int | None, typer.Option("--tokens", "-n", help="N, the visual tokens before reduction.")]
ImageSize = Annotated[
    str | None,
    typer.Option("--image-size", help="HEIGHTxWIDTH in pixels: N as the backbone's processor counts it."),
]
Keeps = Annotated[
    list[int] | None, typer.Option("--keep", "-k", help="Visual tokens kept, K (repeatable). Default: the paper's.")
]
Ratios = Annotated[
    list[float] | None,
    typer.Option("--ratio", "-r", help="Fraction kept, in (0, 1]: K = max(1, floor(ratio N)) (repeatable)."),
]
Methods = Annotated[
    list[str] | None,
    typer.Option(
        "--method",
        help="Method with a cost model (repeatable; default care; 'all' for every one that runs on the backbone).",
    ),
]
TextTokens = Annotated[int, typer.Option("--text-tokens", "-t", help="T, the text tokens in the prefill.")]
ConventionOpt = Annotated[
    Convention,
    typer.Option("--convention", help="flops (1 multiply-add = 2) or macs (every figure halved).",
                 rich_help_panel=_COUNT),
]  # fmt: skip
EngineOpt = Annotated[
    Engine,
    typer.Option("--engine", help="PRCA's response engine whose work is counted: jvp (exact derivative, what care "
                 "reduce runs by default) or fd (Eq. 1 literally: Supp. B's 2mF_M(N)).",
                 rich_help_panel=_COUNT),
]  # fmt: skip
SecondLayerOpt = Annotated[
    SecondLayer,
    typer.Option("--second-layer", help="How the jvp engine applies the projector's second layer: dense (the "
                 "functional core, the CPU) or triangular (through W2's QR factor R, triangular or, where d_out < d_h, "
                 "trapezoidal: what the pipeline's Scorer runs on CUDA).", rich_help_panel=_COUNT),
]  # fmt: skip
Gqa = Annotated[
    bool,
    typer.Option("--gqa", help="Count K/V projections and attention from the KV/query heads.", rich_help_panel=_COUNT),
]
LmHead = Annotated[
    bool, typer.Option("--lm-head", help="Add the logits of the last position (2 H V).", rich_help_panel=_COUNT)
]
VisionTower = Annotated[
    bool, typer.Option("--vision-tower", help="Add the vision tower (same for every method).", rich_help_panel=_COUNT)
]
Paper = Annotated[
    bool,
    typer.Option("--paper", help="Show the paper's Table S1 / Table 1 figures and the differences.",
                 rich_help_panel=_PAPER),
]  # fmt: skip


def flops(
    ctx: typer.Context,
    backbone: Backbone = DEFAULT_FAMILY,
    tokens: Tokens = None,
    image_size: ImageSize = None,
    keep: Keeps = None,
    ratio: Ratios = None,
    method: Methods = None,
    text_tokens: TextTokens = 64,
    convention: ConventionOpt = "flops",
    engine: EngineOpt = CaReConfig.engine,
    second_layer: SecondLayerOpt = "dense",
    gqa: Gqa = False,
    lm_head: LmHead = False,
    vision_tower: VisionTower = False,
    paper: Paper = False,
    json_output: opt.Json = False,
) -> None:
    """Analytic TFLOPs of the reduction and the prefill, term by term, with the counting convention stated."""
    from care_core.flops import FlopsOptions, flops_report, parse_image_size, resolve_backbone

    options = FlopsOptions(text_tokens=text_tokens, convention=convention, gqa=gqa, lm_head=lm_head,
                           vision_tower=vision_tower, engine=engine, second_layer=second_layer)  # fmt: skip
    image = parse_image_size(image_size) if image_size is not None else None
    spec = resolve_backbone(backbone)
    report = flops_report(spec, tokens=tokens, image=image, keeps=keep or [], ratios=ratio or [],
                          methods=method or ["care"], options=options, paper=paper)  # fmt: skip
    if json_output:
        render.print_json(report)
    else:
        flags = {param.name: max(param.opts, key=len) for param in ctx.command.params if param.opts}
        show_report(report, flags)


# ------------------------------------------------------------------------------------------------ rendering
def _fmt(value: float | None) -> str:
    if value is None:
        return "—"
    if value == 0:
        return "0"
    if abs(value) < 0.001:
        return f"{value:.1e}"
    return f"{value:,.3f}"


def _signed(value: float | None, suffix: str = "") -> str:
    return "—" if value is None else f"{value:+,.2f}{suffix}"


def _caption(report: dict[str, Any]) -> str:
    unit, conv = report["unit"], report["convention"]
    how = "1 multiply-add = 2 FLOPs" if conv == "flops" else "1 MAC = 2 FLOPs: every FLOPs figure halved"
    optional = report["options"]["optional_terms"]
    on = ", ".join(f"{name} ({text})" for name, text in optional.items()) or "none (lm_head, vision_tower off)"
    gqa = "GQA-aware K/V" if report["options"]["gqa"] else "K/V projections H×H (no GQA), as Supp. B"
    engine = report["options"]["engine"]
    scoring = ("PRCA responses as the jvp engine runs them (the default; --engine fd: Supp. B's 2mF_M(N))"
               if engine == "jvp" else "PRCA responses as Supp. B writes them, 2mF_M(N) (the fd engine)")  # fmt: skip
    if engine == "jvp":
        triangular = report["options"].get("second_layer") == "triangular"
        scoring += (
            "; second layer through its triangular factor R (trapezoidal if d_out < d_h), as a Scorer runs it on CUDA"
            if triangular
            else "; dense second layer (on CUDA the pipeline's Scorer runs --second-layer triangular)"
        )
    return (
        f"{unit} ({conv}: {how}); T = {report['text_tokens']} text tokens; {scoring}; O(·) terms taken with "
        f"constant 1; {gqa}; "
        f"full W² attention (no causal halving); optional terms on: {on}. "
        "avg tokens = visual tokens whose uniform prefill costs what the method's layer schedule costs."
    )


def _value(row: dict[str, Any], key: str, macs: bool) -> float:
    terms = row["terms_tmacs"] if macs else row["terms"]
    return terms.get(key, 0.0)


def _print(
    title: str,
    caption: str | None,
    headers: list[tuple[str, str]],
    rows: list[list[str]],
    styles: list[str | None] | None = None,
    sections: list[bool] | None = None,
) -> None:
    """A table whose figures are never cut: split into parts that repeat the row's keys where it is too wide.

    Kinds: ``text`` (the backbone: left out where every row holds the same one, which the title names), ``key``
    (the method), ``id`` (the tokens: a figure that identifies the row), ``num`` (a figure)."""
    keep = [i for i, (_, kind) in enumerate(headers) if kind != "text" or len({r[i] for r in rows}) > 1]
    columns = [render.Column(headers[i][0], "number" if headers[i][1] in ("id", "num") else "name",
                             key=headers[i][1] != "num", style="bold cyan" if headers[i][1] == "key" else None)
               for i in keep]  # fmt: skip
    render.print_table(title, columns, [[r[i] for i in keep] for r in rows], caption=caption, row_styles=styles,
                       sections=sections, box=_SECTIONED)  # fmt: skip


def _budget_sections(rows: list[dict[str, Any]]) -> list[bool] | None:
    """Where a rule goes between the rows of one budget (K) and the next; None where every budget has one row (a
    rule between single rows would only space them out)."""
    keys = [None if row["method"] == "baseline" else row["tokens"] for row in rows]
    starts = [key is not None and previous is not None and key != previous
              for previous, key in zip([None, *keys], keys, strict=False)]  # fmt: skip
    groups = sum(starts) + any(key is not None for key in keys)
    return starts if sum(key is not None for key in keys) > groups else None


def show_report(report: dict[str, Any], flags: dict[str, str] | None = None) -> None:
    """The report as tables; ``flags`` maps the library's parameter names to this command's flags."""
    macs = report["convention"] == "macs"
    unit = report["unit"]
    backbone = report["backbone"]
    paper = report["options"]["paper"]
    terms = ["score", "residual", "prefill", *report["options"]["optional_terms"]]
    headers = [("backbone", "text"), ("method", "key"), ("tokens", "id"), ("avg\ntokens", "num")]
    headers += [(f"{name.replace('_', ' ')}\n{unit}", "num") for name in terms] + [(f"total\n{unit}", "num")]
    if paper:
        headers += [("paper\nTFLOPs", "num"), ("ours − paper\nTFLOPs", "num"), ("ours − paper\n%", "num")]
    cells = []
    for row in report["rows"]:
        line = [row["backbone"], row["method"], str(row["tokens"]), f"{row['avg_tokens']:,.1f}"]
        line += [_fmt(_value(row, name, macs)) for name in terms]
        line.append(_fmt(row["tmacs"] if macs else row["tflops"]))
        if paper:
            line += [_fmt(row.get("paper_tflops")), _signed(row.get("paper_diff")),
                     _signed(row.get("paper_diff_pct"), "%")]  # fmt: skip
        cells.append(line)
    source = f" from {backbone['source']}" if backbone["name"].startswith("config:") else ""
    title = (f"Analytic {unit} — {backbone['display']}{source}: N = {report['N']} visual tokens, "
             f"T = {report['text_tokens']} text tokens")  # fmt: skip
    styles: list[str | None] = ["bold" if r["method"] == "baseline" else None for r in report["rows"]]
    _print(title, _caption(report), headers, cells, styles, _budget_sections(report["rows"]))
    out = render.stdout
    source = (flags or {}).get(backbone["tokens_source"], backbone["tokens_source"])  # "tokens" -> --tokens
    out.print(f"[dim]N: {backbone['tokens_note']} ({source}).[/dim]")
    for method, note in dict.fromkeys((r["method"], r["note"]) for r in report["rows"]):
        out.print(f"[dim]• {method}: {note}[/dim]")
    if paper:
        show_paper(report)


def show_paper(report: dict[str, Any]) -> None:
    out = render.stdout
    data = report["paper"]
    # The comparison first, the paper's reduction rate and our terms after it: at 80 columns the table is
    # printed in these two parts.
    headers = [("backbone", "text"), ("method", "key"), ("tokens", "id"), ("paper", "num"), ("ours", "num"),
               ("ours −\npaper", "num"), ("ours −\npaper %", "num"), ("reduction\nrate", "num"), ("score", "num"),
               ("residual", "num"), ("prefill", "num")]  # fmt: skip
    cells = [
        [row["backbone"], row["method"], str(row["tokens"]), f"{row['paper_tflops']:g}", _fmt(row["tflops"]),
         _signed(row["diff"]), _signed(row["diff_pct"], "%"), row["rate"], _fmt(row["terms"]["score"]),
         _fmt(row["terms"]["residual"]), _fmt(row["terms"]["prefill"])]
        for row in data["table_s1_vs_ours"]
    ]  # fmt: skip
    title = "Paper Table S1 (TFLOPs, as printed) beside ours (TFLOPs, these options, the paper's N)"
    _print(title, None, headers, cells)
    gaps = data["gap_analysis"]
    if gaps:
        out.print("[bold]Why the CaRe rows differ[/bold] (TFLOPs; m = 64 directions):")
        for gap in gaps:
            by_engine = gap["our_overhead_tflops_by_engine"]
            ratio = gap["paper_overhead_over_engine"]
            closest = ("both engines count the same here" if gap["closest_engine"] == "tie"
                       else f"closest: {gap['closest_engine']}")  # fmt: skip
            out.print(
                f"  {gap['backbone']} K={gap['tokens']}: paper {gap['paper_tflops']:g} − our prefill "
                f"{gap['our_prefill_tflops']:.2f} = {gap['paper_overhead_tflops']:.2f} overhead implied; CaRe's "
                f"overhead as the fd engine runs it (Supp. B) {by_engine['fd']:.2f} (implied / that = "
                f"{ratio['fd']:.2f}), as the jvp engine runs it {by_engine['jvp']:.2f} ({ratio['jvp']:.2f}); "
                f"{closest}; m·N·d_hidden·d_out = {gap['m_N_dhidden_dout_tera']:.2f} T multiply-adds "
                f"(implied / that = {gap['paper_overhead_over_hypothesis']:.2f})"
            )
        out.print(
            "  No engine's FLOPs match the paper's overhead. On LLaVA-NeXT it is the jvp engine's count in "
            "multiply-adds (its second-layer term m·N·d_hidden·d_out, implied / that ≈ 1.01–1.03), as if the "
            "exact derivative had been counted in MACs beside a prefill counted in FLOPs. We show the readings "
            "and adopt none."
        )
    elif data["matched_backbone"] is None:
        out.print("[dim]This backbone is not in the paper's tables; see Table S1 above for the paper's own.[/dim]")
    out.print(f"[dim]{data['note']}[/dim]")
