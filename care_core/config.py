"""CaReConfig: the paper's hyperparameters (Supp. C) in one dataclass, and the token budget rule."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

from care_core.errors import BudgetError, CareError

Engine = Literal["jvp", "fd"]
MatmulPrecision = Literal["auto", "float32", "tf32", "bf16"]


@dataclass(frozen=True)
class CaReConfig:
    """Hyperparameters of CaRe with the paper's defaults (Supp. C)."""

    h: float = 5e-4  # h: finite-difference step of Eq. 1
    m: int = 64  # m: number of unit perturbation directions
    lam: float = 0.5  # lambda: directional-risk penalty in psi = mu - lambda sigma
    eta: float = 0.45  # eta: weight of the spatial term in Eq. 4
    theta_s: float = 0.4  # theta_s: affinity threshold of c_sim
    theta_c: float = 0.9  # theta_c: confidence threshold of Eq. 6
    alpha: float = 0.15  # alpha: calibration strength, v' = v + alpha g
    sigma_p: float = 0.2  # sigma_p: spatial decay of Eq. 4
    tau_g: float = 0.07  # tau_g: temperature of the top-k_f assignment pi
    tau_c: float = 0.1  # tau_c: temperature of c_sim
    tau_s: float = 0.07  # tau_s: temperature of the soft assignment q (Eq. 7)
    eps: float = 1e-8  # epsilon
    seed: int = 42  # seed of the perturbation directions
    engine: Engine = "jvp"  # "jvp": exact directional derivative; "fd": Eq. 1 literally
    matmul_precision: MatmulPrecision = "auto"  # jvp engine only: auto = float32 on CPU, tf32 on CUDA
    # fused Triton kernels: "auto" where they apply and can run (bf16 jvp scoring, greedy anchors on CUDA),
    # "torch" never, "fused" also for tf32 jvp scoring and a CareError where they cannot run
    kernel: Literal["auto", "fused", "torch"] = "auto"

    def __post_init__(self) -> None:
        positive = ("h", "tau_g", "tau_c", "tau_s", "sigma_p", "eps")
        for name in positive:
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise CareError(f"config: {name} must be a finite number > 0, got {value!r}")
        for name in ("lam", "eta", "theta_s", "theta_c", "alpha"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value)):
                raise CareError(f"config: {name} must be a finite number, got {value!r}")
        if not isinstance(self.m, int) or isinstance(self.m, bool) or self.m < 1:
            raise CareError(f"config: m must be an integer >= 1, got {self.m!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise CareError(f"config: seed must be an integer, got {self.seed!r}")
        if self.engine not in ("jvp", "fd"):
            raise CareError(f"config: engine must be 'jvp' or 'fd', got {self.engine!r}")
        if self.matmul_precision not in ("auto", "float32", "tf32", "bf16"):
            raise CareError(
                f"config: matmul_precision must be auto, float32, tf32 or bf16, got {self.matmul_precision!r}"
            )
        if self.kernel not in ("auto", "fused", "torch"):
            raise CareError(f"config: kernel must be auto, fused or torch, got {self.kernel!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def resolve_budget(num_tokens: int, ratio: float | None = None, keep: int | None = None) -> int:
    """K = max(1, floor(ratio * N)) from a retention ratio, or K = keep; exactly one must be given."""
    if num_tokens < 1:
        raise BudgetError(f"there are no visual tokens to reduce (N = {num_tokens})")
    if (ratio is None) == (keep is None):
        raise BudgetError("give exactly one of ratio (fraction kept) and keep (number of tokens kept)")
    if ratio is not None:
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
            raise BudgetError(f"ratio must be a number in (0, 1], got {ratio!r}")
        if not (math.isfinite(ratio) and 0 < ratio <= 1):
            raise BudgetError(f"ratio must be in (0, 1], got {ratio}")
        return max(1, math.floor(ratio * num_tokens))
    if isinstance(keep, bool) or not isinstance(keep, int):
        raise BudgetError(f"keep must be an integer, got {keep!r}")
    if not 1 <= keep <= num_tokens:
        raise BudgetError(f"keep must be between 1 and N = {num_tokens}, got {keep}")
    return keep
