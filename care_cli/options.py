"""Options shared by several commands: budgets, the backbone, every CaRe hyperparameter, output files.

The hyperparameter options are made from :class:`care_core.CaReConfig`'s fields (their symbols, meanings and
meaningful ranges), so a field added there is an option of every command that runs methods.
"""

from __future__ import annotations

import functools
import inspect
import math
import typing
from collections.abc import Callable
from dataclasses import fields
from typing import Annotated, Any, TypeVar

import typer

from care_cli.errors import UserError
from care_core.backbones.families import DEFAULT_DEMO, shipped_demos
from care_core.batch_sizes import CPU_BATCH_SIZE, MAX_BATCH_SIZE
from care_core.config import CaReConfig

_HYPER = "CaRe hyperparameters (paper defaults)"
_BACKBONE = "Backbone"

Ratio = Annotated[
    float | None,
    typer.Option("--ratio", "-r", help="Fraction of visual tokens kept, in (0, 1]: K = max(1, floor(ratio N))."),
]
Keep = Annotated[int | None, typer.Option("--keep", "-k", help="Number of visual tokens kept (K), 1 ≤ K ≤ N.")]
RatioSpecs = Annotated[
    list[str] | None,
    typer.Option("--ratio", "-r", metavar="RATIO",
                 help="Retention ratio in (0, 1], repeatable; START:STOP:STEP gives a range (STOP included).",
                 show_default=False),
]  # fmt: skip
#: what one value of these options is, in the error for a single-valued option given twice (other options: "value")
VALUE_NOUNS = {"--ratio": "budget", "--keep": "budget", "--method": "method"}
Keeps = Annotated[list[int] | None, typer.Option("--keep", "-k", help="Tokens kept, K (repeatable).", metavar="INT")]
Model = Annotated[
    str | None,
    typer.Option(
        "--model",
        help=f"A demo name ({', '.join(shipped_demos())}), a local model folder, or a Hugging Face repo id in the "
        f"local cache (offline). Default: the embedded {DEFAULT_DEMO} demo (a tiny model, not a real VLM; its "
        "caption says how it was made).",
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
Json = Annotated[
    bool, typer.Option("--json", help="Print one JSON object on stdout and nothing else there.", metavar="")
]
Force = Annotated[bool, typer.Option("--force", help="Replace output files that exist.", metavar="")]
Methods = Annotated[
    list[str] | None,
    typer.Option("--method", help="Method name (repeatable) or 'all' (see 'care methods'). Default: care.",
                 metavar="NAME"),
]  # fmt: skip

# Flag of each CaReConfig field where it is not the field name with dashes.
_FLAGS = {"lam": "--lambda"}
# What each choice field of CaReConfig means; its values are the field's Literal type (shown by the option).
_CHOICE_HELP = {
    "engine": "response engine: jvp (exact derivative) or fd (Eq. 1 literally)",
    "matmul_precision": "jvp matmuls (auto: float32 on the CPU, tf32 on CUDA)",
    "kernel": "kernels: auto (fused where available), fused, or torch",
}


def flag_of(name: str) -> str:
    """The command-line flag of a CaReConfig field."""
    return _FLAGS.get(name, "--" + name.replace("_", "-"))


def _hyper_parameters() -> list[inspect.Parameter]:
    ranges = CaReConfig.ranges()
    hints = typing.get_type_hints(CaReConfig)
    params = []
    for f in fields(CaReConfig):
        meta = f.metadata
        metavar = None
        if "help" in meta:
            text = f"{meta['symbol']}: {meta['help']}; {ranges[f.name].removeprefix('in ')}"
            annotation: Any = int if hints[f.name] is int else float
        else:  # a Literal: the option accepts exactly its values, listed in the help (a short metavar keeps
            annotation = hints[f.name]  # the panel readable at 80 columns)
            text = f"{_CHOICE_HELP.get(f.name, f.name)}; one of {', '.join(typing.get_args(annotation))}"
            metavar = "<choice>"
        option = typer.Option(flag_of(f.name), help=f"{text}.", rich_help_panel=_HYPER, metavar=metavar)
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                                        annotation=Annotated[annotation, option]))  # fmt: skip
    return params


def build_config(values: dict[str, Any]) -> CaReConfig:
    """A CaReConfig from option values (an out-of-range value raises ConfigError, shown with its flag)."""
    return CaReConfig(**values)


F = TypeVar("F", bound=Callable[..., Any])


def with_config(func: F) -> F:
    """Give a command one option per CaReConfig field; the command receives them as ``config: CaReConfig``."""
    hyper = _hyper_parameters()
    names = [p.name for p in hyper]
    signature = inspect.signature(func)
    hints = typing.get_type_hints(func, include_extras=True)
    kept = [p.replace(annotation=hints[p.name]) for p in signature.parameters.values() if p.name != "config"]

    @functools.wraps(func)
    def command(*args: Any, **kwargs: Any) -> Any:
        kwargs["config"] = build_config({name: kwargs.pop(name) for name in names})
        return func(*args, **kwargs)

    command.__signature__ = signature.replace(parameters=kept + hyper)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in kept + hyper}
    return command  # type: ignore[return-value]


def budget(ratio: float | None, keep: int | None) -> Any:
    """The one budget of a single-budget command, checked before any model is loaded (keep <= N is checked
    once N is known). Range errors are the library's (``Budget``), shown with the flag's name."""
    from care_core.budget import Budget

    if ratio is not None and keep is not None:
        raise UserError("give either --ratio or --keep, not both")
    if ratio is None and keep is None:
        raise UserError("give a budget: --ratio R (fraction kept, in (0, 1]) or --keep K")
    return Budget.ratio(ratio) if ratio is not None else Budget.keep(keep)  # type: ignore[arg-type]


def parse_ratio_specs(specs: list[str] | None) -> list[float]:
    """Ratios from ``0.11`` or ``START:STOP:STEP`` (inclusive of STOP, to a tolerance) forms."""
    out: list[float] = []
    for spec in specs or []:
        parts = spec.split(":")
        try:
            numbers = [float(p) for p in parts]
        except ValueError:
            raise UserError(f"--ratio {spec!r}: expected a number or START:STOP:STEP") from None
        if len(numbers) == 1:
            out.append(numbers[0])
            continue
        if len(numbers) != 3:
            raise UserError(f"--ratio {spec!r}: a range is START:STOP:STEP")
        start, stop, step = numbers
        if not (math.isfinite(step) and step > 0) or not stop >= start:
            raise UserError(f"--ratio {spec!r}: a range needs STOP >= START and STEP > 0")
        count = math.floor((stop - start) / step + 1e-9) + 1
        if count > 1000:
            raise UserError(f"--ratio {spec!r}: {count} budgets; use a larger STEP")
        out += [round(start + i * step, 10) for i in range(count)]
    return out


def budgets(ratios: list[float] | None, keeps: list[int] | None) -> list[Any]:
    """Budgets of a multi-budget command, checked before any model is loaded."""
    from care_core.budget import budgets_from

    if not ratios and not keeps:
        raise UserError("give at least one budget: --ratio R or --keep K (both repeatable)")
    return budgets_from(ratios or [], keeps or [])


def method_names(names: list[str] | None) -> tuple[list[str], bool]:
    """Canonical method names in the order given (default care), and whether 'all' was asked for."""
    from care_core.methods import canonical_name
    from care_core.methods import method_names as registered

    names = names or ["care"]
    if any(n.strip().lower() == "all" for n in names):
        return registered(), True
    return list(dict.fromkeys(canonical_name(n) for n in names)), False


def check_question(question: str | None) -> None:
    if question is not None and not question.strip():
        raise UserError("--question is empty")


CudaGraphs = Annotated[
    bool | None,
    typer.Option("--cuda-graphs/--no-cuda-graphs", show_default=False,
                 help="Answers: prefill and decode from captured CUDA graphs over a static KV cache. Default: on "
                      "where the backbone allows it (CUDA; LLaVA-family decoders with sdpa or eager attention and "
                      "no logit processors), else transformers' generate; on CUDA, CaRe's timed re-run from the "
                      "features also replays its reduction from a graph. --no-cuda-graphs: no CUDA graphs at all."),
]  # fmt: skip
BatchSize = Annotated[
    str,
    typer.Option("--batch-size", metavar="B|auto",
                 help=f"Samples run at once: a whole number >= 1, or auto: {CPU_BATCH_SIZE} on a CPU; on CUDA the free "
                      "memory over an estimate of one sample's memory from the model's config (KV cache, activations; "
                      "in care eval per setting, for the tokens its answers read), "
                      f"between 1 and {MAX_BATCH_SIZE} (docs/design/batches.md §Batch size). Per sample the result is "
                      "the one of batch size 1. A batch that runs out of GPU memory is split in halves and retried."),
]  # fmt: skip
