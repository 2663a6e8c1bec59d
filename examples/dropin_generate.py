"""transformers' own batched ``generate``, with and without CaRe's reduction (the drop-in context manager).

    python examples/dropin_generate.py                      # the embedded demo, on the CPU
    python examples/dropin_generate.py --model tiny-qwen2.5-vl --keep 32

With a real checkpoint, ``model`` and ``processor`` come from transformers as usual
(``LlavaNextForConditionalGeneration.from_pretrained(...)``, ``AutoProcessor.from_pretrained(...)``); here the demo's
are taken from care's loader so that the example runs offline. The demos know only coloured shapes, so they are
asked about ``shapes.png``; a real model about three photos. Prints each answer with all visual tokens and with K of
them. Writes nothing. A model the drop-in does not serve, or a bad argument: one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import care_core
from care_core.backbones import load_backbone
from care_core.errors import CareError
from care_core.images import load_image

EXAMPLES = Path(__file__).resolve().parent
MAX_NEW_TOKENS = 12  # the demos spell one character per token: "triangle" takes 9 with its space
# (image, question): the demos' shapes scene (a cyan cross and a red triangle), or photos for a real model
SHAPES = [("shapes.png", "What colour is the cross?"), ("shapes.png", "What shape is red?"),
          ("shapes.png", "Is the red triangle at the top or the bottom?")]  # fmt: skip
PHOTOS = [("astronaut.jpg", "What is the person holding?"), ("chelsea.jpg", "What animal is this?"),
          ("coffee.jpg", "What is in the cup?")]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-llava", help="a demo name or a local model folder")
    parser.add_argument("--keep", type=int, default=64, help="visual tokens kept per image (K)")
    args = parser.parse_args()
    try:
        run(args.model, args.keep)
    except CareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def run(name: str, keep: int) -> None:
    demo = load_backbone(name, device="cpu")
    model, processor = demo.model, demo.processor
    # made (and checked: a model the drop-in cannot serve, a bad budget) before anything is generated
    reduction = care_core.reduce_visual_tokens(model, processor=processor, method="care", keep=keep)
    asked = SHAPES if demo.is_demo else PHOTOS
    images = [load_image(EXAMPLES / image) for image, _ in asked]
    # the chat template with the placeholder the processor expands, one image per prompt (a list per prompt)
    prompts = [demo.processor_prompt(question) for _, question in asked]
    inputs = processor(images=[[image] for image in images], text=prompts, return_tensors="pt", padding=True,
                       padding_side="left")  # fmt: skip
    prompt_length = inputs["input_ids"].shape[1]

    full = model.generate(**inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    with reduction:  # the same call; the language model sees K visual rows per image
        reduced = model.generate(**inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    for i, (image, question) in enumerate(asked):
        kept = reduction.results[i].token_index.numel()
        answers = [processor.decode(out[i, prompt_length:], skip_special_tokens=True) for out in (full, reduced)]
        print(f"{image}: {question}\n  all tokens: {answers[0]!r}\n  K = {kept}: {answers[1]!r}")
    print(f"({demo.demo_note})" if demo.demo_note else "")


if __name__ == "__main__":
    raise SystemExit(main())
