"""The GPU benchmark's setting: the card and versions, the budgets, and the two workloads (full-size LLaVA-1.5-7B
and LLaVA-NeXT-7B with random weights, each with the tokens of one photo)."""

from __future__ import annotations

import platform
import re
import statistics
import subprocess
import time
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.common import EXAMPLES, say
from care_core.backbones.llava_1_5.demo import build_llava_1_5_7b
from care_core.backbones.llava_next.demo import build_llava_next_7b

QUESTION = "What is in this image? Answer in a few words."
LAUNCHES = 500  # tiny kernels per round of :func:`launch_us` (5 rounds, the median)
BUDGETS = {"llava-1.5-7b": (192, 128, 64), "llava-next-7b": (640, 320, 160)}
M_DIRECTIONS = 64
NOT_ON_CPU = "CUDA graphs: not on CPU"


@dataclass
class Workload:
    """One backbone and the tokens of one image; ``skip``: methods that cannot run on it (and why)."""

    name: str
    adapter: Any
    image: Any
    tokens: Any
    budgets: tuple[int, ...]
    skip: dict[str, str]

    def tower(self) -> Any:
        """The processor and the vision tower on the image (``adapter.encode_image``), as a user's call runs them."""
        return self.adapter.encode_image(self.image)


def cpu_model(cpuinfo: str) -> str | None:
    """The first ``model name`` of a ``/proc/cpuinfo`` text (Linux), None where it has none."""
    found = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, flags=re.MULTILINE)
    return found.group(1).strip() if found else None


def launch_us(device: torch.device) -> float:
    """Host microseconds per launch of a one-element kernel, queued back to back (median of 5 rounds): how fast this
    host feeds the GPU. Eager decoding and any step not replayed from a CUDA graph pay it on every kernel, so results
    from hosts of different speed differ there (the same card, the same code)."""
    x = torch.zeros(1, device=device)
    rounds = []
    for _ in range(6):  # the first round warms up
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(LAUNCHES):
            x.add_(1.0)
        rounds.append((time.perf_counter() - start) / LAUNCHES * 1e6)
    torch.cuda.synchronize(device)
    return statistics.median(rounds[1:])


def host_cpu() -> str | None:
    """This host's CPU model (Linux: /proc/cpuinfo), else what platform says, None where neither says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            return cpu_model(info.read())
    except OSError:
        return platform.processor() or None


def environment(device: torch.device) -> dict[str, Any]:
    import transformers

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "transformers": transformers.__version__, "cuda": torch.version.cuda,
                           "device": str(device)}  # fmt: skip
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = "not installed"
    if device.type != "cuda":
        env["card"] = f"cpu ({platform.processor() or platform.machine()})"
        return env
    props = torch.cuda.get_device_properties(device)
    env.update(
        card=props.name,
        sm_count=props.multi_processor_count,
        memory_gib=round(props.total_memory / 2**30, 1),
        host_cpu=host_cpu(),
        launch_us=round(launch_us(device), 2),
    )
    query = ["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm", "--format=csv,noheader"]
    try:
        env["nvidia_smi"] = subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        env["nvidia_smi"] = None
    return env


def card_slug(card: str) -> str:
    words = re.sub(r"[^a-z0-9]+", "-", card.lower()).strip("-")
    for key in ("h200", "h100", "a100", "l40s", "l4", "b200", "gh200"):
        if key in words.split("-"):
            return key
    return words[:24] or "gpu"


def build_workloads(device: torch.device, tiny: bool, quick: bool) -> list[Workload]:
    """LLaVA-1.5-7B on the 336x336 view of a photo (N = 576) and, unless ``quick``, LLaVA-NeXT-7B on a 672x672
    copy (base view + 2x2 grid: N = 2880); bf16 on CUDA, float32 on the CPU."""
    from PIL import Image

    from care_core.backbones import LlavaAdapter, LlavaNextAdapter

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    photo = Image.open(EXAMPLES / "astronaut.jpg").convert("RGB")
    model, processor = build_llava_1_5_7b(device, dtype, tiny)
    adapter = LlavaAdapter(model, processor, name="llava-1.5-7b (random weights)")
    say(f"LLaVA-1.5-7B built; attention {model.config.text_config._attn_implementation}")
    out = [Workload("llava-1.5-7b", adapter, photo, adapter.encode_image(photo), BUDGETS["llava-1.5-7b"], {})]
    if quick:
        return out
    model, processor = build_llava_next_7b(device, dtype, tiny)
    next_adapter = LlavaNextAdapter(model, processor, name="llava-next-7b (random weights)")
    big = photo.resize((672, 672))
    skip = {"pool": "pool needs one raster grid"}
    tokens = next_adapter.encode_image(big)
    out.append(Workload("llava-next-7b", next_adapter, big, tokens, BUDGETS["llava-next-7b"], skip))
    say("LLaVA-NeXT-7B built")
    return out
