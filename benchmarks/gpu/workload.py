"""The models part: per workload and budget K, CaRe's stages, every method's own time (probes included), the
projector, the first token (prefill) eager and from CUDA graphs, and peak memory.

The first token goes through the adapter's public ``generate`` with ``max_new_tokens=1``: eager is transformers'
``generate``; graphs replay ``care_core.backbones.static_generation.StaticGreedy`` (the adapter's, made on first
use), as a user's ``care reduce --generate`` runs them. Both include the adapter's host-side prompt building.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from benchmarks.common import free_device_memory, say
from benchmarks.gpu.context import NOT_ON_CPU, QUESTION, Workload
from benchmarks.gpu.scoring import Micro, triton_disabled
from care_core import CaReConfig, care_reduce
from care_core.methods import MethodInputs, build_method
from care_core.scoring import Scorer

STAGE_VARIANTS = (
    ("jvp (default: tf32, the Scorer's triangular factor, fused kernel)", CaReConfig(), False),
    ("jvp bf16 (fused)", CaReConfig(matmul_precision="bf16"), False),
    ("jvp tf32, PyTorch paths (triangular factor in cuBLAS column blocks)", CaReConfig(), True),
    ("fd (float32, tf32 off)", CaReConfig(engine="fd"), False),
)


def peak_gib(device: torch.device, fn: Any) -> float | None:
    """Peak GPU memory (GiB) while ``fn`` runs; None on the CPU."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(device) / 2**30


def care_stages(w: Workload, scorer: Scorer, micro: Micro, budgets: tuple[int, ...]) -> list[dict[str, Any]]:
    """CaRe's stages through ``care_reduce`` at each K (fd at the smallest K only: its scoring ignores K)."""
    rows = []
    tokens, projector = w.tokens, w.adapter.projector
    for k in budgets:
        for label, cfg, no_triton in STAGE_VARIANTS:
            if label.startswith("fd") and k != budgets[-1]:
                continue

            def run(timer: Any, k: int = k, cfg: CaReConfig = cfg) -> Any:
                return care_reduce(tokens.features, projector, tokens.positions, keep=k, config=cfg,
                                   stage_timer=timer, scorer=scorer)  # fmt: skip

            with triton_disabled(no_triton):
                stats = micro.clock.median_stages(run, reps=2 if label.startswith("fd") else micro.reps)
            rows.append({"K": k, "variant": label, **{f"{s}_ms": v for s, v in stats.items()}})
        say(f"  [{w.name}] care_reduce stages at K={k} done")
    return rows


class FirstToken:
    """The first token of the answer for given visual rows, eager and from graphs; cached by the rows fed."""

    def __init__(self, w: Workload, micro: Micro, graphs: bool) -> None:
        self.w, self.micro, self.graphs = w, micro, graphs
        self.cache: dict[int, dict[str, Any]] = {}

    def call(self, rows: torch.Tensor, kept: torch.Tensor | None, graph: bool) -> Any:
        return lambda: self.w.adapter.generate(QUESTION, self.w.tokens, rows, max_new_tokens=1, kept=kept,
                                               cuda_graph=graph)  # fmt: skip

    def times(self, rows: torch.Tensor, kept: torch.Tensor | None) -> dict[str, Any]:
        fed = self.w.adapter.visual_tokens_fed(self.w.tokens, int(rows.shape[0]), kept)
        if fed in self.cache:
            return self.cache[fed]
        entry: dict[str, Any] = {"visual_rows": fed}
        eager = self.call(rows, kept, False)
        samples = [self.micro.clock.once(eager) for _ in range(self.micro.reps + 2)][1:]
        entry.update(eager_ms=statistics.median(samples), eager_min_ms=min(samples))
        if not self.graphs:
            entry["graph_note"] = NOT_ON_CPU if self.w.adapter.device.type == "cpu" else "CUDA graphs: off"
        else:
            try:
                graph = self.call(rows, kept, True)
                entry["graph_ms"] = self.micro.clock.median(graph, reps=self.micro.reps, warmup=2)
                entry["graph_token_matches_eager"] = graph() == eager()
            except Exception as exc:
                entry["graph_note"] = f"{type(exc).__name__}: {exc}"[:300]
        say(f"  [{self.w.name}] first token, {fed} visual rows: eager {entry['eager_ms']:.2f} ms, "
            f"graph {entry.get('graph_ms', float('nan')):.2f} ms")  # fmt: skip
        self.cache[fed] = entry
        return entry


def method_row(w: Workload, name: str, k: int, scorer: Scorer, first: FirstToken) -> dict[str, Any]:
    """One method at K: its own time (probes included), the projector on its rows, the first token, peak memory."""
    adapter, tokens, projector, clock = w.adapter, w.tokens, w.adapter.projector, first.micro.clock
    method = build_method(name)
    needs = sorted(set(method.needs))

    def reduce() -> Any:
        probes = adapter.probe_inputs(tokens, needs, QUESTION) if needs else {}
        inputs = MethodInputs(features=tokens.features, projector=projector, positions=tokens.positions,
                              grid=tokens.grid, probes=probes, seed=0, scorer=scorer)  # fmt: skip
        with torch.no_grad():
            return method(inputs, k)

    row: dict[str, Any] = {"method": name, "K": k}
    result = reduce()
    row["reduce_ms"] = clock.median(reduce, reps=first.micro.reps)
    with torch.no_grad():
        rows = projector(result.tokens)
        row["projector_ms"] = clock.median(lambda: projector(result.tokens), reps=first.micro.reps)
    entry = first.times(rows, result.token_index.cpu())
    row.update(rows=entry["visual_rows"], prefill_eager_ms=entry["eager_ms"], prefill_graph_ms=entry.get("graph_ms"))
    row["peak_gib"] = peak_gib(adapter.device, lambda: (reduce(), first.call(rows, result.token_index.cpu(), False)()))
    return row


def add_speedups(rows: list[dict[str, Any]], tower_ms: float, resident_gib: float | None) -> None:
    """Per row: the method's own time + first token, TTFT with the tower, and speed-ups over all tokens."""
    for row in rows:
        if row.get("peak_gib") is not None and resident_gib is not None:
            row["peak_over_resident_gib"] = row["peak_gib"] - resident_gib
        if "prefill_eager_ms" not in row:
            continue
        own = row["reduce_ms"] + row["projector_ms"]
        for mode in ("eager", "graph"):
            if row.get(f"prefill_{mode}_ms") is not None:
                row[f"prefill_incl_reduction_{mode}_ms"] = own + row[f"prefill_{mode}_ms"]
                row[f"ttft_{mode}_ms"] = tower_ms + own + row[f"prefill_{mode}_ms"]
    full = rows[0]
    for row in rows[1:]:
        for mode in ("eager", "graph"):
            key = f"prefill_incl_reduction_{mode}_ms"
            if row.get(key) and full.get(f"prefill_{mode}_ms"):
                row[f"speedup_vs_full_{mode}"] = full[f"prefill_{mode}_ms"] / row[key]


def bench_workload(w: Workload, micro: Micro, methods: list[str], graphs: bool, quick: bool) -> dict[str, Any]:
    """Stages, first token and TTFT of every method at each budget K of one workload."""
    device = w.adapter.device
    budgets = w.budgets[-1:] if quick else w.budgets
    out: dict[str, Any] = {"workload": w.name, "N": w.tokens.num_tokens, "budgets": list(budgets), "notes": []}
    out["tower_ms"] = micro.clock.median(w.tower, reps=micro.reps)
    resident = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None
    out["resident_gib"] = resident
    scorer = Scorer(w.adapter.projector)  # as ReductionPipeline keeps one per projector
    out["care_stages"] = care_stages(w, scorer, micro, budgets)
    first = FirstToken(w, micro, graphs)
    features = w.tokens.features
    with torch.no_grad():
        all_rows = w.adapter.projector(features)
    base = first.times(all_rows, None)
    rows: list[dict[str, Any]] = [{
        "method": "none (all tokens)", "K": w.tokens.num_tokens, "rows": base["visual_rows"], "reduce_ms": 0.0,
        "projector_ms": micro.clock.median(lambda: w.adapter.projector(features), reps=micro.reps),
        "prefill_eager_ms": base["eager_ms"], "prefill_graph_ms": base.get("graph_ms"),
    }]  # fmt: skip
    for name in methods:
        if name in w.skip:
            out["notes"].append(f"{name} not run: {w.skip[name]}")
            continue
        for k in budgets:
            try:
                rows.append(method_row(w, name, k, scorer, first))
            except Exception as exc:
                rows.append({"method": name, "K": k, "error": f"{type(exc).__name__}: {exc}"[:300]})
        say(f"  [{w.name}] {name} done")
    add_speedups(rows, out["tower_ms"], resident)
    out["methods"] = rows
    out["prefill"] = list(first.cache.values())
    free_device_memory(device)
    return out
