"""Which path runs, fused or PyTorch (the ``kernel`` setting, :class:`KernelGate`), and the fused kernels' entry
points, each importing Triton only when called (:mod:`care_core.kernels` says what each kernel does)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeVar

import torch

from care_core._memo import recall
from care_core.config import KERNELS, Kernel
from care_core.errors import CareError
from care_core.kernels.operands import weight_operand

Path = Literal["fused", "torch"]

T = TypeVar("T")
#: weight operands a gate keeps (:meth:`KernelGate.operand`): a scorer's factor in each precision and kernel it meets
MAX_OPERANDS = 8


def why_not_fused(device: torch.device) -> str | None:
    """None when the fused kernels may run on ``device``, else why not (checked afresh on every call).

    Needs an NVIDIA CUDA device (ROCm is skipped: the tf32 path's inline PTX cannot compile there),
    an importable Triton, and ``CARE_DISABLE_TRITON`` unset or "0".
    """
    if device.type != "cuda":
        return f"the fused kernels need a CUDA device, got {device.type!r}"
    if torch.version.hip is not None:
        return "the fused kernels are NVIDIA-only (this PyTorch is built for ROCm)"
    if os.environ.get("CARE_DISABLE_TRITON", "").strip() not in ("", "0"):
        return "the fused kernels are disabled by CARE_DISABLE_TRITON"
    try:
        import triton
        import triton.language  # noqa: F401
    except ImportError as exc:
        return f"Triton cannot be imported ({exc})"
    return None


def kernel_errors() -> tuple[type[Exception], ...]:
    """Exceptions that mean "this fused kernel cannot be built or launched here"; nothing else.

    ImportError (Triton or a kernel module missing) and Triton's compilation, PTX-assembler and
    hardware-resource (shared memory, registers) errors. Never ``torch.OutOfMemoryError`` or other
    runtime errors: those propagate.
    """
    errors: list[type[Exception]] = [ImportError]
    try:
        from triton.compiler import errors as compiler_errors
    except ImportError:
        return tuple(errors)
    errors.append(compiler_errors.CompilationError)
    try:
        from triton.runtime import errors as runtime_errors
    except ImportError:
        return tuple(errors)
    for name in ("OutOfResources", "PTXASError"):
        found = getattr(runtime_errors, name, None)
        if isinstance(found, type) and issubclass(found, Exception):
            errors.append(found)
    return tuple(errors)


def check_kernel(kernel: str) -> None:
    """Raise CareError unless ``kernel`` is one of :data:`care_core.config.KERNELS`."""
    if kernel not in KERNELS:
        raise CareError(f"must be one of {', '.join(KERNELS)}, got {kernel!r}", parameter="kernel")


def choose_kernel(kernel: str, device: torch.device, *, applies: bool = True) -> Path:
    """The code path for one call: "fused" or "torch"; a pure decision, made afresh on every call.

    "torch" always gives "torch". Where the fused kernels cannot run on ``device`` (CPU, ROCm, no
    Triton, disabled), "auto" gives "torch" and "fused" raises CareError. Otherwise the fused kernel
    runs where it ``applies`` (dtype, shape and precision it handles), else the PyTorch path.
    """
    check_kernel(kernel)
    if kernel == "torch":
        return "torch"
    reason = why_not_fused(device)
    if reason is not None:
        if kernel == "fused":
            raise CareError(f"kernel='fused' cannot run here: {reason}; use kernel='auto' or 'torch'")
        return "torch"
    return "fused" if applies else "torch"


@dataclass
class KernelGate:
    """The kernel setting of a call and the fused kernels that failed to build under it.

    A gate made per call (``KernelGate(kernel)``) forgets everything afterwards: a kernel that failed
    is tried again on the next call. A gate kept by its owner (:class:`care_core.scoring.Scorer`)
    skips, in "auto" mode, the kernels in ``failed`` for the owner's lifetime, and keeps the weights'
    kernel operands in ``operands`` (:meth:`operand`) as long as the owner does.
    """

    kernel: Kernel = "auto"
    failed: dict[str, str] = field(default_factory=dict)  # kernel name -> repr of its build error
    operands: dict[Hashable, torch.Tensor] = field(default_factory=dict)  # see operand()

    def __post_init__(self) -> None:
        check_kernel(self.kernel)

    def choose(self, name: str, device: torch.device, *, applies: bool = True) -> Path:
        """:func:`choose_kernel`, and "torch" in "auto" mode for a kernel that failed on this gate."""
        path = choose_kernel(self.kernel, device, applies=applies)
        if path == "fused" and self.kernel == "auto" and name in self.failed:
            return "torch"
        return path

    def operand(self, weight: torch.Tensor, *, bf16: bool) -> torch.Tensor:
        """:func:`~care_core.kernels.operands.weight_operand` of ``weight``, made once per weight and precision for
        this gate's owner: a pass over a (d_out, d_h) weight and a few launches that an eager call would pay before
        its kernel. Keyed by the tensor's storage, dtype and shape (no version counter: inference tensors keep
        none), so the owner drops them when the weights change (:class:`care_core.scoring.Scorer` does)."""
        key = (weight.data_ptr(), weight.dtype, weight.device, tuple(weight.shape), bf16)
        return recall(self.operands, key, lambda: weight_operand(weight, bf16=bf16), MAX_OPERANDS)

    def attempt(self, name: str, fused: Callable[[], T]) -> T | None:
        """Run ``fused``; None (and a warning) if it cannot be built here, in "auto" mode.

        Only :func:`kernel_errors` are caught: out-of-memory and other errors propagate. In "fused"
        mode a build failure is a CareError.
        """
        try:
            return fused()
        except kernel_errors() as exc:
            if self.kernel == "fused":
                raise CareError(f"kernel='fused': the fused {name} kernel cannot be built here ({exc!r})") from exc
            self.failed[name] = repr(exc)
            warnings.warn(f"care: fused {name} kernel unavailable ({exc!r}); using the PyTorch path", stacklevel=3)
            return None

    def fused_or(self, name: str, fused: Callable[[], T | None], original: Callable[[], T]) -> T:
        """``fused()``'s result, else ``original()``: where the kernel failed on this gate before, cannot be built
        here (:meth:`attempt`), or ``fused`` returns None (inputs the kernel does not take). A stand-in's call."""
        if name not in self.failed:
            out = self.attempt(name, fused)
            if out is not None:
                return out
        return original()


def as_gate(kernel: Kernel | KernelGate) -> KernelGate:
    """A gate for one call: the given one, or a fresh one for a setting string."""
    return kernel if isinstance(kernel, KernelGate) else KernelGate(kernel)


def jvp_norms(
    slope: torch.Tensor, lifted: torch.Tensor, w2: torch.Tensor, *, bf16: bool, upper: bool = False,
    rounded: bool = False,
) -> torch.Tensor:  # fmt: skip
    """The fused jvp kernel (:func:`care_core.kernels.jvp.jvp_norms`); imports Triton when called."""
    from care_core.kernels.jvp import jvp_norms as run

    return run(slope, lifted, w2, bf16=bf16, upper=upper, rounded=rounded)


def norm_first_norms(
    slope: torch.Tensor,
    lifted: torch.Tensor,
    inverse: torch.Tensor,
    coef: torch.Tensor,
    corrections: torch.Tensor,
    w2: torch.Tensor,
    *,
    bf16: bool,
    upper: bool,
    rounded: bool = False,
) -> torch.Tensor:
    """The fused norm-first jvp kernel (:func:`care_core.kernels.jvp_norm_first.norm_first_norms`); imports Triton
    when called."""
    from care_core.kernels.jvp_norm_first import norm_first_norms as run

    return run(slope, lifted, inverse, coef, corrections, w2, bf16=bf16, upper=upper, rounded=rounded)


def norm_first_operand(
    slope: torch.Tensor,
    lifted: torch.Tensor,
    inverse: torch.Tensor,
    coef: torch.Tensor,
    partial: torch.Tensor,
    start: int,
    stop: int,
    *,
    tf32_rounded: bool = False,
) -> torch.Tensor:
    """The norm-first operand kernel (:func:`care_core.kernels.norm_first_operand.norm_first_operand`); imports
    Triton when called."""
    from care_core.kernels.norm_first_operand import norm_first_operand as run

    return run(slope, lifted, inverse, coef, partial, start, stop, tf32_rounded=tf32_rounded)


def gemm_norms(
    rows: torch.Tensor, r: torch.Tensor, *, bf16: bool, upper: bool, rounded: bool = False, round_t: bool = True
) -> torch.Tensor:
    """The gemm-norm kernel, ||R t|| per row (:func:`care_core.kernels.gemm_norm.gemm_norms`); imports Triton when
    called."""
    from care_core.kernels.gemm_norm import gemm_norms as run

    return run(rows, r, bf16=bf16, upper=upper, rounded=rounded, round_t=round_t)


def greedy_orders(
    weights: torch.Tensor, grams: torch.Tensor, sizes: Sequence[int], ks: Sequence[int]
) -> list[torch.Tensor]:
    """The fused greedy kernel (:func:`care_core.kernels.greedy.greedy_orders`); imports Triton when called."""
    from care_core.kernels.greedy import greedy_orders as run

    return run(weights, grams, sizes, ks)


def divprune_orders(
    dist: torch.Tensor, first: torch.Tensor, sizes: torch.Tensor, steps: int, mask_selected: bool
) -> torch.Tensor:
    """The fused DivPrune greedy (:func:`care_core.kernels.divprune.divprune_orders`); imports Triton when called."""
    from care_core.kernels.divprune import divprune_orders as run

    return run(dist, first, sizes, steps, mask_selected)


#: the input types the vision rotary kernel takes (transformers' function computes in float32 and casts back)
VISION_ROTARY_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def vision_rotary_applies(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether the vision rotary kernel takes these inputs: q and k (rows, heads, head_dim) of one shape and type
    (:data:`VISION_ROTARY_DTYPES`) on one CUDA device with cos and sin (rows, head_dim), an even head_dim, unit
    stride along the dims, and no gradient wanted (the kernel has no backward)."""
    if not (q.is_cuda and q.dim() == 3 and k.shape == q.shape and k.dtype == q.dtype):
        return False
    rows, _, head_dim = q.shape
    tables = all(t.shape == (rows, head_dim) and t.is_floating_point() and t.stride(-1) == 1 for t in (cos, sin))
    placed = all(t.device == q.device for t in (k, cos, sin)) and q.stride(-1) == 1 and k.stride(-1) == 1
    wants_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, cos, sin))
    return q.dtype in VISION_ROTARY_DTYPES and tables and placed and head_dim % 2 == 0 and not wants_grad


def rotate_vision(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The vision rotary kernel (:func:`care_core.kernels.vision_rotary.rotate_vision`): transformers'
    ``apply_rotary_pos_emb_vision`` bit for bit, or None for inputs :func:`vision_rotary_applies` refuses (the caller
    runs transformers' function); imports Triton when it runs."""
    if not vision_rotary_applies(q, k, cos, sin):
        return None
    from care_core.kernels.vision_rotary import rotate_vision as run

    return run(q, k, cos, sin)


#: the input types the QuickGELU kernel takes (PyTorch's kernels compute in float32 and round to the input's type)
QUICK_GELU_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def quick_gelu_applies(x: torch.Tensor) -> bool:
    """Whether the QuickGELU kernel takes ``x``: contiguous, of a type of :data:`QUICK_GELU_DTYPES`, on CUDA, with no
    gradient wanted (the kernel has no backward)."""
    wants_grad = torch.is_grad_enabled() and x.requires_grad
    return x.is_cuda and x.dtype in QUICK_GELU_DTYPES and x.is_contiguous() and not wants_grad


def quick_gelu(x: torch.Tensor) -> torch.Tensor | None:
    """The QuickGELU kernel (:func:`care_core.kernels.quick_gelu.quick_gelu`): transformers' ``QuickGELUActivation``
    bit for bit, or None for an input :func:`quick_gelu_applies` refuses (the caller runs transformers' own);
    imports Triton when it runs."""
    if not quick_gelu_applies(x):
        return None
    from care_core.kernels.quick_gelu import quick_gelu as run

    return run(x)


def triton_enabled(device: torch.device) -> bool:
    """True when the fused kernels may run on ``device`` (:func:`why_not_fused` is None)."""
    return why_not_fused(device) is None
