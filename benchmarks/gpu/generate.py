"""The generate part: the user-facing path, ``ReductionPipeline.time_answers`` (what ``care reduce --generate``
runs) with CaRe at one K per backbone, decoding with transformers' ``generate`` and from CUDA graphs
(``StaticGreedy``); every figure is the pipeline's own Answer (medians of alternating rounds after warm-ups)."""

from __future__ import annotations

from typing import Any

from benchmarks.common import say
from benchmarks.gpu.context import NOT_ON_CPU, QUESTION, Workload

EAGER = "eager (transformers generate)"
GRAPHS = "cuda graphs (static cache)"  # the labels the committed results use


def answer_row(w: Workload, out: Any, label: str, keep: int, tower_ms: float, max_new_tokens: int) -> dict[str, Any]:
    """The figures of one pipeline output: first token from the features and whole answers, all tokens vs CaRe."""
    full, red = out.full_answer, out.runs[0].answer
    row: dict[str, Any] = {"workload": w.name, "decoding": label, "K": keep, "max_new_tokens": max_new_tokens}
    row.update(answer_decoding=[full.decoding, red.decoding], texts=[full.text, red.text])
    for side, answer in (("full", full), ("care", red)):
        row[f"{side}_visual_rows"] = answer.visual_tokens
        row[f"{side}_prefill_forward_ms"] = answer.prefill_ms
        row[f"{side}_first_token_ms"] = answer.first_token_ms
        row[f"{side}_first_token_from_features_ms"] = answer.first_token_from_features_ms
        row[f"{side}_ttft_incl_tower_ms"] = tower_ms + (answer.first_token_from_features_ms or float("nan"))
        row[f"{side}_total_ms"] = answer.total_ms
    row["speedup_first_token_incl_care"] = full.first_token_from_features_ms / red.first_token_from_features_ms
    row["speedup_ttft_incl_tower"] = row["full_ttft_incl_tower_ms"] / row["care_ttft_incl_tower_ms"]
    row["speedup_total"] = full.total_ms / red.total_ms
    return row


def bench_generate(
    w: Workload, tower_ms: float, keep: int, reps: int, max_new_tokens: int = 32
) -> list[dict[str, Any]]:
    """Eager and CUDA-graph decoding through the pipeline; on the CPU the graph row says why it did not run."""
    from care_core.budget import Budget
    from care_core.pipeline import ReductionPipeline

    pipe = ReductionPipeline(w.adapter, ["care"])
    rows: list[dict[str, Any]] = []
    for graphs, label in ((False, EAGER), (True, GRAPHS)):
        if graphs and w.adapter.device.type != "cuda":
            rows.append({"workload": w.name, "decoding": label, "K": keep, "note": NOT_ON_CPU})
            continue
        try:
            out = pipe(w.tokens, QUESTION, [Budget.keep(keep)], generate=True, max_new_tokens=max_new_tokens,
                       cuda_graph=graphs)  # fmt: skip
            out = pipe.time_answers(out, max_new_tokens=max_new_tokens, repeats=reps, cuda_graph=graphs)
        except Exception as exc:
            rows.append({"workload": w.name, "decoding": label, "K": keep, "note": f"{type(exc).__name__}: {exc}"})
            continue
        row = answer_row(w, out, label, keep, tower_ms, max_new_tokens)
        rows.append(row)
        say(f"  [{w.name}] generate, {label}: first token from features {row['full_first_token_from_features_ms']:.2f}"
            f" -> {row['care_first_token_from_features_ms']:.2f} ms")  # fmt: skip
    texts = [r["texts"] for r in rows if "texts" in r]
    if len(texts) == 2:
        for row in rows:
            row["answers_equal_eager_vs_graph"] = [texts[0][0] == texts[1][0], texts[0][1] == texts[1][1]]
    return rows
