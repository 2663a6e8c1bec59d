"""Use the care library directly: encode an image with the demo backbone, reduce it, measure CSR.

    python examples/api_example.py examples/astronaut.jpg

The demo backbone has random weights: the numbers show the mechanics, not a real model's behaviour.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from care_cli.io import load_image
from care_core import CaReConfig, care_reduce, csr_score
from care_core.backbones import load_backbone


def main(path: str) -> None:
    adapter = load_backbone("tiny-llava")  # demo backbone: random weights, built on first use
    tokens = adapter.encode_image(load_image(Path(path)))
    config = CaReConfig(engine="jvp", seed=42)
    red = care_reduce(tokens.features, adapter.projector, tokens.positions, ratio=0.11, config=config)
    with torch.no_grad():
        full = adapter.projector(tokens.features)
        reduced = adapter.projector(red.tokens)
    question = adapter.question_embeddings("What is in the image?")
    print(f"N = {tokens.num_tokens}, K = {red.num_kept}, signals = {red.signals.numel()}")
    print(f"first anchors (selection order): {red.anchor_order[:8].tolist()}")
    print(f"CSR x 100 = {100 * csr_score(full, reduced, question):.2f}  (demo backbone: random weights)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).with_name("astronaut.jpg")))
