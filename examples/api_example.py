"""Use the care library directly: the pipeline every command uses, then the core function on its own.

    python examples/api_example.py examples/astronaut.jpg

The demo backbone is a tiny model, not a real VLM: the numbers show the mechanics (its caption says how it
was made).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from care_core import CaReConfig, care_reduce, csr_score
from care_core.budget import Budget
from care_core.images import load_image
from care_core.pipeline import ReductionPipeline


def main(path: str) -> None:
    image = load_image(Path(path))
    question = "What is in the image?"

    # 1. The pipeline: load once, then any image, methods and budgets.
    pipe = ReductionPipeline.from_pretrained("tiny-llava", methods=["care", "visionzip"], config=CaReConfig(seed=42))
    out = pipe(image, question, [Budget.ratio(0.11), Budget.keep(128)], csr=True)
    print(pipe.backbone.note or pipe.backbone.name)
    for run in out.runs:
        print(f"{run.method:>10} {run.budget.label:>10}: K = {run.keep}, CSR x 100 = {100 * run.csr:.2f}")

    # 2. The core function on tensors.
    adapter = pipe.adapter
    tokens = pipe.encode(image)
    red = care_reduce(tokens.features, adapter.projector, tokens.positions, ratio=0.11, config=CaReConfig(seed=42))
    with torch.no_grad():
        full = adapter.projector(tokens.features)
        reduced = adapter.projector(red.tokens)
    print(f"N = {tokens.num_tokens}, K = {red.num_kept}, signals = {red.signals.numel()}")
    print(f"first anchors (selection order): {red.anchor_order[:8].tolist()}")
    print(f"CSR x 100 = {100 * csr_score(full, reduced, adapter.question_embeddings(question)):.2f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).with_name("astronaut.jpg")))
