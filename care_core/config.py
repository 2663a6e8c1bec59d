"""CaReConfig: the paper's hyperparameters (Supp. C) in one dataclass (the budget rule is care_core.budget)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, get_args

from care_core.errors import ConfigError

#: PRCA's response engines: "jvp" the exact directional derivative, "fd" Eq. 1 literally
Engine = Literal["jvp", "fd"]
ENGINES: tuple[Engine, ...] = get_args(Engine)
#: the jvp engine's matmul precision: auto = float32 on the CPU, tf32 on CUDA
MatmulPrecision = Literal["auto", "float32", "tf32", "bf16"]
MATMUL_PRECISIONS: tuple[MatmulPrecision, ...] = get_args(MatmulPrecision)
#: which code path runs the hot spots (care_core.kernels): "auto" fused where it applies and can run, "fused"
#: also for tf32 jvp scoring and a CareError where it cannot run, "torch" never fused
Kernel = Literal["auto", "fused", "torch"]
KERNELS: tuple[Kernel, ...] = get_args(Kernel)


def _one_of(values: tuple[str, ...]) -> str:
    return ", ".join(map(repr, values[:-1])) + f" or {values[-1]!r}"


def _hyper(
    default: Any, symbol: str, text: str, low: float | None = None, high: Any = None, *, open_low: bool = False
) -> Any:
    """A hyperparameter field: its symbol, a one-line meaning and its meaningful range, for the CLI and errors."""
    return field(default=default, metadata={"symbol": symbol, "help": text, "low": low, "high": high,
                                            "open_low": open_low})  # fmt: skip


def _range_text(meta: Mapping[str, Any], cfg: Any = None) -> str:
    low, high = meta["low"], meta["high"]
    if callable(high):
        high = high(cfg) if cfg is not None else None
    left = "(" if meta["open_low"] else "["
    if high is None:
        return f"{'> ' if meta['open_low'] else '>= '}{low:g}"
    return f"in {left}{low:g}, {high:g}]"


@dataclass(frozen=True)
class CaReConfig:
    """Hyperparameters of CaRe with the paper's defaults (Supp. C); each field carries its meaningful range."""

    h: float = _hyper(5e-4, "h", "finite-difference step of Eq. 1 (fd engine)", 0.0, 1.0, open_low=True)
    m: int = _hyper(64, "m", "number of unit perturbation directions", 1)
    lam: float = _hyper(0.5, "lambda", "directional-risk penalty in psi = mu - lambda sigma", 0.0)
    eta: float = _hyper(0.45, "eta", "weight of the spatial term in the affinity (Eq. 4)", 0.0)
    # the affinity cos + eta * exp(.) lies in [-1, 1 + eta]: a threshold outside it gates everything or nothing
    theta_s: float = _hyper(0.4, "theta_s", "affinity threshold of c_sim", -1.0, lambda c: 1.0 + c.eta)
    theta_c: float = _hyper(0.9, "theta_c", "confidence threshold of Eq. 6 (c_r lies in [0, 1])", 0.0, 1.0)
    alpha: float = _hyper(0.15, "alpha", "calibration strength, v' = v + alpha g", 0.0)
    sigma_p: float = _hyper(0.2, "sigma_p", "spatial decay of Eq. 4", 0.0, open_low=True)
    tau_g: float = _hyper(0.07, "tau_g", "temperature of the top-k_f assignment pi", 0.0, open_low=True)
    tau_c: float = _hyper(0.1, "tau_c", "temperature of c_sim", 0.0, open_low=True)
    tau_s: float = _hyper(0.07, "tau_s", "temperature of the soft assignment q (Eq. 7)", 0.0, open_low=True)
    eps: float = _hyper(1e-8, "epsilon", "numerical guard of the divisions", 0.0, 1e-2, open_low=True)
    seed: int = _hyper(42, "seed", "seed of the perturbation directions and of every random method", 0)
    engine: Engine = "jvp"  # "jvp": exact directional derivative; "fd": Eq. 1 literally
    matmul_precision: MatmulPrecision = "auto"  # jvp engine only: auto = float32 on CPU, tf32 on CUDA
    # fused Triton kernels: "auto" where they apply and can run (bf16 jvp scoring, greedy anchors on CUDA),
    # "torch" never, "fused" also for tf32 jvp scoring and a CareError where they cannot run
    kernel: Kernel = "auto"

    def __post_init__(self) -> None:
        for f in fields(self):
            if "low" not in f.metadata:
                continue
            value = getattr(self, f.name)
            integer = isinstance(f.default, int)
            kind = "an integer" if integer else "a number"
            ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
            if isinstance(value, bool) or not ok_type or (not integer and not math.isfinite(value)):
                raise ConfigError(f.name, f"must be {kind} {_range_text(f.metadata, self)}, got {value!r}")
            low, high = f.metadata["low"], f.metadata["high"]
            high = high(self) if callable(high) else high
            if value < low or (f.metadata["open_low"] and value == low) or (high is not None and value > high):
                raise ConfigError(f.name, f"must be {_range_text(f.metadata, self)}, got {value!r}")
        for name, values in (("engine", ENGINES), ("matmul_precision", MATMUL_PRECISIONS), ("kernel", KERNELS)):
            if getattr(self, name) not in values:
                raise ConfigError(name, f"must be {_one_of(values)}, got {getattr(self, name)!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def ranges(cls) -> dict[str, str]:
        """Each numeric hyperparameter's meaningful range, as text (theta_s's upper end follows eta)."""
        out = {}
        for f in fields(cls):
            if "low" in f.metadata:
                text = _range_text(f.metadata, cls())
                out[f.name] = text.replace(f"{1 + cls().eta:g}]", "1 + eta]") if f.name == "theta_s" else text
        return out
