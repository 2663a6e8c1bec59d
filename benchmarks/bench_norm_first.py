"""GPU probe of the jvp engine's norm-first path on the Qwen mergers and InternVL3's projector: the PyTorch path, the
fused norm-first kernel and the one-pass operand kernel (then the gemm-norm kernel, or cuBLAS), each against the
floor.

    python -m benchmarks.bench_norm_first --out benchmarks/results/<date>-gpu-h200-norm-first-paths.json
    python -m benchmarks.bench_norm_first --tiny --device cpu     # smoke test: small widths, the PyTorch path only

Per projector (Qwen2.5-VL-7B's merger: RMSNorm per 2 x 2 patch, 5120 -> 5120 -> 3584; Qwen3-VL-8B's: LayerNorm per
patch, 4608 -> 4608 -> 4096; InternVL3-8B's: one LayerNorm, 4096 -> 3584 -> 3584; random weights, random features)
at the latency gate's N (1296, 1024 and 1280), m = 64 (CaReConfig's), jvp responses in tf32 through the triangular or
trapezoidal factor R (what a Scorer runs on CUDA), the paths of ``responses_jvp``: kernel "torch" (the PyTorch path),
"fused" (the fused norm-first kernel), "auto" (what a Scorer runs: the fused kernel for one block, else the one-pass
operand kernel then the gemm-norm kernel through R), and "auto" with kernels held back: the fused kernel (the operand
and gemm-norm kernels), and it and the gemm-norm kernel (the operand kernel, then cuBLAS's product and norm). For each:
the median ms, which kernels the call ran, the largest error against the float64 PyTorch path (relative to the
largest response) and the time over the floor, 2 m N r FLOPs at the tf32 rate of an 8192^3 matmul measured in the
same run (r: multiply-adds per row through R). Beside them the one-pass path's parts, for all m directions: the
operand written by the kernel and by PyTorch, the products through R alone, the products and their norms, and the
gemm-norm kernel (the products' norms without the products), with the tile its autotuner chose.
"""

from __future__ import annotations

import copy
from functools import partial
from typing import Any

import torch
from transformers import InternVLConfig
from transformers.models.internvl.modeling_internvl import InternVLMultiModalProjector
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLPatchMerger
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionPatchMerger

from benchmarks.common import (
    Clock,
    ResultsWriter,
    fmt,
    make_parser,
    pick_device,
    print_table,
    run_main,
    say,
    source_state,
)
from benchmarks.gpu.context import card_slug, environment
from benchmarks.gpu.scoring import floor_ms, matmul_rates
from benchmarks.latency import MATMUL_SIZE, factor_macs_per_row
from benchmarks.models import FULL_SIZE
from care_core import CaReConfig, norm_first
from care_core.backbones.qwen2_5_vl.adapter import QwenMergerProjector
from care_core.backbones.qwen3_vl.adapter import Qwen3VLMergerProjector
from care_core.flops.specs import KNOWN_BACKBONES
from care_core.flops.tokens import visual_tokens
from care_core.kernels import dispatch
from care_core.kernels.dispatch import Kernel, KernelGate
from care_core.kernels.operands import round_to_tf32
from care_core.precision import matmul_precision
from care_core.scoring import (
    _activation_slope,
    _as_norm_first,
    _chunk_size,
    _second_layer_input,
    _upper_products,
    responses_jvp,
    triangular_factor,
    unit_directions,
)

FAMILIES = ("qwen2.5-vl", "qwen3-vl", "internvl3")
#: (label, kernel setting, fused kernels held back): what each timed call asks the gate for
PATHS: tuple[tuple[str, Kernel, tuple[str, ...]], ...] = (
    ("PyTorch path", "torch", ()),
    ("fused norm-first kernel", "fused", ()),
    ("auto (a Scorer's path)", "auto", ()),
    ("one-pass operand + cuBLAS", "auto", ("jvp_norm_first", "gemm_norm")),
    ("one-pass operand + gemm-norm kernel", "auto", ("jvp_norm_first",)),
)
#: the fused entry points a call may reach (:func:`ran_kernels` lists those it did)
ENTRY_POINTS = ("norm_first_norms", "norm_first_operand", "gemm_norms")
TINY = {"vision_hidden": 32, "out": 48, "n": 64}  # --tiny: 128 -> 128 -> 48, N = 64
DURATION = "about a minute on one H200 (three projectors, float64 references included); --tiny on a CPU: seconds"


def merger(family: str, tiny: bool, device: torch.device) -> tuple[torch.nn.Module, int]:
    """The family's merger as the adapter wraps it (random weights, float32, on ``device``) and the gate's N."""
    spec = KNOWN_BACKBONES[FULL_SIZE[family].spec]
    vit, merge = spec.vision, spec.vision.spatial_merge_size
    hidden, out = (TINY["vision_hidden"], TINY["out"]) if tiny else (vit.hidden, spec.projector.linears[-1][1])
    torch.manual_seed(0)
    if family == "qwen2.5-vl":
        module: torch.nn.Module = QwenMergerProjector(Qwen2_5_VLPatchMerger(out, hidden, spatial_merge_size=merge))
    elif family == "qwen3-vl":
        config = Qwen3VLVisionConfig(hidden_size=hidden, out_hidden_size=out, spatial_merge_size=merge)
        module = Qwen3VLMergerProjector(Qwen3VLVisionPatchMerger(config))
    else:  # InternVL3: the model's own projector, LayerNorm(4 d_v) -> Linear -> GELU -> Linear (pixel shuffle 0.5)
        shape = InternVLConfig(vision_config={"hidden_size": hidden}, text_config={"hidden_size": out})
        module = InternVLMultiModalProjector(shape)
    side = FULL_SIZE[family].side
    n = TINY["n"] if tiny else visual_tokens(spec, side, side).tokens
    return module.to(device=device, dtype=torch.float32).eval(), n


def ran_kernels(call: Any) -> tuple[Any, list[str]]:
    """``call()`` and the fused entry points it reached (none: the PyTorch path)."""
    ran: list[str] = []
    saved = {name: getattr(dispatch, name) for name in ENTRY_POINTS}

    def counted(name: str, real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            ran.append(name)
            return real(*args, **kwargs)

        return call

    for name, real in saved.items():
        setattr(dispatch, name, counted(name, real))
    try:
        return call(), sorted(set(ran))
    finally:
        for name, real in saved.items():
            setattr(dispatch, name, real)


def parts(projector: torch.nn.Module, features: torch.Tensor, u: torch.Tensor, r: torch.Tensor, clock: Clock,
          reps: int) -> dict[str, Any]:  # fmt: skip
    """Median ms of the one-pass path's parts over all m directions: the operand by the kernel (CUDA; as a Scorer
    runs it: coefficients direction-major, rows rounded to tf32) and by PyTorch, the chunks' products through R,
    those products and their norms (the cuBLAS step), and the gemm-norm kernel's norms (CUDA) on rows it reads as
    they are (a Scorer's) and on rows it rounds itself, with the tile its autotuner chose for the former."""
    desc = _as_norm_first(projector)
    assert desc is not None
    with torch.no_grad(), matmul_precision(allow_tf32=True):
        first = norm_first.first_layer(desc, features, u)
        slope = _activation_slope(desc.act, first.pre)
        m, n, hidden = u.shape[0], features.shape[0], r.shape[1]
        step = _chunk_size(m, n * max(hidden, r.shape[0]))
        chunks = [(start, min(m, start + step)) for start in range(0, m, step)]
        flat = torch.randn(n * step, hidden, device=features.device)
        writers = {"operand_torch_ms": partial(_second_layer_input, first, slope)}
        if features.is_cuda:
            coef = first.coef.transpose(1, 2).contiguous().transpose(1, 2)  # as scoring._one_pass_rows passes it
            writers["operand_kernel_ms"] = partial(dispatch.norm_first_operand, slope, first.lifted, first.inverse,
                                                   coef, first.partial, tf32_rounded=True)  # fmt: skip

        def every_chunk(write: Any) -> Any:
            return lambda: [write(a, b) for a, b in chunks]

        out: dict[str, Any] = {key: clock.median(every_chunk(w), reps=reps, warmup=2) for key, w in writers.items()}
        steps: dict[str, Any] = {
            "products_through_r_ms": partial(_upper_products, flat, r),
            "products_through_r_and_norms_ms": lambda: _upper_products(flat, r).norm(dim=-1),
        }
        if features.is_cuda:
            weight = dispatch.weight_operand(r, bf16=False)
            gemm = partial(dispatch.gemm_norms, r=weight, bf16=False, upper=True, rounded=True)
            steps["gemm_norms_rounding_in_kernel_ms"] = partial(gemm, flat)
            steps["gemm_norms_through_r_ms"] = partial(gemm, round_to_tf32(flat), round_t=False)  # a Scorer's
        for key, run in steps.items():
            out[key] = clock.median(partial(_repeated, run, len(chunks)), reps=reps, warmup=2)
        if features.is_cuda:
            from care_core.kernels.gemm_norm import chosen_config  # Triton: CUDA runs only

            out["gemm_norm_config"] = chosen_config(False, r.shape[0])
    return out


def _repeated(run: Any, times: int) -> list[Any]:
    """``run()`` ``times`` times (a step once per chunk)."""
    return [run() for _ in range(times)]


def bench_family(family: str, args: Any, device: torch.device, clock: Clock, tf32_tflops: float) -> dict[str, Any]:
    """One merger: each path's median ms, kernels run, error against float64 and time over the floor; the parts."""
    projector, n = merger(family, args.tiny, device)
    desc = _as_norm_first(projector)
    assert desc is not None, family  # the adapters' mergers describe themselves
    cfg = CaReConfig()
    d_in, d_h, d_out = desc.first.in_features, desc.first.out_features, desc.second.out_features
    features = torch.randn(n, d_in, generator=torch.Generator().manual_seed(1)).to(device)
    u = unit_directions(cfg.m, d_in, cfg.seed, device=device)
    r64 = triangular_factor(desc.second.weight.double())
    with torch.no_grad():
        exact = responses_jvp(features.double(), copy.deepcopy(projector).double(), u.double(), "float32",
                              kernel="torch", factor=r64)  # fmt: skip
    r = r64.float()
    macs = cfg.m * n * factor_macs_per_row(d_h, d_out)
    out: dict[str, Any] = {"family": family, "spec": FULL_SIZE[family].spec, "N": n, "m": cfg.m, "d_in": d_in,
                           "d_h": d_h, "d_out": d_out, "blocks": desc.blocks, "floor_macs": macs,
                           "floor_ms": floor_ms(macs, tf32_tflops), "paths": []}  # fmt: skip
    for label, kernel, held in PATHS:
        row: dict[str, Any] = {"path": label, "kernel": kernel, "held_back": list(held)}
        gate = KernelGate(kernel, failed=dict.fromkeys(held, "held back by the benchmark"))  # "auto" skips these
        call = partial(responses_jvp, features, projector, u, "tf32", kernel=gate, factor=r)
        try:
            got, row["ran"] = ran_kernels(call)
            row["ms"] = clock.median(call, reps=args.reps, warmup=2)
            row["x_floor"] = row["ms"] / out["floor_ms"]
            row["max_rel_err_vs_fp64"] = float((got.double() - exact).abs().max() / exact.abs().max())
        except Exception as exc:  # one path's failure is recorded; the others still run
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        say(f"  {family} {label}: {row.get('ms', float('nan')):.2f} ms ran {row.get('ran')} {row.get('error', '')}")
        out["paths"].append(row)
    out["parts"] = parts(projector, features, u, r, clock, args.reps)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = make_parser(__doc__ or "", quick="2 timed runs per figure", duration=DURATION, device="cuda")
    parser.add_argument("--reps", type=int, default=10, help="timed runs per figure (default 10)")
    parser.add_argument("--tiny", action="store_true", help="small widths (smoke test of this benchmark)")
    args = parser.parse_args(argv)
    args.reps = 2 if args.quick else max(1, args.reps)
    device = pick_device(args.device)
    env = environment(device)
    writer = ResultsWriter(args, f"{'gpu-' + card_slug(env['card']) if device.type == 'cuda' else 'cpu'}-norm-first")
    clock = Clock(device)
    rates = matmul_rates(device, clock, 256 if args.tiny else MATMUL_SIZE)
    say(f"tf32 matmul rate: {rates['tf32']:.1f} TFLOP/s")
    families = [bench_family(f, args, device, clock, rates["tf32"]) for f in FAMILIES]
    print_table("norm-first jvp responses, m = 64, tf32 through R: median ms",
                ("merger", "path", "ms", "x floor", "err vs fp64", "ran"),
                [(f["spec"], p["path"], fmt(p.get("ms")), fmt(p.get("x_floor")), fmt(p.get("max_rel_err_vs_fp64"), 6),
                  ",".join(p.get("ran", [])) or p.get("error", "torch")[:20]) for f in families for p in f["paths"]],
                keys=2)  # fmt: skip
    writer.finish({"environment": env, "source": source_state(), "tiny": args.tiny, "reps": args.reps,
                   "matmul_size": 256 if args.tiny else MATMUL_SIZE, "matmul_tflops": rates,
                   "families": families})  # fmt: skip


if __name__ == "__main__":
    run_main(main)
