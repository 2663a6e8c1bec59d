"""The micro part: the card's matmul rates, every scoring engine / path, ``care_reduce`` end to end, and anchor
selection (Eq. 3) with the fused kernel and the PyTorch loop."""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from benchmarks.common import Clock, say
from benchmarks.gpu.context import M_DIRECTIONS
from care_core import CaReConfig, care_reduce
from care_core.anchors import diversity_greedy
from care_core.care import resolve_directions
from care_core.kernels.dispatch import Kernel
from care_core.precision import matmul_precision
from care_core.scoring import Scorer, influence_scores, perturbation_responses, robust_zscores


@dataclass
class Micro:
    """What every micro measurement needs: the clock, the repetitions and the card's matmul rates (TFLOP/s)."""

    clock: Clock
    reps: int
    rates: dict[str, float] = field(default_factory=dict)


# (engine, matmul, path, kernel: "torch" / "fused" / "auto", second layer: "dense" / "triangular", sketch rank)
VARIANTS: tuple[tuple[str, str, str, str, str, int], ...] = (
    # the definition, float32, and what "auto" dispatches to
    ("fd", "float32", "Eq. 1 literally (tf32 off)", "fused", "dense", 0),
    ("jvp", "float32", "PyTorch, fp32 matmuls", "torch", "dense", 0),
    ("jvp", "auto", "default dispatch (tf32 on CUDA)", "auto", "dense", 0),
    # the dense second layer in PyTorch chunks and in the fused kernel
    *(("jvp", m, path, kernel, "dense", 0) for m in ("tf32", "bf16")
      for path, kernel in (("PyTorch chunks (before #7)", "torch"), ("fused Triton kernel", "fused"))),
    # through W2's triangular factor
    ("jvp", "tf32", "triangular factor, fused kernel (Scorer default on CUDA)", "auto", "triangular", 0),
    ("jvp", "tf32", "triangular factor, cuBLAS column blocks", "torch", "triangular", 0),
    ("jvp", "bf16", "triangular factor, fused kernel", "auto", "triangular", 0),
    # experiment, not offered: a random sketch of the second layer
    *(("jvp", "bf16", f"sketch rank {rank} (experiment)", "fused", "dense", rank) for rank in (512, 1024)),
)  # fmt: skip
QUICK_VARIANTS = VARIANTS[:3]


@contextlib.contextmanager
def triton_disabled(disabled: bool) -> Iterator[None]:
    """CARE_DISABLE_TRITON=1 inside the block (the PyTorch paths), restored after it."""
    saved = os.environ.get("CARE_DISABLE_TRITON")
    if disabled:
        os.environ["CARE_DISABLE_TRITON"] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("CARE_DISABLE_TRITON", None)
        else:
            os.environ["CARE_DISABLE_TRITON"] = saved


def matmul_rates(device: torch.device, clock: Clock, size: int) -> dict[str, float]:
    """Dense matmul TFLOP/s at size^3 on random data: bf16, tf32, fp32."""
    out = {}
    for name, dtype, tf32 in (("bf16", torch.bfloat16, False), ("tf32", torch.float32, True),
                              ("fp32", torch.float32, False)):  # fmt: skip
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        with matmul_precision(allow_tf32=tf32):
            ms = clock.median(partial(torch.matmul, a, b), reps=10, warmup=3)
        out[name] = 2 * size**3 / (ms * 1e-3) / 1e12
    return out


def floor_ms(macs: int, rate_tflops: float) -> float:
    """The time of ``macs`` multiply-adds at a measured matmul rate (TFLOP/s, 2 FLOPs per multiply-add), in ms."""
    return 2 * macs / (rate_tflops * 1e12) * 1e3


def psi_and_anchors(responses: torch.Tensor, features: torch.Tensor, k: int, cfg: CaReConfig) -> set[int]:
    psi = influence_scores(robust_zscores(responses.double(), cfg.eps), cfg.lam, cfg.eps).float()
    with matmul_precision(allow_tf32=False):
        return set(diversity_greedy(psi, features.float(), k, cfg.eps).tolist())


def sketched(projector: Any, rank: int) -> torch.nn.Module:
    """Experiment (not offered by the core): the projector with its second layer replaced by R W2, R a seeded
    Gaussian sketch (rank, d_out); the jvp engine's norms through it are ||R J u||."""
    w2 = projector.linear_2.weight
    g = torch.Generator(device="cpu").manual_seed(0)
    r = (torch.randn(rank, w2.shape[0], generator=g, dtype=torch.float64) / rank**0.5).to(w2.device, w2.dtype)
    second = torch.nn.Linear(w2.shape[1], rank, bias=False, device=w2.device, dtype=w2.dtype)
    with matmul_precision(allow_tf32=False), torch.no_grad():
        second.weight.copy_(r @ w2)
    return torch.nn.Sequential(projector.linear_1, projector.act, second)


def _floor_for(row: dict[str, Any], macs: int, rates: dict[str, float]) -> None:
    """The jvp row's floor: ``macs`` multiply-adds at the rate of its matmul precision."""
    if row["engine"] != "jvp" or "ms" not in row:
        return
    rate = rates["fp32" if row["matmul"] == "float32" else "bf16" if row["matmul"] == "bf16" else "tf32"]
    row["floor_ms"] = floor_ms(macs, rate)
    row["x_floor"] = row["ms"] / row["floor_ms"]


def _variant_fn(variant: tuple[str, str, str, str, str, int], v: torch.Tensor, u: torch.Tensor,
                projector: Any, h: float) -> Any:  # fmt: skip
    """The call that computes this variant's responses (a Scorer for the triangular factor, else the function)."""
    engine, matmul, _, kernel_name, second_layer, rank = variant
    kernel: Kernel = "auto" if kernel_name == "fused" and not v.is_cuda else kernel_name  # type: ignore[assignment]
    if second_layer == "triangular":
        scorer = Scorer(projector, second_layer="triangular")
        return lambda: scorer.responses(v, u, h=h, matmul=matmul, kernel=kernel)
    target = sketched(projector, rank) if rank else projector
    return lambda: perturbation_responses(v, target, u, h=h, engine=engine, matmul=matmul, kernel=kernel)


def score_variant(variant: tuple[str, str, str, str, str, int], v: torch.Tensor, u: torch.Tensor,
                  projector: Any, reference: dict[str, Any], micro: Micro) -> dict[str, Any]:  # fmt: skip
    """One variant at one N: median time, floor, error against float64, anchors shared with float64's."""
    engine, matmul, path, kernel_name, _, rank = variant
    n, k = int(v.shape[0]), reference["K"]
    row: dict[str, Any] = {"N": n, "engine": "sketch" if rank else engine, "matmul": matmul, "path": path,
                           "kernel": kernel_name, "K_for_overlap": k}  # fmt: skip
    cfg = CaReConfig()
    try:
        with triton_disabled(kernel_name == "torch"):
            run = _variant_fn(variant, v, u, projector, cfg.h)
            out = run()
            row["ms"] = micro.clock.median(run, reps=micro.reps, warmup=2)
        ref = reference["responses"]
        row["max_rel_err_vs_fp64"] = ((out.double() - ref).abs().max() / ref.abs().max()).item()
        row["anchor_overlap"] = len(psi_and_anchors(out, v, k, cfg) & reference["anchors"]) / k
    except Exception as exc:  # keep going: one failing variant must not lose the rest
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
    w2 = projector.linear_2.weight
    _floor_for(row, M_DIRECTIONS * n * w2.shape[1] * (rank or w2.shape[0]), micro.rates)
    say(f"  scoring N={n} {engine}/{matmul} {path}: {row.get('ms', float('nan')):.2f} ms "
        f"{row.get('error', '')}")  # fmt: skip
    return row


def float64_reference(v: torch.Tensor, u: torch.Tensor, projector: Any, k: int) -> dict[str, Any]:
    """The float64 responses (PyTorch path) and their anchors at K = k: what every variant is compared with."""
    cfg = CaReConfig()
    projector64 = copy.deepcopy(projector).double()
    with triton_disabled(True):
        responses = perturbation_responses(v.double(), projector64, u.double(), h=cfg.h, engine="jvp")
    return {"K": k, "responses": responses, "anchors": psi_and_anchors(responses, v, k, cfg)}


def bench_scoring(features_by_n: dict[int, torch.Tensor], projector: Any, keep_by_n: dict[int, int],
                  micro: Micro, quick: bool) -> list[dict[str, Any]]:  # fmt: skip
    """Every scoring engine / path at each N (the first three with ``quick``), then the fused kernel alone."""
    cfg = CaReConfig()
    rows = []
    for n, feats in features_by_n.items():
        v = feats.float()
        u = resolve_directions(None, M_DIRECTIONS, v.shape[1], cfg.seed, v)
        reference = float64_reference(v, u, projector, keep_by_n[n])
        for variant in QUICK_VARIANTS if quick else VARIANTS:
            rows.append(score_variant(variant, v, u, projector, reference, micro))
        if v.is_cuda:
            rows += kernel_only(v, u, projector, micro)
    return rows


def kernel_only(v: torch.Tensor, u: torch.Tensor, projector: Any, micro: Micro) -> list[dict[str, Any]]:
    """The fused kernel on its own (slope and lifted directions precomputed), tf32 and bf16 (CUDA only)."""
    from care_core.kernels import jvp as kernels_jvp

    first, w2 = projector.linear_1, projector.linear_2.weight
    n, macs = int(v.shape[0]), M_DIRECTIONS * int(v.shape[0]) * w2.shape[1] * w2.shape[0]
    with matmul_precision(allow_tf32=True):
        pre = first(v)
        slope = torch.func.jvp(projector.act, (pre,), (torch.ones_like(pre),))[1]
        lifted = u @ first.weight.T
    rows = []
    for bf16 in (False, True):
        row: dict[str, Any] = {"N": n, "engine": "jvp", "matmul": "bf16" if bf16 else "tf32",
                               "path": "fused kernel only"}  # fmt: skip
        try:
            run = lambda bf16=bf16: kernels_jvp.jvp_norms(slope, lifted, w2, bf16=bf16)  # noqa: E731
            run()
            row["ms"] = micro.clock.median(run, reps=micro.reps, warmup=2)
            row["config"] = kernels_jvp.chosen_config(bf16)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        _floor_for(row, macs, micro.rates)
        rows.append(row)
    return rows


def bench_care_reduce(features_by_n: dict[int, torch.Tensor], positions_by_n: dict[int, torch.Tensor],
                      projector: Any, keep_by_n: dict[int, int],
                      micro: Micro) -> list[dict[str, Any]]:  # fmt: skip
    """The whole of ``care_reduce``: a plain call (no scorer: the one kept on the projector), and with a Scorer the
    caller owns, default (triangular on CUDA) and dense second layer, tf32 and bf16: time per call, its ratio to
    the exact derivative's floor, same anchors as dense?"""
    rows = []
    w2 = projector.linear_2.weight
    for n, feats in features_by_n.items():
        v, p, k = feats.float(), positions_by_n[n], keep_by_n[n]
        for precision in ("auto", "bf16"):
            cfg = CaReConfig(matmul_precision=precision)
            done: dict[str, Any] = {}
            for layer in ("plain", "auto", "dense"):
                scorer = None if layer == "plain" else Scorer(projector, second_layer=layer)
                label = "none (plain call)" if scorer is None else f"Scorer(second_layer={layer!r})"
                row: dict[str, Any] = {"N": n, "K": k, "matmul": "tf32" if precision == "auto" else precision,
                                       "scorer": label}  # fmt: skip
                try:
                    run = partial(care_reduce, v, projector, p, keep=k, config=cfg, scorer=scorer)
                    done[layer] = run()
                    row["ms"] = micro.clock.median(run, reps=max(micro.reps, 3), warmup=2)
                    rate = micro.rates["bf16" if precision == "bf16" else "tf32"]
                    row["floor_ms"] = floor_ms(M_DIRECTIONS * n * w2.shape[1] * w2.shape[0], rate)
                    row["x_floor"] = row["ms"] / row["floor_ms"]
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                rows.append(row)
            if len(done) == 3:  # the plain call and the default against the dense path: same anchors, signals?
                for offset, name in ((-3, "plain"), (-2, "auto")):
                    rows[offset]["same_anchors_as_dense"] = bool(torch.equal(done[name].indices, done["dense"].indices))
                    rows[offset]["same_signals_as_dense"] = bool(torch.equal(done[name].signals, done["dense"].signals))
                if "ms" in rows[-3] and "ms" in rows[-2]:
                    rows[-3]["x_scorer"] = rows[-3]["ms"] / rows[-2]["ms"]  # plain call against a caller's Scorer
        say(f"  care_reduce N={n} K={k}: " + ", ".join(f"{r.get('ms', float('nan')):.2f}" for r in rows[-6:]) + " ms")
    return rows


def _host_syncs(run: Any) -> int | str:
    """0 when ``run`` makes no host sync (CUDA's sync checker in "error" mode), else what it said."""
    torch.cuda.synchronize()
    try:
        torch.cuda.set_sync_debug_mode("error")
        run()
        return 0
    except RuntimeError as exc:
        return f">0 ({str(exc)[:80]})"
    finally:
        torch.cuda.set_sync_debug_mode(0)


def bench_anchors(features_by_n: dict[int, torch.Tensor], budgets: dict[int, tuple[int, ...]],
                  micro: Micro) -> list[dict[str, Any]]:  # fmt: skip
    """Eq. 3 with the fused kernel and with the PyTorch loop; CUDA's sync checker on during both."""
    rows = []
    for n, feats in features_by_n.items():
        v = feats.float()
        w = torch.rand(n, generator=torch.Generator(device="cpu").manual_seed(n)).to(v.device)
        for k in budgets[n]:
            row: dict[str, Any] = {"N": n, "K": k}
            orders = {}
            for name, disabled in (("fused", False), ("loop", True)):
                with triton_disabled(disabled), matmul_precision(allow_tf32=False):
                    run = partial(diversity_greedy, w, v, k, 1e-8)
                    orders[name] = run()
                    row[f"{name}_ms"] = micro.clock.median(run, reps=micro.reps, warmup=1)
                    if v.is_cuda:
                        row[f"{name}_host_syncs"] = _host_syncs(run)
            row["same_order"] = bool(torch.equal(orders["fused"].cpu(), orders["loop"].cpu()))
            row["shared_anchors"] = len(set(orders["fused"].tolist()) & set(orders["loop"].tolist())) / k
            rows.append(row)
            say(f"  anchors N={n} K={k}: fused {row['fused_ms']:.2f} ms, loop {row['loop_ms']:.2f} ms")
    return rows
