"""docs/performance.md's "Performance on a GPU" tables, rendered from a ``python -m benchmarks.gpu`` result
(``--docs``): the scoring engines, anchor selection, CaRe's stages and ``care_reduce`` against its floor. Each
table is a block of its own whose footer names the result, its commit and the card's measured matmul rates."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import PERFORMANCE_DOC, commit_label, fail, replace_block
from benchmarks.gpu.report import care_reduce_bound
from benchmarks.gpu.workload import STAGE_VARIANTS

DOC_FILE = PERFORMANCE_DOC
#: the results ``python -m benchmarks.gpu`` writes (time-stamped names): where ``--docs`` looks for the newest
RESULT_NAME = re.compile(r"^\d{4}-\d{2}-\d{2}-\d{6}-gpu-[a-z0-9]+\.json$")

#: the scoring table's rows, in the docs' order: (engine, matmul, the result's path) -> the row's label
SCORING_ROWS: tuple[tuple[tuple[str, str, str], str], ...] = (
    (("fd", "float32", "Eq. 1 literally (tf32 off)"), "`fd`: Eq. 1 literally, float32, TF32 off"),
    (("jvp", "float32", "PyTorch, fp32 matmuls"), "`jvp` float32 (cuBLAS fp32)"),
    (("jvp", "tf32", "triangular factor, fused kernel (Scorer default on CUDA)"),
     "**`jvp` TF32, triangular factor, fused kernel** (a `Scorer`'s default on CUDA: what `care_reduce` runs)"),
    (("jvp", "tf32", "triangular factor, cuBLAS column blocks"),
     '`jvp` TF32, triangular factor, cuBLAS column blocks (`kernel="torch"`)'),
    (("jvp", "auto", "default dispatch (tf32 on CUDA)"),
     "`jvp` TF32, dense second layer (the functional `perturbation_responses`, no `Scorer`)"),
    (("jvp", "tf32", "fused Triton kernel"), '`jvp` TF32, dense, fused kernel (`kernel="fused"`)'),
    (("jvp", "bf16", "triangular factor, fused kernel"),
     '`jvp` bf16, triangular factor, fused kernel (`matmul_precision="bf16"`)'),
    (("jvp", "bf16", "fused Triton kernel"), "`jvp` bf16, dense, fused kernel"),
    (("sketch", "bf16", "sketch rank 512 (experiment)"), "sketch rank 512, bf16 (experiment, not offered)"),
    (("sketch", "bf16", "sketch rank 1024 (experiment)"), "sketch rank 1024, bf16 (experiment, not offered)"),
)  # fmt: skip

#: the stages table's label of each of CaRe's stage variants (in ``STAGE_VARIANTS``' order)
STAGE_LABELS = dict(zip((variant[0] for variant in STAGE_VARIANTS),
                        ("default (TF32, triangular factor, fused kernels)", "bf16", "PyTorch paths", "engine `fd`"),
                        strict=True))  # fmt: skip


def _ms(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f} ms"


def _pair(values: Sequence[float | None], form: str) -> str:
    return " / ".join("—" if v is None else format(v, form) for v in values)


def scoring_table(results: dict[str, Any]) -> list[str]:
    """Every scoring path at each N: its time, the floor and its multiple at the largest N, the error against float64
    and the anchors shared with float64's."""
    rows = [r for r in results["scoring"] if "ms" in r]
    sizes = sorted({r["N"] for r in rows})
    big = sizes[-1]
    lines = [f"| path (m = {results['m']}, d_h = d_out = 4096) | " + " | ".join(f"N = {n}" for n in sizes)
             + f" | floor at N = {big} | × floor | max rel. error vs float64 ({' / '.join(map(str, sizes))}) "
             f"| anchors shared with float64's (K = {' / '.join(map(str, _overlap_budgets(rows, sizes)))}) |",
             "| --- |" + " ---: |" * (len(sizes) + 4)]  # fmt: skip
    for key, label in SCORING_ROWS:
        found = {r["N"]: r for r in rows if (r["engine"], r["matmul"], r["path"]) == key}
        if not found:
            continue
        last = found.get(big, {})
        errors = [found.get(n, {}).get("max_rel_err_vs_fp64") for n in sizes]
        shared = [found.get(n, {}).get("anchor_overlap") for n in sizes]
        x_floor = last.get("x_floor")
        lines.append(f"| {label} | " + " | ".join(_ms(found.get(n, {}).get("ms")) for n in sizes)
                     + f" | {_ms(last.get('floor_ms'))} | {'—' if x_floor is None else f'{x_floor:.2f}'} "
                     f"| {_pair(errors, '.1e')} | {_pair(shared, '.3f')} |")  # fmt: skip
    return lines


def _overlap_budgets(rows: list[dict[str, Any]], sizes: list[int]) -> list[int]:
    """The K each N's anchors were compared at."""
    return [next((r["K_for_overlap"] for r in rows if r["N"] == n and r.get("K_for_overlap")), 0) for n in sizes]


def anchors_table(results: dict[str, Any]) -> list[str]:
    """Eq. 3's greedy: the fused kernel against the PyTorch loop, their host syncs and the anchors they share."""
    lines = ["| N | K | fused kernel | PyTorch loop | host syncs (fused / loop) | anchors shared |",
             "| ---: | ---: | ---: | ---: | --- | ---: |"]  # fmt: skip
    for r in results["anchors"]:
        order = "" if r.get("same_order", True) else " (same set, order differs)"
        lines.append(f"| {r['N']} | {r['K']} | {_ms(r.get('fused_ms'))} | {_ms(r.get('loop_ms'), 1)} "
                     f"| {r.get('fused_host_syncs', '—')} / {r.get('loop_host_syncs', '—')} "
                     f"| {r.get('shared_anchors', 0.0):.3f}{order} |")  # fmt: skip
    return lines


def stages_table(results: dict[str, Any]) -> list[str]:
    """CaRe's stages (CUDA-event spans inside one ``care_reduce``) per backbone at its smallest K, every variant."""
    lines = ["| backbone | K | variant | scoring | anchors | calibration | `care_reduce` total |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for w in results["workloads"]:
        k = min(r["K"] for r in w["care_stages"])
        for r in (r for r in w["care_stages"] if r["K"] == k):
            label = STAGE_LABELS.get(r["variant"], r["variant"])
            lines.append(f"| {w['workload']} | {k} | {label} | {r['scoring_ms']:.1f} | {r['anchors_ms']:.2f} "
                         f"| {r['calibration_ms']:.1f} | {r['total_ms']:.1f} |")  # fmt: skip
    return lines


def care_reduce_table(results: dict[str, Any]) -> list[str]:
    """``care_reduce`` as a plain call, with a caller's Scorer and with a dense second layer, against its floor."""
    lines = ["| N | K | matmuls | plain call | caller's `Scorer` | plain ÷ `Scorer` | dense second layer | floor "
             "| `Scorer` × floor | target | same anchors / signals as dense |",
             "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]  # fmt: skip
    rows = results["care_reduce"]
    for n, k, matmul in dict.fromkeys((r["N"], r["K"], r["matmul"]) for r in rows):
        plain, own, dense = (_scorer_row(rows, (n, k, matmul), kind) for kind in ("plain", "auto", "dense"))
        x = own.get("x_floor")
        tf32 = matmul == "tf32"
        x_cell = "—" if x is None else (f"**{x:.2f}**" if tf32 else f"{x:.2f}")
        target = f"≤ {care_reduce_bound(n)}" if tf32 else ""
        same = f"{_yes(own.get('same_anchors_as_dense'))} / {_yes(own.get('same_signals_as_dense'))}"
        ratio = plain.get("x_scorer")
        lines.append(f"| {n} | {k} | {'TF32 (default)' if tf32 else matmul} | {_ms(plain.get('ms'))} "
                     f"| {_ms(own.get('ms'))} | {'—' if ratio is None else f'{ratio:.2f}'} | {_ms(dense.get('ms'))} "
                     f"| {_ms(own.get('floor_ms'))} | {x_cell} | {target} | {same} |")  # fmt: skip
    return lines


def _scorer_row(rows: list[dict[str, Any]], setting: tuple[int, int, str], kind: str) -> dict[str, Any]:
    """The row of ``setting`` (N, K, matmul) whose scorer is ``kind``: "plain" (no Scorer), or the second layer of
    the caller's Scorer ("auto", "dense")."""
    for r in rows:
        plain = r["scorer"].startswith("none")
        if (r["N"], r["K"], r["matmul"]) == setting and (plain if kind == "plain" else f"'{kind}'" in r["scorer"]):
            return r
    return {}


def _yes(value: object) -> str:
    return "—" if value is None else ("yes" if value else "no")


@dataclass(frozen=True)
class Block:
    """One rendered table of the docs: its marker name, the result keys it needs and its renderer."""

    name: str
    needs: tuple[str, ...]
    render: Callable[[dict[str, Any]], list[str]]

    @property
    def markers(self) -> tuple[str, str]:
        return f"<!-- {self.name}:begin (python -m benchmarks.gpu --docs) -->", f"<!-- {self.name}:end -->"


BLOCKS = (
    Block("gpu-scoring", ("scoring",), scoring_table),
    Block("gpu-anchors", ("anchors",), anchors_table),
    Block("gpu-stages", ("workloads",), stages_table),
    Block("gpu-care-reduce", ("care_reduce",), care_reduce_table),
)


def footer(results: dict[str, Any], name: str) -> str:
    """The card, its versions and measured matmul rates, and the result with its commit."""
    env, rates = results["environment"], results.get("matmul_tflops", {})
    size = results.get("matmul_size", 8192)
    measured = ", ".join(f"{kind} {rate:.0f}" for kind, rate in rates.items())
    commit = commit_label(results["source"]) if "source" in results else "not recorded (a result from before the " \
        "benchmark recorded its commit)"  # fmt: skip
    return (f"One {env.get('card', '?')}, torch {env.get('torch', '?')}, Triton {env.get('triton', '?')}; dense "
            f"matmuls ({size}³) at {measured} TFLOP/s. Source: `benchmarks/results/{name}` "
            f"(`python -m benchmarks.gpu`, commit {commit}).")  # fmt: skip


def render(block: Block, results: dict[str, Any], name: str) -> str:
    """``block``'s text from the result ``results`` named ``name``."""
    return "\n".join([*block.render(results), "", footer(results, name)]) + "\n"


def newest_result(folder: Path) -> Path | None:
    """The newest full run (every block's data, its commit recorded, neither --quick nor --tiny), None where none."""
    for path in sorted((p for p in folder.glob("*-gpu-*.json") if RESULT_NAME.match(p.name)), reverse=True):
        results = json.loads(path.read_text(encoding="utf-8"))
        complete = all(key in results for block in BLOCKS for key in block.needs)
        if complete and "source" in results and not results.get("quick") and not results.get("tiny"):
            return path
    return None


def write_docs(root: Path, result: Path | None = None) -> list[str]:
    """Rewrite the blocks of :data:`DOC_FILE` that ``result`` (default: :func:`newest_result`) holds the data of;
    returns the names of those that changed."""
    path = result if result is not None else newest_result(root / "benchmarks" / "results")
    if path is None:
        raise fail("no full result of python -m benchmarks.gpu with its commit in benchmarks/results to render")
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise fail(f"cannot read {path}: {exc}") from None
    if results.get("tiny"):
        raise fail(f"{path.name} is a --tiny run: its timings are no card's")
    blocks = [block for block in BLOCKS if all(key in results for key in block.needs)]
    if not blocks:
        raise fail(f"{path.name} holds none of the tables' data (scoring, anchors, workloads, care_reduce)")
    return [block.name for block in blocks
            if replace_block(root / DOC_FILE, *block.markers, render(block, results, path.name))]  # fmt: skip
