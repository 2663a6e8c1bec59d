"""Offline backbone loading: demo names, local model folders and cached Hugging Face repo ids.

Nothing here touches the network: every `from_pretrained` gets ``local_files_only=True`` and repo
ids are resolved in the local Hugging Face cache only.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from ..errors import ModelLoadError, one_line
from ..home import care_home
from .base import VLMAdapter
from .demo import install_demo, marker_note, read_marker, weights_problem
from .families import DEFAULT_DEMO, backbone_family, demo_backbones, import_path, model_types, shipped_demos

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float64": torch.float64,
    "fp64": torch.float64,
    "double": torch.float64,
}


def adapter_class(model_type: str) -> type[VLMAdapter]:
    """The adapter of the family that loads ``config.json`` model_type ``model_type`` (the family registry's)."""
    family = backbone_family(model_type)
    adapter: type[VLMAdapter] = import_path(family.adapter)
    if getattr(adapter, "family", None) != family.name:  # the record and its adapter must name each other
        raise RuntimeError(f"{family.adapter} is the adapter of family {family.name!r} but says {adapter.family!r}")
    return adapter


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache, read from the environment now (same rules as huggingface_hub)."""
    env = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if env:
        return Path(os.path.expandvars(os.path.expanduser(env)))
    hf_home = os.environ.get("HF_HOME")
    if not hf_home:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        hf_home = os.path.join(xdg, "huggingface")
    return Path(os.path.expandvars(os.path.expanduser(hf_home))) / "hub"


def resolve_device(device: str | torch.device) -> torch.device:
    """A torch.device that exists on this machine (ModelLoadError otherwise); "auto" picks CUDA if present."""
    if isinstance(device, str) and device.strip().lower() == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"unknown device {device!r} (use auto, cpu, cuda or cuda:N)") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(f"device {device!r} requested but CUDA is not available here")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            count = torch.cuda.device_count()
            raise ModelLoadError(f"device {device!r} does not exist ({count} CUDA devices)")
    elif dev.type == "mps":
        if not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
            raise ModelLoadError(f"device {device!r} requested but MPS is not available here")
    elif dev.type != "cpu":
        raise ModelLoadError(f"unsupported device {device!r} (use auto, cpu, cuda or cuda:N)")
    return dev


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype | str:
    """None -> float32 on the CPU, bfloat16 on CUDA; names like "bfloat16" or "auto" accepted."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).strip().lower().removeprefix("torch.")
    if key == "auto":
        return "auto"
    if key in _DTYPES:
        return _DTYPES[key]
    raise ModelLoadError(f"unknown dtype {dtype!r} (use float32, float16, bfloat16, float64 or auto)")


def _accepted_forms() -> str:
    demos = ", ".join(sorted(shipped_demos()))
    return (
        f"expected a demo name ({demos}), a local model folder, "
        "or a Hugging Face repo id like org/name that is in the local cache"
    )


def _looks_like_path(model: str) -> bool:
    return (
        model.startswith((".", "/", "~", "\\"))
        or "\\" in model
        or model.count("/") > 1
        or bool(re.match(r"^[A-Za-z]:", model))
    )


def _read_model_type(folder: Path, shown: str) -> str:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{shown} is not a model folder (no config.json)")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {config_path}: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelLoadError(f"cannot read {config_path}: not a JSON object")
    model_type = config.get("model_type")
    supported = ", ".join(sorted(model_types()))
    if model_type is None:
        raise ModelLoadError(f"{config_path} has no model_type (supported: {supported})")
    if model_type not in model_types():
        raise ModelLoadError(f"unsupported model type {model_type} (supported: {supported})")
    return str(model_type)


def _load_folder(
    folder: Path,
    *,
    name: str,
    is_demo: bool,
    device: torch.device,
    dtype: torch.dtype | str,
    shown: str | None = None,
) -> VLMAdapter:
    shown = shown or str(folder)
    if folder.is_file():
        raise ModelLoadError(f"{shown} is a file, expected a model folder")
    model_type = _read_model_type(folder, shown)
    adapter_cls: Any = adapter_class(model_type)
    marker = read_marker(folder)  # a demo folder (care_demo.json) keeps its note when loaded as a folder
    if marker is not None:
        problem = weights_problem(folder, marker)
        if problem is not None:
            demo = marker.get("name", "demo")
            raise ModelLoadError(
                f"{shown}: the demo's weights are {problem}; load it by name ({{model}}={demo}) to restore it"
            )
    try:
        adapter = adapter_cls.from_folder(
            folder, name=name, is_demo=is_demo or marker is not None, device=device, dtype=dtype
        )
    except ModelLoadError:
        raise
    except Exception as exc:
        detail = one_line(exc)
        if len(detail) > 300:
            detail = detail[:300] + "..."
        raise ModelLoadError(
            f"cannot load the {model_type} model in {shown} (missing or corrupt files?): {type(exc).__name__}: {detail}"
        ) from exc
    adapter.demo_note = marker_note(marker) if marker is not None else None
    return adapter


def _resolve_repo_id(repo_id: str) -> Path:
    """The snapshot folder of ``repo_id`` in the local HF cache (no network), or ModelLoadError."""
    cache = hf_hub_cache()
    hint = (
        f'model "{repo_id}" is not in the local Hugging Face cache ({cache}); download it where the hub '
        f"is reachable (e.g. `hf download {repo_id}`) and copy the cache here, or pass a local folder "
        "with --model PATH"
    )
    from huggingface_hub import snapshot_download

    try:
        with _quiet():
            snapshot = snapshot_download(repo_id, cache_dir=str(cache), local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(hint) from exc
    path = Path(snapshot)
    if not path.is_dir():
        raise ModelLoadError(hint)
    return path


def _quiet() -> Any:
    from ._hf import quiet_transformers

    return quiet_transformers()


def load_backbone(
    model: str | os.PathLike[str] | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
    home: Path | None = None,
) -> VLMAdapter:
    """Load a backbone offline and wrap it in its family's adapter.

    ``model`` is a demo name (None means :data:`~care_core.backbones.families.DEFAULT_DEMO`), a local model
    folder, or a Hugging Face repo id ``org/name`` present in the local HF cache. ``dtype`` None means float32
    on the CPU and bfloat16 on CUDA. Raises :class:`ModelLoadError` for anything that cannot be loaded.
    """
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if model is None:
        model = DEFAULT_DEMO
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if not isinstance(model, str) or not model.strip():
        raise ModelLoadError(f"no model given; {_accepted_forms()}")

    demos = demo_backbones()
    if model in demos:
        installed = install_demo(model, Path(home) if home is not None else care_home())
        adapter = _load_folder(installed.folder, name=model, is_demo=True, device=dev, dtype=dt)
        adapter.demo_note = demos[model].note
        adapter.notices.extend(installed.notices)
        return adapter

    path = Path(model).expanduser()
    if path.exists():
        return _load_folder(path, name=model, is_demo=False, device=dev, dtype=dt, shown=model)

    if _REPO_ID.match(model) and not _looks_like_path(model):
        snapshot = _resolve_repo_id(model)
        return _load_folder(snapshot, name=model, is_demo=False, device=dev, dtype=dt, shown=f"{model} ({snapshot})")

    if _looks_like_path(model):
        message = f"{model} does not exist; {_accepted_forms()}"
    else:
        message = f"cannot find model {model!r}: no demo, folder or repo id by that name; {_accepted_forms()}"
    close = difflib.get_close_matches(model.lower(), shipped_demos(), n=1, cutoff=0.6)
    if close:
        message += f' (did you mean "{close[0]}"?)'
    raise ModelLoadError(message)


def adapter_for_model(model: Any, processor: Any, *, name: str | None = None) -> VLMAdapter:
    """The family adapter around a model the caller already loaded (and its processor), for code that keeps
    calling transformers itself (:mod:`care_core.dropin`). The adapter gets a shallow copy of ``processor``:
    the settings an adapter aligns with the model (e.g. LLaVA's patch size) are written on the copy, never
    on the caller's object. ModelLoadError (one line) for a model care has no adapter for."""
    import copy

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    supported = ", ".join(sorted(model_types()))
    if not isinstance(model_type, str) or model_type not in model_types():
        raise ModelLoadError(f"care cannot reduce the tokens of model type {model_type!r} (supported: {supported})")
    adapter_cls: Any = adapter_class(model_type)
    classes = {klass.__name__ for klass in type(model).__mro__}
    wanted = adapter_cls.model_class.rpartition(":")[2]  # a transformers name, or a plug-in's "module:Class"
    if wanted not in classes:
        raise ModelLoadError(
            f"a {model_type} model must be a {wanted} (the class with generate), got {type(model).__name__}"
        )
    if processor is None or getattr(processor, "tokenizer", None) is None:
        raise ModelLoadError(
            "is needed: pass the processor the inputs are made with (tokenizer and image processor)",
            parameter="processor",
        )
    shown = name or str(getattr(model, "name_or_path", "") or type(model).__name__)
    return adapter_cls(model, copy.copy(processor), name=shown)  # type: ignore[no-any-return]
