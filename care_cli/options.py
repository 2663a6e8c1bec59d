"""Options shared by several commands: the budget, the backbone and every CaRe hyperparameter."""

from __future__ import annotations

import math
from typing import Annotated, Any

import typer

from care_core import CaReConfig
from care_core.errors import BudgetError

_DEFAULT = CaReConfig()
_HYPER = "CaRe hyperparameters (paper defaults)"
_BACKBONE = "Backbone"

Ratio = Annotated[
    float | None,
    typer.Option("--ratio", "-r", help="Fraction of visual tokens kept, in (0, 1]: K = max(1, floor(ratio N))."),
]
Keep = Annotated[int | None, typer.Option("--keep", "-k", help="Number of visual tokens kept (K).")]
Model = Annotated[
    str | None,
    typer.Option(
        "--model",
        help="Demo name (tiny-llava), a local model folder, or a Hugging Face repo id in the local cache. "
        "Default: the embedded tiny-llava demo (random weights).",
        rich_help_panel=_BACKBONE,
    ),
]
Device = Annotated[str, typer.Option("--device", help="cpu, cuda, cuda:N or auto.", rich_help_panel=_BACKBONE)]
Dtype = Annotated[
    str,
    typer.Option(
        "--dtype",
        help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16, float64.",
        rich_help_panel=_BACKBONE,
    ),
]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout and nothing else there.")]


def _hyper(flag: str, name: str, text: str) -> Any:
    return typer.Option(flag, help=f"{text}.", rich_help_panel=_HYPER)


H = Annotated[float, _hyper("--h", "h", "h: finite-difference step of Eq. 1")]
M = Annotated[int, _hyper("--m", "m", "m: number of perturbation directions")]
Lam = Annotated[float, _hyper("--lambda", "lam", "lambda: directional-risk penalty")]
Eta = Annotated[float, _hyper("--eta", "eta", "eta: spatial-term weight of Eq. 4")]
ThetaS = Annotated[float, _hyper("--theta-s", "theta_s", "theta_s: affinity threshold")]
ThetaC = Annotated[float, _hyper("--theta-c", "theta_c", "theta_c: confidence threshold of Eq. 6")]
Alpha = Annotated[float, _hyper("--alpha", "alpha", "alpha: calibration strength")]
SigmaP = Annotated[float, _hyper("--sigma-p", "sigma_p", "sigma_p: spatial decay of Eq. 4")]
TauG = Annotated[float, _hyper("--tau-g", "tau_g", "tau_g: top-k_f assignment temperature")]
TauC = Annotated[float, _hyper("--tau-c", "tau_c", "tau_c: confidence temperature")]
TauS = Annotated[float, _hyper("--tau-s", "tau_s", "tau_s: soft-assignment temperature of Eq. 7")]
Eps = Annotated[float, _hyper("--eps", "eps", "epsilon")]
Seed = Annotated[int, _hyper("--seed", "seed", "seed of the perturbation directions")]
Engine = Annotated[str, _hyper("--engine", "engine", "response engine: jvp (exact derivative) or fd (Eq. 1 literally)")]
MatmulPrecision = Annotated[
    str, _hyper("--matmul-precision", "matmul_precision", "jvp matmuls: auto, float32, tf32 or bf16")
]


def check_budget(ratio: float | None, keep: int | None) -> None:
    """Reject a bad budget before any model is loaded (keep <= N is checked once N is known)."""
    if ratio is not None and keep is not None:
        raise BudgetError("give either --ratio or --keep, not both")
    if ratio is None and keep is None:
        raise BudgetError("give a budget: --ratio R (fraction kept, in (0, 1]) or --keep K")
    if ratio is not None and not (math.isfinite(ratio) and 0 < ratio <= 1):
        raise BudgetError(f"--ratio must be in (0, 1], got {ratio}")
    if keep is not None and keep < 1:
        raise BudgetError(f"--keep must be at least 1, got {keep}")
