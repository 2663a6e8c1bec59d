"""transformers' own batched ``generate``, with and without CaRe's reduction (the drop-in context manager).

    python examples/dropin_generate.py                      # the embedded demo, on the CPU
    python examples/dropin_generate.py --model tiny-qwen2.5-vl --keep 32

With a real checkpoint, ``model`` and ``processor`` come from transformers as usual
(``LlavaNextForConditionalGeneration.from_pretrained(...)``, ``AutoProcessor.from_pretrained(...)``); here the demo's
are taken from care's loader so that the example runs offline. Prints each answer with all visual tokens and with
K of them. Writes nothing.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import care_core
from care_core.backbones import load_backbone
from care_core.images import load_image

EXAMPLES = Path(__file__).resolve().parent
QUESTIONS = ["What is the person holding?", "What animal is this?", "What is in the cup?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-llava", help="a demo name or a local model folder")
    parser.add_argument("--keep", type=int, default=64, help="visual tokens kept per image (K)")
    args = parser.parse_args()

    demo = load_backbone(args.model, device="cpu")
    model, processor = demo.model, demo.processor
    images = [load_image(EXAMPLES / name) for name in ("astronaut.jpg", "chelsea.jpg", "coffee.jpg")]
    prompts = [demo.prompt(q) for q in QUESTIONS]  # the model's chat template, one image placeholder each
    inputs = processor(images=images, text=prompts, return_tensors="pt", padding=True, padding_side="left")
    prompt_length = inputs["input_ids"].shape[1]

    full = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    with care_core.reduce_visual_tokens(model, processor=processor, method="care", keep=args.keep) as reduction:
        reduced = model.generate(**inputs, max_new_tokens=8, do_sample=False)  # same call, K rows per image
    for i, question in enumerate(QUESTIONS):
        kept = reduction.results[i].token_index.numel()
        answers = [processor.decode(out[i, prompt_length:], skip_special_tokens=True) for out in (full, reduced)]
        print(f"{question}\n  all tokens: {answers[0]!r}\n  K = {kept}: {answers[1]!r}")
    print(f"({demo.demo_note})" if demo.demo_note else "")


if __name__ == "__main__":
    main()
