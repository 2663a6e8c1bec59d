"""Every family at full size with seeded random weights, built directly on the device (:data:`FULL_SIZE`).

care_core ships tiny demos; the GPU benchmarks need the real shapes. Which families have a full-size model, its image
side and its builder are the family records' (``BackboneFamily.full_size``; each family's builder lives in
``care_core.backbones.<family>.demo``); the model takes the widths of the family's flops spec
(``care_core.flops.specs.KNOWN_BACKBONES``). Weights are random: timings do not depend on their values.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from care_core.backbones.families import families, import_path
from care_core.flops.specs import KNOWN_BACKBONES

#: (device, dtype, tiny, **options) -> (model, processor)
Builder = Callable[..., tuple[Any, Any]]


@dataclass(frozen=True)
class FullSize:
    """One family at full size for the GPU benchmarks: flops spec, adapter, image side and builder (its record's)."""

    spec: str  # the flops spec (care_core.flops.specs.KNOWN_BACKBONES) whose dims the model takes
    adapter: str  # "module:Class" of the family's adapter
    side: int  # the square image side the latency gate feeds it
    builder: str  # "module:function", function(spec, device, dtype, tiny) -> (model, processor)

    def build(self, device: torch.device, dtype: torch.dtype, tiny: bool = False) -> tuple[Any, Any]:
        """The model (random weights, built on ``device`` in ``dtype``; ``tiny``: small widths) and its processor."""
        return import_path(self.builder)(KNOWN_BACKBONES[self.spec], device, dtype, tiny)  # type: ignore[no-any-return]


def full_size_models() -> dict[str, FullSize]:
    """Family name -> its full-size model, for every registered family whose record has one, in listing order."""
    return {family.name: FullSize(family.flops_spec, family.adapter, family.full_size.image_side_px,
                                  family.full_size.builder)
            for family in families() if family.full_size is not None}  # fmt: skip


#: every family the benchmarks build at full size (the shipped ones and any registered before this import)
FULL_SIZE: dict[str, FullSize] = full_size_models()


def full_size_adapter(family: str, device: torch.device, tiny: bool = False) -> Any:
    """The family's adapter over its full-size model (bf16 on CUDA, float32 elsewhere; ``tiny``: the small widths)."""
    entry = FULL_SIZE[family]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, processor = entry.build(device, dtype, tiny)
    return import_path(entry.adapter)(model, processor, name=f"{entry.spec} (random weights)")


def save_full_size_model(family: str, folder: Path, device: str, tiny: bool) -> dict[str, Any]:
    """:func:`save_random_model` for a family of :data:`FULL_SIZE` (its builder, its stand-in tokenizer)."""
    return save_random_model(FULL_SIZE[family].build, folder, device, tiny)


def save_random_model(builder: Builder, folder: Path, device: str, tiny: bool, **options: Any) -> dict[str, Any]:
    """``builder``'s model (``options`` are its own, e.g. a LLaVA builder's ``tokenizer``) with seeded random weights,
    bf16 on CUDA, saved to ``folder`` and flushed to the disk; returns what it cost. For benchmarks that time a command
    loading it."""
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    start = time.perf_counter()
    model, processor = builder(torch.device(device), dtype, tiny, **options)
    built = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters())
    start = time.perf_counter()
    model.save_pretrained(str(folder))
    processor.save_pretrained(str(folder))
    # A 7B checkpoint is 14 GB of dirty pages: until they reach the disk, any fsync of the timed command waits on
    # them (lmms-eval's response cache: 1.78 s in the first timed setting against 0.09 s in the next, H100 2026-11-27)
    os.sync()
    saved = time.perf_counter() - start
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the timed command runs in its own process: leave it the memory
    return {"parameters": params, "dtype": str(dtype).removeprefix("torch."), "build_s": built, "save_s": saved,
            "tiny": tiny, **options}  # fmt: skip
