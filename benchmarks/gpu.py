"""GPU benchmark of CaRe at real model scale: full-size LLaVA-1.5-7B / LLaVA-NeXT-7B shapes, random weights, bf16.

    python benchmarks/gpu.py                   # everything (about 4-6 minutes on one H100/H200)
    python benchmarks/gpu.py --only micro      # matmul rates, scoring engines, anchor selection
    python benchmarks/gpu.py --tiny --device cpu   # smoke test of the script itself (tiny widths)

What it measures (CUDA events, warm-ups, medians):
* the card's dense matmul rate (bf16, tf32, fp32 at 8192^3): the floors of the scoring step;
* scoring (Eq. 1 responses, m = 64) at N = 576 and 2880 with every engine / precision / code path,
  against the exact derivative's floor m N d_h d_out multiply-adds, with its error against float64
  and how many anchors it shares with the float64 scores' anchors;
* anchor selection (Eq. 3) with the fused kernel and with the PyTorch loop, with CUDA's sync checker on;
* CaRe's three stages through ``care_reduce`` (fd and jvp engines);
* per backbone and budget K: every registered method's own time (probes included), the projector, the
  prefill (eager, through the adapter; and replayed from a CUDA graph), time to first token, peak memory;
* the user-facing generate path (``ReductionPipeline(..., generate=True)``, CaRe at one K per backbone) with
  transformers' generate and with the adapters' CUDA-graph decoding: first token from the vision features
  and whole answers, all tokens against CaRe's.

Writes ``benchmarks/results/<date>-gpu-<card>.json`` (or ``--out``) with the card, versions and every figure.
Weights are random (timings don't depend on their values). LLaVA-NeXT-7B: when no LLaVA-NeXT adapter is
importable, its workload is built from the LLaVA-1.5-7B model (same CLIP-L/336 tower, projector and
Vicuna-7B language model): the tower runs on 5 crops (base view + 2x2 high-resolution grid of a 672x672
image), N = 2880 tokens in LLaVA-NeXT's packed order, and the unreduced prefill also gets the 48
``image_newline`` rows (2928 visual rows), as the real model would.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from care_core import CaReConfig, care_reduce  # noqa: E402
from care_core import scoring as scoring_module  # noqa: E402
from care_core.anchors import diversity_greedy  # noqa: E402
from care_core.care import resolve_directions  # noqa: E402
from care_core.kernels import Kernel  # noqa: E402
from care_core.methods import registry as method_registry  # noqa: E402
from care_core.methods.base import MethodInputs  # noqa: E402
from care_core.precision import matmul_precision  # noqa: E402
from care_core.scoring import (  # noqa: E402
    Scorer,
    _as_mlp,
    influence_scores,
    perturbation_responses,
    robust_zscores,
)

QUESTION = "What is in this image? Answer in a few words."
BUDGETS = {"llava-1.5-7b": (192, 128, 64), "llava-next-7b": (640, 320, 160)}
M_DIRECTIONS = 64


# ----------------------------------------------------------------------------------------- timing
class Clock:
    """Median wall time of GPU work with CUDA events (host perf_counter on the CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def once(self, fn: Callable[[], Any]) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end))
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    def median(self, fn: Callable[[], Any], reps: int = 5, warmup: int = 1, budget_ms: float = 4000.0) -> float:
        """Median of `reps` timed runs after `warmup` untimed ones; fewer reps when one run is slow."""
        first = None
        for _ in range(warmup):
            first = self.once(fn)
        if first is not None and first * reps > budget_ms:
            reps = max(1, int(budget_ms // max(first, 1e-3)))
        return statistics.median(self.once(fn) for _ in range(reps))

    @contextlib.contextmanager
    def stage_timer(self, sink: dict[str, float]) -> Iterator[Callable[[str], contextlib.AbstractContextManager]]:
        """A care_reduce stage_timer writing each stage's time (ms) into `sink` after the call."""
        events: dict[str, tuple[Any, Any]] = {}

        @contextlib.contextmanager
        def timer(name: str) -> Iterator[None]:
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                yield
                end.record()
                events[name] = (start, end)
            else:
                t = time.perf_counter()
                yield
                sink[name] = (time.perf_counter() - t) * 1e3

        yield timer
        self.sync()
        for name, (start, end) in events.items():
            sink[name] = float(start.elapsed_time(end))


def median_stages(clock: Clock, fn: Callable[[Callable], Any], reps: int) -> dict[str, float]:
    """Per-stage medians of `fn(stage_timer)` over reps (one warm-up)."""
    samples: dict[str, list[float]] = {}
    for rep in range(reps + 1):
        sink: dict[str, float] = {}
        with clock.stage_timer(sink) as timer:
            total = clock.once(lambda timer=timer: fn(timer))
        if rep == 0:
            continue
        sink["total"] = total
        for k, v in sink.items():
            samples.setdefault(k, []).append(v)
    return {k: statistics.median(v) for k, v in samples.items()}


# ----------------------------------------------------------------------------------------- environment
def environment(device: torch.device) -> dict[str, Any]:
    import transformers

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "device": str(device),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:
        env["triton"] = "not installed"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["card"] = props.name
        env["sm_count"] = props.multi_processor_count
        env["memory_gib"] = round(props.total_memory / 2**30, 1)
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20, check=False,
            )  # fmt: skip
            env["nvidia_smi"] = out.stdout.strip()
        except Exception:
            pass
    else:
        env["card"] = f"cpu ({platform.processor() or platform.machine()})"
    return env


def card_slug(card: str) -> str:
    words = re.sub(r"[^a-z0-9]+", "-", card.lower()).strip("-")
    for key in ("h200", "h100", "a100", "l40s", "l4", "b200", "gh200"):
        if key in words.split("-"):
            return key
    return words[:24] or "gpu"


def matmul_rates(device: torch.device, clock: Clock, size: int) -> dict[str, float]:
    """Dense matmul TFLOP/s at size^3 on random data: bf16, tf32, fp32."""
    out = {}
    flops = 2 * size**3
    for name, dtype, tf32 in (
        ("bf16", torch.bfloat16, False),
        ("tf32", torch.float32, True),
        ("fp32", torch.float32, False),
    ):
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        with matmul_precision(allow_tf32=tf32):
            ms = clock.median(lambda a=a, b=b: a @ b, reps=10, warmup=3)
        out[name] = flops / (ms * 1e-3) / 1e12
        del a, b
    return out


# ----------------------------------------------------------------------------------------- scoring
@contextlib.contextmanager
def triton_disabled(disabled: bool) -> Iterator[None]:
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


def psi_and_anchors(responses: torch.Tensor, features: torch.Tensor, k: int, cfg: CaReConfig) -> torch.Tensor:
    psi = influence_scores(robust_zscores(responses.double(), cfg.eps), cfg.lam, cfg.eps).float()
    with matmul_precision(allow_tf32=False):
        return diversity_greedy(psi, features.float(), k, cfg.eps)


_SKETCHED: dict[tuple[int, int], torch.Tensor] = {}


def sketch_responses(
    v: torch.Tensor, projector: torch.nn.Module, u: torch.Tensor, matmul: str, rank: int, kernel: Kernel = "fused"
) -> torch.Tensor:
    """Experiment (not offered by the core): ||R J u|| with a seeded Gaussian sketch R (rank, d_out), R W2 cached."""
    mlp = _as_mlp(projector)
    assert mlp is not None
    w2 = mlp.second.weight
    key = (id(w2), rank)
    if key not in _SKETCHED:
        g = torch.Generator(device="cpu").manual_seed(0)
        r = (torch.randn(rank, w2.shape[0], generator=g, dtype=torch.float64) / rank**0.5).to(w2.device, w2.dtype)
        with matmul_precision(allow_tf32=False):
            _SKETCHED[key] = r @ w2
    low = torch.bfloat16 if matmul == "bf16" else None
    with matmul_precision(allow_tf32=matmul == "tf32"), torch.no_grad():
        w2 = _SKETCHED[key]
        return scoring_module._jvp_mlp(v, mlp, u, low, tf32=matmul == "tf32", second_weight=w2, kernel=kernel)


def floor_ms(macs: int, rate_tflops: float) -> float:
    """The time of ``macs`` multiply-adds at a measured matmul rate (TFLOP/s, 2 FLOPs per multiply-add), in ms."""
    return 2 * macs / (rate_tflops * 1e12) * 1e3


def triangular_fraction(d_h: int, bf16: bool, torch_path: bool | None) -> float:
    """The share of the dense second layer's multiply-adds the triangular path ran: B = 4 column blocks on
    cuBLAS, one block per output tile (the autotuner's BN) in the fused kernel."""
    from care_core._chunks import TRIANGULAR_BLOCKS, triangular_macs

    if torch_path:
        return triangular_macs(d_h, TRIANGULAR_BLOCKS) / d_h**2
    from care_core.kernels import jvp as kernels_jvp

    found = re.search(r"BN: (\d+)", kernels_jvp.chosen_config(bf16, upper=True) or "")
    return triangular_macs(d_h, d_h // int(found.group(1))) / d_h**2 if found else float("nan")


def bench_scoring(
    features_by_n: dict[int, torch.Tensor],
    projector32: torch.nn.Module,
    rates: dict[str, float],
    clock: Clock,
    keep_by_n: dict[int, int],
    reps: int,
) -> list[dict[str, Any]]:
    """Every scoring engine / path at each N: time, floor, error vs float64, shared anchors."""
    cfg = CaReConfig()
    mlp = _as_mlp(projector32)
    assert mlp is not None
    d_h, d_out = mlp.second.weight.shape[1], mlp.second.weight.shape[0]
    projector64 = __import__("copy").deepcopy(projector32).double()
    rows = []
    for n, feats in features_by_n.items():
        v = feats.float()
        u = resolve_directions(None, M_DIRECTIONS, v.shape[1], cfg.seed, v)
        with triton_disabled(True):
            ref = perturbation_responses(v.double(), projector64, u.double(), h=cfg.h, engine="jvp")
        k = keep_by_n[n]
        ref_anchors = set(psi_and_anchors(ref, v, k, cfg).tolist())
        macs = M_DIRECTIONS * n * d_h * d_out
        variants = [
            ("fd", "float32", "Eq. 1 literally (tf32 off)", False, {}),
            ("jvp", "float32", "PyTorch, fp32 matmuls", True, {}),
            ("jvp", "auto", "default dispatch (tf32 on CUDA)", None, {}),
            ("jvp", "tf32", "PyTorch chunks (before #7)", True, {}),
            ("jvp", "tf32", "fused Triton kernel", False, {}),
            ("jvp", "bf16", "PyTorch chunks (before #7)", True, {}),
            ("jvp", "bf16", "fused Triton kernel", False, {}),
            ("jvp", "tf32", "triangular factor, fused kernel (Scorer default on CUDA)", None, {"tri": True}),
            ("jvp", "tf32", "triangular factor, cuBLAS column blocks", True, {"tri": True}),
            ("jvp", "bf16", "triangular factor, fused kernel", None, {"tri": True}),
            ("sketch", "bf16", "sketch rank 512 (experiment)", False, {"sketch_rank": 512}),
            ("sketch", "bf16", "sketch rank 1024 (experiment)", False, {"sketch_rank": 1024}),
        ]
        for engine, matmul, path, no_triton, extra in variants:
            row: dict[str, Any] = {"N": n, "engine": engine, "matmul": matmul, "path": path, "K_for_overlap": k}
            # this row's kernel setting: "fused" forces the fused kernel on CUDA (a CareError if it cannot run)
            kernel: Kernel = "torch" if no_triton else "fused" if no_triton is False and v.is_cuda else "auto"
            row["kernel"] = kernel
            try:
                with triton_disabled(bool(no_triton)):
                    tri = Scorer(projector32, second_layer="triangular") if extra.get("tri") else None

                    def run(
                        engine=engine, matmul=matmul, extra=extra, v=v, u=u, kernel=kernel, tri=tri
                    ) -> torch.Tensor:
                        if engine == "sketch":
                            return sketch_responses(v, projector32, u, matmul, extra["sketch_rank"], kernel)
                        if tri is not None:
                            return tri.responses(v, u, h=cfg.h, matmul=matmul, kernel=kernel)
                        return perturbation_responses(
                            v, projector32, u, h=cfg.h, engine=engine, matmul=matmul, kernel=kernel
                        )

                    out = run()
                    row["ms"] = clock.median(run, reps=reps, warmup=2)
                err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
                row["max_rel_err_vs_fp64"] = err
                anchors = set(psi_and_anchors(out, v, k, cfg).tolist())
                row["anchor_overlap"] = len(anchors & ref_anchors) / k
                if engine == "jvp" and matmul in ("tf32", "bf16", "auto"):
                    rate = rates["bf16" if matmul == "bf16" else "tf32"]
                    row["floor_ms"] = floor_ms(macs, rate)
                    row["x_floor"] = row["ms"] / row["floor_ms"]
                    if extra.get("tri"):
                        row["second_layer_macs_fraction"] = triangular_fraction(d_h, matmul == "bf16", no_triton)
                elif engine == "sketch":
                    rate = rates["bf16" if matmul == "bf16" else "tf32"]
                    r = extra["sketch_rank"]
                    row["floor_ms"] = floor_ms(M_DIRECTIONS * n * d_h * r, rate)
                    row["x_floor"] = row["ms"] / row["floor_ms"]
                elif engine == "jvp":
                    row["floor_ms"] = floor_ms(macs, rates["fp32"])
                    row["x_floor"] = row["ms"] / row["floor_ms"]
            except Exception as exc:  # keep going: one failing variant must not lose the rest
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
            print(f"  scoring N={n} {engine}/{matmul} {path}: {row.get('ms', float('nan')):.2f} ms "
                  f"err={row.get('max_rel_err_vs_fp64', float('nan')):.1e} "
                  f"overlap={row.get('anchor_overlap', float('nan')):.3f} {row.get('error', '')}",
                  flush=True)  # fmt: skip
        # the kernel on its own (slope and lifted directions precomputed), with the autotuner's timings
        if v.is_cuda:
            try:
                from care_core.kernels import jvp as kernels_jvp

                with matmul_precision(allow_tf32=True):
                    pre = mlp.first(v)
                    slope = torch.func.jvp(mlp.act, (pre,), (torch.ones_like(pre),))[1]
                    lifted = u @ mlp.first.weight.T
                for bf16 in (False, True):

                    def kern(bf16=bf16, slope=slope, lifted=lifted) -> torch.Tensor:
                        return kernels_jvp.jvp_norms(slope, lifted, mlp.second.weight, bf16=bf16)

                    kern()
                    ms = clock.median(kern, reps=reps, warmup=2)
                    rate = rates["bf16" if bf16 else "tf32"]
                    floor = floor_ms(macs, rate)
                    tuner = kernels_jvp._kernel_bf16 if bf16 else kernels_jvp._kernel_tf32
                    timings = {str(c): t for c, t in (getattr(tuner, "configs_timings", None) or {}).items()}
                    rows.append({
                        "N": n, "engine": "jvp", "matmul": "bf16" if bf16 else "tf32", "path": "fused kernel only",
                        "ms": ms, "floor_ms": floor, "x_floor": ms / floor,
                        "config": kernels_jvp.chosen_config(bf16), "autotune_ms": timings,
                    })  # fmt: skip
                    print(f"  kernel N={n} bf16={bf16}: {ms:.2f} ms ({ms / floor:.2f}x floor) "
                          f"{kernels_jvp.chosen_config(bf16)}", flush=True)  # fmt: skip
                    for c, t in timings.items():
                        print(f"      autotune {c}: {t}", flush=True)
            except Exception as exc:
                rows.append({"N": n, "path": "fused kernel only", "error": f"{type(exc).__name__}: {exc}"[:300]})
                traceback.print_exc()
    return rows


def bench_care_reduce(
    features_by_n: dict[int, torch.Tensor],
    positions_by_n: dict[int, torch.Tensor],
    projector32: torch.nn.Module,
    rates: dict[str, float],
    clock: Clock,
    keep_by_n: dict[int, int],
    reps: int,
) -> list[dict[str, Any]]:
    """The whole of ``care_reduce`` (scoring, anchors, calibration) as a caller runs it with a Scorer it owns:
    wall time per call (CUDA events around the call) and its ratio to the floor of the exact derivative at the
    chosen matmul precision (m·N·d_h·d_out multiply-adds at the card's measured rate)."""
    mlp = _as_mlp(projector32)
    assert mlp is not None
    d_h, d_out = mlp.second.weight.shape[1], mlp.second.weight.shape[0]
    rows = []
    for n, feats in features_by_n.items():
        v, p = feats.float(), positions_by_n[n]
        k = keep_by_n[n]
        for precision in ("auto", "bf16"):
            cfg = CaReConfig(matmul_precision=precision)
            results: dict[str, Any] = {}
            for layer in ("auto", "dense"):
                scorer = Scorer(projector32, second_layer=layer)
                row: dict[str, Any] = {"N": n, "K": k, "matmul": "tf32" if precision == "auto" else precision,
                                       "scorer": f"Scorer(second_layer={layer!r})" + (
                                           " (the default: triangular factor on CUDA)" if layer == "auto" else
                                           " (the dense second layer, as before)")}  # fmt: skip
                try:

                    def run(cfg=cfg, scorer=scorer, v=v, p=p, k=k) -> Any:
                        return care_reduce(v, projector32, p, keep=k, config=cfg, scorer=scorer)

                    results[layer] = run()
                    row["ms"] = clock.median(run, reps=max(reps, 10), warmup=3)
                    rate = rates["bf16" if precision == "bf16" else "tf32"]
                    row["floor_ms"] = floor_ms(M_DIRECTIONS * n * d_h * d_out, rate)
                    row["x_floor"] = row["ms"] / row["floor_ms"]
                    if layer == "auto" and v.is_cuda:
                        row["second_layer_macs_fraction"] = triangular_fraction(d_h, precision == "bf16", False)
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                rows.append(row)
                print(f"  care_reduce N={n} K={k} {row['matmul']} {layer}: {row.get('ms', float('nan')):.2f} ms, "
                      f"floor {row.get('floor_ms', float('nan')):.2f} ms ({row.get('x_floor', float('nan')):.2f}x) "
                      f"{row.get('error', '')}", flush=True)  # fmt: skip
            if len(results) == 2:  # the default against the dense path: same anchors, same signals?
                a, b = results["auto"], results["dense"]
                rows[-2]["same_anchors_as_dense"] = bool(torch.equal(a.indices, b.indices))
                rows[-2]["same_signals_as_dense"] = bool(torch.equal(a.signals, b.signals))
                rows[-2]["psi_bar_max_abs_diff_vs_dense"] = float((a.psi_bar - b.psi_bar).abs().max())
    return rows


def bench_anchors(features_by_n: dict[int, torch.Tensor], clock: Clock, budgets: dict[int, tuple[int, ...]],
                  reps: int) -> list[dict[str, Any]]:  # fmt: skip
    """Eq. 3 with the fused kernel and with the PyTorch loop; CUDA's sync checker on during both."""
    rows = []
    for n, feats in features_by_n.items():
        v = feats.float()
        g = torch.Generator(device="cpu").manual_seed(n)
        w = torch.rand(n, generator=g).to(v.device)
        for k in budgets[n]:
            row: dict[str, Any] = {"N": n, "K": k}
            orders = {}
            for name, disabled in (("fused", False), ("loop", True)):
                with triton_disabled(disabled), matmul_precision(allow_tf32=False):

                    def run(k=k, w=w, v=v) -> torch.Tensor:
                        return diversity_greedy(w, v, k, 1e-8)

                    orders[name] = run()
                    row[f"{name}_ms"] = clock.median(run, reps=reps, warmup=1)
                    if v.is_cuda:
                        clock.sync()
                        try:
                            torch.cuda.set_sync_debug_mode("error")
                            run()
                            row[f"{name}_host_syncs"] = 0
                        except RuntimeError as exc:
                            row[f"{name}_host_syncs"] = f">0 ({str(exc)[:80]})"
                        finally:
                            torch.cuda.set_sync_debug_mode(0)
            row["same_order"] = bool(torch.equal(orders["fused"].cpu(), orders["loop"].cpu()))
            row["shared_anchors"] = len(set(orders["fused"].tolist()) & set(orders["loop"].tolist())) / k
            rows.append(row)
            print(f"  anchors N={n} K={k}: fused {row['fused_ms']:.2f} ms, loop {row['loop_ms']:.2f} ms, "
                  f"same={row['same_order']} shared={row['shared_anchors']:.3f} "
                  f"syncs={row.get('fused_host_syncs')}/{row.get('loop_host_syncs')}", flush=True)  # fmt: skip
    return rows


# ----------------------------------------------------------------------------------------- models
def _vicuna_parts(tok: Any, tiny: bool, max_positions: int) -> tuple[Any, Any]:
    """CLIP-L/336 (24 layers) and Vicuna-7B configs, or tiny widths for a smoke test."""
    from transformers import CLIPVisionConfig, LlamaConfig

    if tiny:
        vision = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4}
        text = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
                "num_key_value_heads": 4}  # fmt: skip
    else:
        vision = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16}
        text = {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
                "num_key_value_heads": 32}  # fmt: skip
    vision_config = CLIPVisionConfig(
        **vision, image_size=336, patch_size=14, projection_dim=768, hidden_act="quick_gelu"
    )
    text_config = LlamaConfig(
        vocab_size=32064, max_position_embeddings=max_positions, rms_norm_eps=1e-5,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **text,
    )  # fmt: skip
    return vision_config, text_config


def _random_model(model_cls: Any, config: Any, device: torch.device, dtype: torch.dtype, seed: int) -> Any:
    """The model built directly on `device` in `dtype` with seeded random weights, eval mode, no grads."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(seed)
        with torch.device(device):
            model = model_cls(config)
    finally:
        torch.set_default_dtype(saved)
    model = model.to(device=device).eval()
    model.requires_grad_(False)
    return model


def build_llava(device: torch.device, dtype: torch.dtype, tiny: bool) -> tuple[Any, Any]:
    """LLaVA-1.5-7B (CLIP-L/336 24 layers, 1024->4096->4096 GELU projector, Vicuna-7B), random weights."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from care_core.backbones.demo import LLAVA15_CHAT_TEMPLATE, build_byte_tokenizer

    tok = build_byte_tokenizer(["<image>"])
    vision_config, text_config = _vicuna_parts(tok, tiny, max_positions=4096)
    config = LlavaConfig(
        vision_config=vision_config, text_config=text_config,
        image_token_index=tok.convert_tokens_to_ids("<image>"), image_seq_length=576,
        vision_feature_layer=-2, vision_feature_select_strategy="default", projector_hidden_act="gelu",
    )  # fmt: skip
    model = _random_model(LlavaForConditionalGeneration, config, device, dtype, seed=0)
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}, do_center_crop=True
    )
    processor = LlavaProcessor(
        image_processor=image_processor, tokenizer=tok, patch_size=14, vision_feature_select_strategy="default",
        num_additional_image_tokens=1, chat_template=LLAVA15_CHAT_TEMPLATE,
    )  # fmt: skip
    return model, processor


def build_llava_next(device: torch.device, dtype: torch.dtype, tiny: bool) -> tuple[Any, Any]:
    """LLaVA-NeXT-7B (vicuna): the LLaVA-1.5-7B parts + anyres (default pinpoints), random weights."""
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    from care_core.backbones import demo

    tok = demo.build_byte_tokenizer(["<image>"])
    vision_config, text_config = _vicuna_parts(tok, tiny, max_positions=8192)
    config = LlavaNextConfig(
        vision_config=vision_config, text_config=text_config, image_token_index=tok.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-2, vision_feature_select_strategy="default", projector_hidden_act="gelu",
    )  # fmt: skip
    model = _random_model(LlavaNextForConditionalGeneration, config, device, dtype, seed=1)
    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336},
        image_grid_pinpoints=[list(p) for p in config.image_grid_pinpoints],
    )  # fmt: skip
    processor = LlavaNextProcessor(
        image_processor=image_processor, tokenizer=tok, patch_size=14, vision_feature_select_strategy="default",
        num_additional_image_tokens=1, chat_template=getattr(demo, "LLAVA_NEXT_CHAT_TEMPLATE", None),
    )  # fmt: skip
    return model, processor


def next_adapter_tower(adapter: Any, tokens: Any) -> Callable[[], torch.Tensor]:
    """The LLaVA-NeXT adapter's tower pass over its crops, packed (encode_image without the CPU preprocessing)."""
    inputs = tokens.model_inputs
    vt = adapter._vision_tower
    param = next(vt.parameters())
    crops = adapter._crops(inputs["pixel_values"], inputs["image_sizes"]).to(device=param.device, dtype=param.dtype)
    layer = adapter.model.config.vision_feature_layer
    crop_index = inputs["crop_index"].to(param.device)
    patch_index = inputs["patch_index"].to(param.device)

    def tower() -> torch.Tensor:
        with torch.no_grad():
            out = vt(pixel_values=crops, output_hidden_states=True, return_dict=True)
        return out.hidden_states[layer][:, 1:][crop_index, patch_index]

    return tower


def next_shaped_tokens(adapter: Any, image: Any) -> tuple[Any, Callable[[], torch.Tensor]]:
    """LLaVA-NeXT's 2880 tokens of a 672x672 image through the LLaVA-1.5 tower: base view + 2x2 crops.

    Returns (ImageTokens, tower) where tower() reruns the vision tower on the 5 crops (for timing).
    """
    from care_core.backbones.base import ImageTokens
    from care_core.backbones.geometry import grid_positions

    big = image.convert("RGB").resize((672, 672))
    crops = [big] + [big.crop((c * 336, r * 336, c * 336 + 336, r * 336 + 336)) for r in range(2) for c in range(2)]
    ip = adapter.processor.image_processor
    pixel_values = torch.cat([ip(images=c, return_tensors="pt")["pixel_values"] for c in crops])
    vt = adapter._vision_tower
    param = next(vt.parameters())
    pv = pixel_values.to(device=param.device, dtype=param.dtype)
    layer = adapter.model.config.vision_feature_layer

    def tower() -> torch.Tensor:
        with torch.no_grad():
            out = vt(pixel_values=pv, output_hidden_states=True, return_dict=True)
        feats = out.hidden_states[layer][:, 1:]  # (5, 576, d)
        d = feats.shape[-1]
        hires = feats[1:].reshape(2, 2, 24, 24, d).permute(0, 2, 1, 3, 4).reshape(48 * 48, d)
        return torch.cat([feats[0], hires])

    features = tower()
    positions = torch.cat([grid_positions(24, 24), grid_positions(48, 48)]).to(features.device, torch.float32)
    tokens = ImageTokens(
        features=features, positions=positions, boxes=torch.zeros(2880, 4), image_size=(672, 672),
        seen_box=(0.0, 0.0, 672.0, 672.0), grid=None, model_inputs={"pixel_values": pixel_values},
    )  # fmt: skip
    return tokens, tower


def llava15_tower(adapter: Any, tokens: Any) -> Callable[[], torch.Tensor]:
    vt = adapter._vision_tower
    param = next(vt.parameters())
    pv = tokens.model_inputs["pixel_values"].to(device=param.device, dtype=param.dtype)
    layer = adapter.model.config.vision_feature_layer

    def tower() -> torch.Tensor:
        with torch.no_grad():
            out = vt(pixel_values=pv, output_hidden_states=True, return_dict=True)
        return out.hidden_states[layer][0, 1:]

    return tower


# ----------------------------------------------------------------------------------------- prefill
class GraphPrefill:
    """The adapter's prompt with L visual rows, prefilled by the model's own modules inside one CUDA graph.

    Same computation as the eager path (embeddings with the visual rows scattered in, the 32 decoder
    layers with a causal mask, final norm, lm_head on the last position, argmax), captured once per
    sequence length and replayed: no per-kernel launch cost.
    """

    def __init__(self, adapter: Any, question: str, rows: int) -> None:
        model = adapter.model
        inner = model.model
        self.lm = inner.language_model
        self.head = model.lm_head
        enc = adapter._encode_prompt(question, rows)
        self.ids = enc["input_ids"]
        self.image_pos = torch.nonzero(self.ids[0] == adapter.image_token_id).flatten()
        self.length = int(self.ids.shape[1])
        hidden = self.head.weight.shape[1]
        dtype = self.head.weight.dtype
        self.rows = torch.zeros(rows, hidden, device=self.ids.device, dtype=dtype)
        self.position_ids = torch.arange(self.length, device=self.ids.device)[None]
        self.graph: Any = None
        self.out: torch.Tensor | None = None

    def forward(self) -> torch.Tensor:
        embeds = self.lm.embed_tokens(self.ids).index_copy(1, self.image_pos, self.rows[None])
        pe = self.lm.rotary_emb(embeds, position_ids=self.position_ids)
        h = embeds
        for layer in self.lm.layers:
            h = layer(h, attention_mask=None, position_embeddings=pe, position_ids=self.position_ids, use_cache=False)
            if isinstance(h, tuple):
                h = h[0]
        h = self.lm.norm(h[:, -1:])
        return self.head(h).argmax(-1)

    def capture(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(stream):
            for _ in range(2):
                self.forward()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(self.graph):
            self.out = self.forward()

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        self.rows.copy_(rows)
        if self.graph is None:
            with torch.no_grad():
                return self.forward()
        self.graph.replay()
        assert self.out is not None
        return self.out


def eager_prefill(adapter: Any, question: str, tokens: Any, rows: torch.Tensor, kept: torch.Tensor | None) -> Callable:
    """Prefill through the adapter's own model inputs (``mm_encoder_outputs``) and the HF forward, eager."""
    inputs = adapter._lm_inputs(question, tokens, rows, kept)
    model = adapter.model

    def run() -> torch.Tensor:
        with torch.no_grad():
            out = model(**inputs, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].argmax()

    return run


def next_newline_rows(projected: torch.Tensor, newline: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """All 2880 rows + one image_newline row after each of the 48 high-resolution rows (model's packing)."""
    base = projected[:576]
    hires = projected[576:].reshape(48, 48, -1)
    with_newline = torch.cat([hires, newline.expand(48, 1, -1)], dim=1).reshape(48 * 49, -1)
    idx = torch.arange(576, 2880).reshape(48, 48)
    kept_hr = torch.cat([idx, torch.full((48, 1), -1)], dim=1).reshape(-1)
    return torch.cat([base, with_newline]), torch.cat([torch.arange(576), kept_hr])


# ----------------------------------------------------------------------------------------- workloads
def peak_after(device: torch.device, fn: Callable[[], Any]) -> float:
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(device) / 2**30


def bench_workload(
    name: str,
    adapter: Any,
    tokens: Any,
    tower: Callable[[], torch.Tensor],
    clock: Clock,
    device: torch.device,
    reps: int,
    methods: list[str],
    graphs: bool,
    full_rows: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]],
) -> dict[str, Any]:
    """Stages, prefill and TTFT of every method at each budget K of workload `name`."""
    out: dict[str, Any] = {"workload": name, "N": tokens.num_tokens, "notes": []}
    n = tokens.num_tokens
    out["tower_ms"] = clock.median(tower, reps=reps)
    weights_gib = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    out["resident_gib"] = weights_gib  # both models' weights (and the other workload's leftovers)
    projector = adapter.projector
    features = tokens.features
    scorer = Scorer(projector)  # as ReductionPipeline keeps one per projector
    text_len = int(adapter._encode_prompt(QUESTION, 1)["input_ids"].shape[1]) - 1
    out["text_tokens"] = text_len

    # CaRe's stages through care_reduce (jvp default, jvp bf16, jvp without the fused kernels, fd)
    stage_rows = []
    for k in BUDGETS[name]:
        for label, cfg, no_triton in (
            (
                "jvp (default: tf32, the Scorer's triangular factor, fused kernel)",
                CaReConfig(),
                False,
            ),
            ("jvp bf16 (fused)", CaReConfig(matmul_precision="bf16"), False),
            ("jvp tf32, PyTorch paths (triangular factor in cuBLAS column blocks)", CaReConfig(), True),
            ("fd (float32, tf32 off)", CaReConfig(engine="fd"), False),
        ):
            if label.startswith("fd") and k != BUDGETS[name][-1]:
                continue  # fd: one budget is enough (its scoring does not depend on K)
            with triton_disabled(no_triton):
                stats = median_stages(
                    clock,
                    lambda timer, k=k, cfg=cfg: care_reduce(features, projector, tokens.positions, keep=k,
                                                            config=cfg, stage_timer=timer, scorer=scorer),
                    reps=max(1, reps if not label.startswith("fd") else 2),
                )  # fmt: skip
            stage_rows.append({"K": k, "variant": label, **{f"{s}_ms": v for s, v in stats.items()}})
            print(f"  [{name}] care_reduce K={k} {label}: " +
                  ", ".join(f"{s} {v:.2f}" for s, v in stats.items()), flush=True)  # fmt: skip
    out["care_stages"] = stage_rows

    # prefill for every distinct number of visual rows; all tokens first
    prefill: dict[int, dict[str, Any]] = {}

    def prefill_times(
        rows: torch.Tensor, kept: torch.Tensor | None, graph_rows: torch.Tensor | None = None
    ) -> dict[str, Any]:
        graph_rows = rows if graph_rows is None else graph_rows
        count = int(graph_rows.shape[0])  # visual rows the language model really receives
        if count in prefill:
            return prefill[count]
        entry: dict[str, Any] = {"visual_rows": count, "sequence": count + text_len}
        run = eager_prefill(adapter, QUESTION, tokens, rows, kept)
        samples = [clock.once(run) for _ in range(reps + 4)][1:]  # launch-bound: keep the spread too
        entry["eager_ms"] = statistics.median(samples)
        entry["eager_min_ms"] = min(samples)
        entry["eager_peak_gib"] = peak_after(device, run)
        if graphs:
            try:
                gp = GraphPrefill(adapter, QUESTION, count)
                gp.capture()
                entry["graph_ms"] = clock.median(lambda: gp(graph_rows), reps=reps, warmup=2)
                first_eager, first_graph = int(run()), int(gp(graph_rows)[0, 0])
                entry["graph_token_matches_eager"] = first_eager == first_graph
                entry["_graph"] = gp
            except Exception as exc:
                entry["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
                traceback.print_exc()
        print(f"  [{name}] prefill {count} visual rows (+{text_len} text): eager {entry['eager_ms']:.2f} ms, "
              f"graph {entry.get('graph_ms', float('nan')):.2f} ms", flush=True)  # fmt: skip
        prefill[count] = entry
        # keep at most a few graphs alive (each holds its own memory pool)
        alive = [c for c, e in prefill.items() if "_graph" in e][1:]  # the first (all tokens) stays
        for c in alive[:-3]:
            prefill[c].pop("_graph", None)
        return entry

    with torch.no_grad():
        projected_all = projector(features)
    all_rows, all_kept, all_graph_rows = full_rows(projected_all)
    base = prefill_times(all_rows, all_kept, all_graph_rows)
    proj_all_ms = clock.median(lambda: projector(features), reps=reps)
    method_rows = [{
        "method": "none (all tokens)", "K": n, "rows": int(all_graph_rows.shape[0]), "reduce_ms": 0.0,
        "projector_ms": proj_all_ms, "prefill_eager_ms": base["eager_ms"], "prefill_graph_ms": base.get("graph_ms"),
        "peak_gib": base["eager_peak_gib"],
    }]  # fmt: skip

    for method_name in methods:
        for k in BUDGETS[name]:
            row: dict[str, Any] = {"method": method_name, "K": k}
            try:
                method = method_registry.build_method(method_name)
                needs = sorted(getattr(method, "needs", ()))

                def reduce(method=method, needs=needs, k=k) -> Any:
                    probes = adapter.probe_inputs(tokens, needs, QUESTION) if needs else {}
                    inputs = MethodInputs(features=features, projector=projector, positions=tokens.positions,
                                          grid=tokens.grid, probes=probes, seed=0, scorer=scorer)  # fmt: skip
                    with torch.no_grad():
                        return method(inputs, k)

                result = reduce()
                row["reduce_ms"] = clock.median(reduce, reps=reps)
                reduced = result.tokens
                with torch.no_grad():
                    rows_k = projector(reduced)
                row["rows"] = int(rows_k.shape[0])
                row["projector_ms"] = clock.median(lambda reduced=reduced: projector(reduced), reps=reps)
                entry = prefill_times(rows_k, result.token_index.cpu())
                row["prefill_eager_ms"] = entry["eager_ms"]
                row["prefill_graph_ms"] = entry.get("graph_ms")

                def whole(reduce=reduce) -> Any:
                    res = reduce()
                    with torch.no_grad():
                        return eager_prefill(adapter, QUESTION, tokens, projector(res.tokens), res.token_index.cpu())()

                row["peak_gib"] = peak_after(device, whole)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                print(f"  [{name}] {method_name} K={k}: {row['error']}", flush=True)
            method_rows.append(row)
            if "reduce_ms" in row and "prefill_eager_ms" in row:
                print(f"  [{name}] {method_name} K={k}: reduce {row['reduce_ms']:.2f} ms, "
                      f"prefill eager {row['prefill_eager_ms']:.2f} / "
                      f"graph {row.get('prefill_graph_ms') or float('nan'):.2f}",
                      flush=True)  # fmt: skip
    tower_ms = out["tower_ms"]
    for row in method_rows:
        if isinstance(row.get("peak_gib"), float):
            row["peak_over_resident_gib"] = row["peak_gib"] - weights_gib
        if "prefill_eager_ms" not in row:
            continue
        own = row["reduce_ms"] + row["projector_ms"]
        row["prefill_incl_reduction_eager_ms"] = own + row["prefill_eager_ms"]
        row["ttft_eager_ms"] = tower_ms + own + row["prefill_eager_ms"]
        if row.get("prefill_graph_ms") is not None:
            row["prefill_incl_reduction_graph_ms"] = own + row["prefill_graph_ms"]
            row["ttft_graph_ms"] = tower_ms + own + row["prefill_graph_ms"]
    full = method_rows[0]
    for row in method_rows[1:]:
        for mode in ("eager", "graph"):
            key = f"prefill_incl_reduction_{mode}_ms"
            if row.get(key) and full.get(f"prefill_{mode}_ms"):
                row[f"speedup_vs_full_{mode}"] = full[f"prefill_{mode}_ms"] / row[key]
    out["methods"] = method_rows

    # end-to-end TTFT measured in one timed region: tower -> CaRe -> projector -> graph prefill -> first token
    e2e = []
    for k in [None, *BUDGETS[name]]:
        try:
            if k is None:
                entry = prefill[int(all_graph_rows.shape[0])]

                def ttft(entry=entry) -> Any:
                    rows = full_rows(projector(tower()))[2]
                    return entry["_graph"](rows) if "_graph" in entry else None
            else:
                entry = prefill_times(projector(features[:k]), None)

                def ttft(entry=entry, k=k) -> Any:
                    feats = tower()
                    red = care_reduce(feats, projector, tokens.positions, keep=k, scorer=scorer)
                    rows = projector(red.tokens)
                    return entry["_graph"](rows) if "_graph" in entry else None

            if "_graph" not in entry:
                continue
            with torch.no_grad():
                ms = clock.median(ttft, reps=reps)
            e2e.append({"method": "none (all tokens)" if k is None else "care", "K": k or n, "ttft_graph_ms": ms})
            print(f"  [{name}] measured TTFT ({'all' if k is None else f'CaRe K={k}'}): {ms:.2f} ms", flush=True)
        except Exception as exc:
            e2e.append({"K": k, "error": f"{type(exc).__name__}: {exc}"[:300]})
            traceback.print_exc()
    out["ttft_measured"] = e2e
    out["prefill"] = [{k: v for k, v in e.items() if k != "_graph"} for e in prefill.values()]
    prefill.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


# ----------------------------------------------------------------------------------------- generate path
def bench_generate(
    name: str, adapter: Any, tokens: Any, tower_ms: float, keep: int, reps: int, max_new_tokens: int = 32
) -> list[dict[str, Any]]:
    """The user-facing path: ReductionPipeline(..., generate=True) with CaRe at K = keep, eager and from graphs.

    Every figure is the pipeline's own Answer (medians of ``reps`` alternating rounds after warm-ups); the
    speed-up is the first token from the vision features with all tokens (projector + prefill) over CaRe's
    (care_reduce + projector + prefill).
    """
    from care_core.pipeline import Budget, ReductionPipeline

    pipe = ReductionPipeline(adapter, ["care"])
    rows: list[dict[str, Any]] = []
    texts: dict[bool, tuple[str, str]] = {}
    for graphs in (False, True):
        label = "cuda graphs (static cache)" if graphs else "eager (transformers generate)"
        try:
            out = pipe(tokens, QUESTION, [Budget.keep(keep)], generate=True, max_new_tokens=max_new_tokens,
                       repeats=reps, cuda_graph=graphs)  # fmt: skip
        except Exception as exc:
            rows.append({"workload": name, "decoding": label, "error": f"{type(exc).__name__}: {exc}"[:300]})
            traceback.print_exc()
            continue
        full, red = out.full_answer, out.runs[0].answer
        assert full is not None and red is not None
        texts[graphs] = (full.text, red.text)
        row: dict[str, Any] = {"workload": name, "decoding": label, "K": keep, "max_new_tokens": max_new_tokens,
                               "answer_decoding": [full.decoding, red.decoding]}  # fmt: skip
        for side, ans in (("full", full), ("care", red)):
            row[f"{side}_visual_rows"] = ans.visual_tokens
            row[f"{side}_prefill_forward_ms"] = ans.prefill_ms
            row[f"{side}_first_token_ms"] = ans.first_token_ms
            row[f"{side}_first_token_from_features_ms"] = ans.first_token_from_features_ms
            row[f"{side}_ttft_incl_tower_ms"] = tower_ms + (ans.first_token_from_features_ms or float("nan"))
            row[f"{side}_total_ms"] = ans.total_ms
        row["speedup_first_token_incl_care"] = full.first_token_from_features_ms / red.first_token_from_features_ms
        row["speedup_ttft_incl_tower"] = row["full_ttft_incl_tower_ms"] / row["care_ttft_incl_tower_ms"]
        row["speedup_total"] = full.total_ms / red.total_ms
        rows.append(row)
        print(f"  [{name}] generate path, {label}: first token from features {full.first_token_from_features_ms:.2f}"
              f" -> {red.first_token_from_features_ms:.2f} ms ({row['speedup_first_token_incl_care']:.2f}x); "
              f"{max_new_tokens} tokens {full.total_ms:.1f} -> {red.total_ms:.1f} ms", flush=True)  # fmt: skip
    if len(texts) == 2:
        for row in rows:
            row["answers_equal_eager_vs_graph"] = [texts[False][0] == texts[True][0], texts[False][1] == texts[True][1]]
    return rows


# ----------------------------------------------------------------------------------------- report
def fmt(value: Any, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def print_tables(results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=180)
    env = results["environment"]
    console.print(f"[bold]{env.get('card')}[/] torch {env['torch']} triton {env['triton']} "
                  f"transformers {env['transformers']} CUDA {env['cuda']}")  # fmt: skip
    rates = results.get("matmul_tflops", {})
    if rates:
        console.print("matmul 8192^3 TFLOP/s: " + ", ".join(f"{k} {v:.0f}" for k, v in rates.items()))
    if results.get("scoring"):
        t = Table(title=f"Scoring, m = {M_DIRECTIONS} (ms; floor = m·N·d_h·d_out MACs at the measured rate)")
        for c in ("N", "engine", "matmul", "path", "ms", "floor", "x floor", "err vs fp64", "anchors shared"):
            t.add_column(c, justify="right" if c not in ("engine", "path") else "left")
        for r in results["scoring"]:
            t.add_row(fmt(r.get("N")), fmt(r.get("engine")), fmt(r.get("matmul")), fmt(r.get("path")),
                      fmt(r.get("ms")), fmt(r.get("floor_ms")), fmt(r.get("x_floor")),
                      f"{r['max_rel_err_vs_fp64']:.1e}" if "max_rel_err_vs_fp64" in r else "—",
                      fmt(r.get("anchor_overlap"), 3) if "anchor_overlap" in r else fmt(r.get("error")))  # fmt: skip
        console.print(t)
    if results.get("anchors"):
        t = Table(title="Anchor selection (Eq. 3), ms")
        for c in ("N", "K", "fused", "loop", "same order", "shared", "host syncs fused/loop"):
            t.add_column(c, justify="right")
        for r in results["anchors"]:
            t.add_row(fmt(r["N"]), fmt(r["K"]), fmt(r.get("fused_ms")), fmt(r.get("loop_ms")), fmt(r.get("same_order")),
                      fmt(r.get("shared_anchors"), 3),
                      f"{r.get('fused_host_syncs', '—')}/{r.get('loop_host_syncs', '—')}")  # fmt: skip
        console.print(t)
    for w in results.get("workloads", []):
        if "care_stages" in w:
            t = Table(title=f"{w['workload']}: care_reduce stages (N = {w['N']}), ms")
            for c in ("K", "variant", "scoring", "anchors", "calibration", "total"):
                t.add_column(c, justify="right" if c != "variant" else "left")
            for r in w["care_stages"]:
                t.add_row(fmt(r["K"]), r["variant"], fmt(r.get("scoring_ms")), fmt(r.get("anchors_ms")),
                          fmt(r.get("calibration_ms")), fmt(r.get("total_ms")))  # fmt: skip
            console.print(t)
        if "methods" in w:
            t = Table(title=f"{w['workload']}: N = {w['N']}, {w.get('text_tokens')} text tokens, tower "
                            f"{fmt(w.get('tower_ms'))} ms; times in ms; peak memory over the "
                            f"{fmt(w.get('resident_gib'))} GiB resident")  # fmt: skip
            cols = (
                "method",
                "K",
                "rows",
                "reduce",
                "proj",
                "prefill eager",
                "prefill graph",
                "prefill+red. graph",
                "speedup graph",
                "speedup eager",
                "TTFT graph",
                "TTFT eager",
                "peak +GiB",
            )
            for c in cols:
                t.add_column(c, justify="left" if c == "method" else "right")
            for r in w["methods"]:
                t.add_row(r["method"], fmt(r.get("K")), fmt(r.get("rows")), fmt(r.get("reduce_ms")),
                          fmt(r.get("projector_ms")), fmt(r.get("prefill_eager_ms")), fmt(r.get("prefill_graph_ms")),
                          fmt(r.get("prefill_incl_reduction_graph_ms")), fmt(r.get("speedup_vs_full_graph")),
                          fmt(r.get("speedup_vs_full_eager")), fmt(r.get("ttft_graph_ms")),
                          fmt(r.get("ttft_eager_ms")),
                          fmt(r.get("peak_over_resident_gib")) if "error" not in r else r["error"][:40])  # fmt: skip
            console.print(t)
    if results.get("generate"):
        t = Table(title="Generate path (ReductionPipeline + adapter.generate), ms: first token from the vision "
                        "features (method + projector + prefill), medians")  # fmt: skip
        for c in (
            "workload",
            "decoding",
            "K",
            "all: first token",
            "all: from features",
            "CaRe: first token",
            "CaRe: from features",
            "speed-up",
            "incl. tower",
            "32 tokens all / CaRe",
            "same answers",
        ):
            t.add_column(c, justify="left" if c in ("workload", "decoding") else "right")
        for r in results["generate"]:
            if "error" in r:
                t.add_row(r["workload"], r["decoding"], r["error"][:60])
                continue
            t.add_row(r["workload"], r["decoding"], fmt(r["K"]), fmt(r["full_first_token_ms"]),
                      fmt(r["full_first_token_from_features_ms"]), fmt(r["care_first_token_ms"]),
                      fmt(r["care_first_token_from_features_ms"]), fmt(r["speedup_first_token_incl_care"]),
                      fmt(r["speedup_ttft_incl_tower"]), f"{r['full_total_ms']:.0f} / {r['care_total_ms']:.0f}",
                      fmt(r.get("answers_equal_eager_vs_graph")))  # fmt: skip
        console.print(t)
    if results.get("targets"):
        for k, v in results["targets"].items():
            console.print(f"target {k}: {v}")


def targets(results: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    sc = [r for r in results.get("scoring", []) if r.get("N") == 2880 and "ms" in r]
    fused = [r for r in sc if r["engine"] == "jvp" and r["matmul"] == "auto"]
    fd = [r for r in sc if r["engine"] == "fd"]
    if fused:
        r = fused[0]
        verdict = "MET" if r["x_floor"] <= 1.5 else "NOT MET"
        out["jvp_default_tf32_within_1.5x_floor"] = (
            f"{r['ms']:.2f} ms = {r['x_floor']:.2f}x floor {r['floor_ms']:.2f} ms -> {verdict}"
        )
        if fd:
            ratio = fd[0]["ms"] / r["ms"]
            verdict = "MET" if ratio >= 10 else "NOT MET"
            out["jvp_default_10x_faster_than_fd_fp32"] = (
                f"fd {fd[0]['ms']:.1f} ms / jvp {r['ms']:.2f} ms = {ratio:.1f}x -> {verdict}"
            )
    for r in results.get("care_reduce", []):
        if "ms" not in r or r["matmul"] != "tf32" or "auto" not in r["scorer"]:
            continue
        bound = 1.2 if r["N"] == 2880 else 1.4
        out[f"care_reduce_N{r['N']}_within_{bound}x_floor"] = (
            f"{r['ms']:.2f} ms = {r['x_floor']:.2f}x floor {r['floor_ms']:.2f} ms -> "
            + ("MET" if r["x_floor"] <= bound else "NOT MET")
            + f"; same anchors/signals as the dense path: {r.get('same_anchors_as_dense')}/"
            f"{r.get('same_signals_as_dense')}"
        )
    bf = [r for r in sc if r["engine"] == "jvp" and r["matmul"] == "bf16" and r["path"] == "fused Triton kernel"]
    if bf:
        out["jvp_bf16_x_floor"] = (
            f"{bf[0]['ms']:.2f} ms = {bf[0]['x_floor']:.2f}x bf16 floor {bf[0]['floor_ms']:.2f} ms"
        )
    for r in results.get("generate", []):
        if r["workload"] == "llava-next-7b" and "error" not in r:
            s = r["speedup_first_token_incl_care"]
            mode = "graph" if r["decoding"].startswith("cuda") else "eager"
            out[f"next_K160_generate_path_incl_care_{mode}"] = f"{s:.2f}x" + (
                " -> " + ("MET" if s >= 3 else "NOT MET") if mode == "graph" else " (reported)"
            )
    for w in results.get("workloads", []):
        if w["workload"] != "llava-next-7b" or "methods" not in w:
            continue
        for r in w["methods"]:
            if r["method"] == "care" and r["K"] == 160:
                for mode in ("graph", "eager"):
                    s = r.get(f"speedup_vs_full_{mode}")
                    if s:
                        out[f"next_K160_prefill_incl_care_{mode}"] = f"{s:.2f}x -> " + (
                            "MET" if s >= 2.3 else "NOT MET"
                        )
    return out


# ----------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--only", choices=("all", "micro", "models", "generate"), default="all")
    parser.add_argument("--tiny", action="store_true", help="tiny widths (smoke test of this script)")
    parser.add_argument("--methods", default="all", help="comma-separated method names, or 'all'")
    parser.add_argument("--no-graphs", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    device = torch.device(args.device)
    clock = Clock(device)
    env = environment(device)
    date = dt.date.today().isoformat()
    out_path = args.out or ROOT / "benchmarks" / "results" / f"{date}-gpu-{card_slug(env['card'])}.json"
    results: dict[str, Any] = {
        "date": date, "environment": env, "m": M_DIRECTIONS, "budgets": BUDGETS,
        "weights": "random (timings do not depend on weight values)", "dtype": "bfloat16 model, float32 CaRe maths",
    }  # fmt: skip
    print(
        f"{env.get('card')} torch {env['torch']} triton {env['triton']} transformers {env['transformers']}", flush=True
    )

    def save() -> None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(results, indent=1, default=str) + "\n", encoding="utf-8")

    t0 = time.perf_counter()
    rates = matmul_rates(device, clock, 1024 if args.tiny else 8192)
    results["matmul_tflops"] = rates
    print("matmul TFLOP/s:", {k: round(v, 1) for k, v in rates.items()}, flush=True)

    from PIL import Image

    from care_core.backbones import LlavaAdapter

    image = Image.open(ROOT / "examples" / "astronaut.jpg")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, processor = build_llava(device, dtype, args.tiny)
    adapter = LlavaAdapter(model, processor, name="llava-1.5-7b (random weights)")
    print(f"model built in {time.perf_counter() - t0:.1f}s; attention {model.config.text_config._attn_implementation}",
          flush=True)  # fmt: skip
    results["attention"] = model.config.text_config._attn_implementation
    tokens15 = adapter.encode_image(image)
    next_adapter = None
    try:
        from care_core.backbones import LlavaNextAdapter

        next_model, next_processor = build_llava_next(device, dtype, args.tiny)
        next_adapter = LlavaNextAdapter(next_model, next_processor, name="llava-next-7b (random weights)")
        tokens_next = next_adapter.encode_image(image.convert("RGB").resize((672, 672)))
        if tokens_next.num_tokens != 2880:
            raise RuntimeError(f"LLaVA-NeXT adapter gave {tokens_next.num_tokens} tokens for 672x672, not 2880")
        tower_next = next_adapter_tower(next_adapter, tokens_next)
        results["llava_next_source"] = "LlavaNextAdapter on LlavaNextForConditionalGeneration (672x672 image)"
    except Exception as exc:
        traceback.print_exc()
        next_adapter = None
        tokens_next, tower_next = next_shaped_tokens(adapter, image)
        results["llava_next_source"] = (
            "LLaVA-1.5-7B modules on LLaVA-NeXT's workload (5 crops, N = 2880, +48 newline rows unreduced); "
            f"the LLaVA-NeXT adapter could not be used: {type(exc).__name__}: {str(exc)[:200]}"
        )
    print("LLaVA-NeXT:", results["llava_next_source"], flush=True)
    features_by_n = {576: tokens15.features, 2880: tokens_next.features}
    projector32 = __import__("copy").deepcopy(adapter.projector).float()

    if args.only in ("all", "micro"):
        print("== scoring", flush=True)
        results["scoring"] = bench_scoring(features_by_n, projector32, rates, clock, {576: 64, 2880: 160}, args.reps)
        save()
        print("== care_reduce end to end", flush=True)
        positions_by_n = {576: tokens15.positions, 2880: tokens_next.positions}
        results["care_reduce"] = bench_care_reduce(features_by_n, positions_by_n, projector32, rates, clock,
                                                   {576: 64, 2880: 160}, args.reps)  # fmt: skip
        save()
        print("== anchors", flush=True)
        results["anchors"] = bench_anchors(features_by_n, clock, {576: (192, 128, 64), 2880: (640, 320, 160)},
                                           args.reps)  # fmt: skip
        save()
    del projector32

    if args.only in ("all", "models"):
        methods = method_registry.method_names() if args.methods == "all" else args.methods.split(",")
        graphs = device.type == "cuda" and not args.no_graphs
        results["workloads"] = []
        hidden = adapter.projector.linear_2.weight.shape[0]
        g = torch.Generator(device="cpu").manual_seed(1)
        newline = (torch.randn(1, hidden, generator=g) * 0.02).to(device=device, dtype=model.dtype)
        plans: list[tuple[str, Any, Any, Callable, Callable, set[str]]] = [
            ("llava-1.5-7b", adapter, tokens15, llava15_tower(adapter, tokens15), lambda p: (p, None, p), set()),
        ]
        if next_adapter is not None:
            na, tn = next_adapter, tokens_next
            plans.append(("llava-next-7b", na, tn, tower_next,
                          lambda p, na=na, tn=tn: (p, None, na._with_newlines(tn, p)),
                          {"pool"}))  # fmt: skip
        else:

            def standin_rows(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
                rows, kept = next_newline_rows(p, newline)
                return rows, kept, rows

            plans.append(("llava-next-7b", adapter, tokens_next, tower_next, standin_rows,
                          {"visionzip", "prumerge+", "prumerge", "ficoco-v", "pool"}))  # fmt: skip
        for name, wl_adapter, tokens, tower, full_rows, skip in plans:
            print(f"== {name}", flush=True)
            mine = [m for m in methods if m not in skip]
            w = bench_workload(name, wl_adapter, tokens, tower, clock, device, args.reps, mine, graphs, full_rows)
            if skip & set(methods):
                w["notes"].append(
                    f"not run: {sorted(skip & set(methods))} (pool needs one raster grid"
                    + ("" if next_adapter is not None else "; the others need the LLaVA-NeXT adapter's probes")
                    + ")"
                )
            results["workloads"].append(w)
            save()
    if args.only in ("all", "generate"):
        print("== generate path (ReductionPipeline, CaRe)", flush=True)
        gen_plans = [("llava-1.5-7b", adapter, tokens15, llava15_tower(adapter, tokens15), 64)]
        if next_adapter is not None:
            gen_plans.append(("llava-next-7b", next_adapter, tokens_next, tower_next, 160))
        results["generate"] = []
        for name, wl_adapter, tokens, tower, keep in gen_plans:
            tower_ms = clock.median(tower, reps=args.reps)
            results["generate"] += bench_generate(name, wl_adapter, tokens, tower_ms, keep, args.reps)
            save()
    results["kernel_default"] = CaReConfig().kernel  # "auto": fused for bf16 scoring and anchors, tf32 on cuBLAS
    results["targets"] = targets(results)
    results["wall_s"] = time.perf_counter() - t0
    save()
    print_tables(results)
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
