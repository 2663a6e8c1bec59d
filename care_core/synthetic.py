"""A seeded synthetic world for the demo backbones: coloured shapes on textured or photographic backgrounds,
with one-word questions about them.

Everything is generated on demand from ``(seed, index)``: the same pair always gives the same image and the same
questions, independently of any other scene, so a split is just a seed (training uses one seed, the held-out
split another). Nothing here reads or writes files; photographic backgrounds are passed in as PIL images.

Shapes sit inside the image's central square (inset by a margin), so every backbone sees them, also LLaVA-1.5
whose processor centre-crops that square. Position words refer to the whole image (its centre lines are the
central square's).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from PIL import Image, ImageDraw

if TYPE_CHECKING:
    import torch

T = TypeVar("T")

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "cross")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (225, 30, 35),
    "green": (30, 175, 60),
    "blue": (35, 75, 235),
    "yellow": (245, 225, 30),
    "purple": (150, 45, 205),
    "cyan": (35, 215, 225),
}
#: object size classes: (name, smallest, largest) side as a fraction of the central square's side
SIZES: tuple[tuple[str, float, float], ...] = (("small", 0.09, 0.12), ("medium", 0.15, 0.2), ("large", 0.23, 0.28))
#: (height, width) of the generated images: the backbones' real input sizes and other aspect ratios
IMAGE_SIZES: tuple[tuple[int, int], ...] = (
    (336, 336),
    (336, 336),
    (448, 448),
    (672, 672),
    (336, 504),
    (504, 336),
    (384, 512),
    (480, 360),
    (336, 672),
)
POSITION = "position"  # the type of the left/right and top/bottom questions
QUESTION_TYPES: tuple[str, ...] = ("colour", "shape", "exists", "count", POSITION)
MAX_OBJECTS = 4
_POSITION_MARGIN = 0.1  # an object's centre at least this far (fraction of the square) from a centre line


@dataclass(frozen=True)
class SceneObject:
    shape: str
    colour: str
    size: str
    center: tuple[float, float]  # (x, y) pixels in the image
    side: float  # bounding-box side in pixels

    @property
    def name(self) -> str:
        return f"{self.colour} {self.shape}"


@dataclass(frozen=True)
class QA:
    question: str
    answer: str  # one word, lower case
    type: str  # one of QUESTION_TYPES


@dataclass(frozen=True)
class Scene:
    seed: int
    index: int
    image: Image.Image
    objects: tuple[SceneObject, ...]
    questions: tuple[QA, ...] = field(default=())  # at most one per type, in QUESTION_TYPES order


def _background(rng: np.random.Generator, height: int, width: int, photos: Sequence[Image.Image]) -> np.ndarray:
    """(H, W, 3) uint8: a crop of a dimmed, desaturated photo, or a muted texture (noise, stripes, checks)."""
    kind = int(rng.integers(0, 4 if photos else 3))
    if kind == 3:
        photo = photos[int(rng.integers(0, len(photos)))].convert("RGB")
        pw, ph = photo.size
        scale = max(width / pw, height / ph) * float(rng.uniform(1.0, 1.6))
        rw, rh = max(width, round(pw * scale)), max(height, round(ph * scale))
        x0, y0 = int(rng.integers(0, rw - width + 1)), int(rng.integers(0, rh - height + 1))
        crop = photo.resize((rw, rh), Image.Resampling.BILINEAR).crop((x0, y0, x0 + width, y0 + height))
        arr = np.asarray(crop, dtype=np.float32)
        grey = arr.mean(axis=2, keepdims=True)
        arr = 0.3 * arr + 0.7 * grey  # keep the texture, drop most of the colour
        return np.clip(0.55 * arr + 50, 0, 255).astype(np.uint8)
    base = rng.uniform(60, 190, size=3)
    base = 0.35 * base + 0.65 * base.mean()  # muted, so the shapes' colours stay unambiguous
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    if kind == 0:
        pattern = np.zeros((height, width), dtype=np.float32)
    elif kind == 1:
        period = float(rng.uniform(12, 48))
        angle = float(rng.uniform(0, np.pi))
        pattern = 25 * np.sin((xx * np.cos(angle) + yy * np.sin(angle)) * 2 * np.pi / period)
    else:
        cell = int(rng.integers(16, 64))
        pattern = np.where(((xx // cell) + (yy // cell)) % 2 == 0, 18.0, -18.0).astype(np.float32)
    noise = rng.normal(0, float(rng.uniform(4, 18)), size=(height, width, 1)).astype(np.float32)
    arr = base[None, None, :].astype(np.float32) + pattern[..., None] + noise
    return np.clip(arr, 0, 255).astype(np.uint8)


def draw_object(draw: ImageDraw.ImageDraw, obj: SceneObject, fill: tuple[int, int, int] | None = None) -> None:
    """Draw ``obj`` in its colour (or ``fill``, e.g. to paint a label map)."""
    x, y = obj.center
    h = obj.side / 2
    fill = COLOURS[obj.colour] if fill is None else fill
    if obj.shape == "circle":
        draw.ellipse((x - h, y - h, x + h, y + h), fill=fill)
    elif obj.shape == "square":
        s = h * 0.85  # same visual mass as the circle
        draw.rectangle((x - s, y - s, x + s, y + s), fill=fill)
    elif obj.shape == "triangle":
        draw.polygon([(x, y - h), (x + h, y + h * 0.8), (x - h, y + h * 0.8)], fill=fill)
    elif obj.shape == "cross":
        t = h * 0.36
        draw.rectangle((x - h, y - t, x + h, y + t), fill=fill)
        draw.rectangle((x - t, y - h, x + t, y + h), fill=fill)
    else:  # pragma: no cover - SHAPES is closed
        raise ValueError(obj.shape)


def label_image(scene: Scene) -> Image.Image:
    """An RGB image of the scene's size whose red channel holds 1 + the index of the object drawn at each pixel
    (0: background); for dense supervision during training."""
    image = Image.new("RGB", scene.image.size, (0, 0, 0))
    draw = ImageDraw.Draw(image)
    for i, obj in enumerate(scene.objects):
        draw_object(draw, obj, fill=(i + 1, 0, 0))
    return image


def _place(rng: np.random.Generator, height: int, width: int, count: int) -> list[SceneObject]:
    side = min(height, width)
    ox, oy = (width - side) / 2, (height - side) / 2
    objects: list[SceneObject] = []
    combos = [(s, c) for s in SHAPES for c in COLOURS]
    for _ in range(count):
        for _attempt in range(60):
            size_name, lo, hi = SIZES[int(rng.integers(0, len(SIZES)))]
            length = float(rng.uniform(lo, hi)) * side
            margin = length / 2 + 0.04 * side
            cx = ox + float(rng.uniform(margin, side - margin))
            cy = oy + float(rng.uniform(margin, side - margin))
            clear = all(
                max(abs(cx - o.center[0]), abs(cy - o.center[1])) > (length + o.side) / 2 + 0.03 * side for o in objects
            )
            if clear:
                shape, colour = combos[int(rng.integers(0, len(combos)))]
                objects.append(SceneObject(shape, colour, size_name, (cx, cy), length))
                break
    return objects


def _plural(shape: str) -> str:
    return shape + ("es" if shape.endswith("s") else "s")


def _questions(rng: np.random.Generator, objects: Sequence[SceneObject], height: int, width: int) -> list[QA]:
    """One question of each type that the scene can answer unambiguously (drawn with ``rng``)."""
    out: list[QA] = []
    shape_count = {s: sum(o.shape == s for o in objects) for s in SHAPES}
    colour_count = {c: sum(o.colour == c for o in objects) for c in COLOURS}

    def pick(items: Sequence[T]) -> T:
        return items[int(rng.integers(0, len(items)))]

    unique_shapes = [o for o in objects if shape_count[o.shape] == 1]
    if unique_shapes:
        o = pick(unique_shapes)
        assert isinstance(o, SceneObject)
        out.append(QA(f"What colour is the {o.shape}?", o.colour, "colour"))
    unique_colours = [o for o in objects if colour_count[o.colour] == 1]
    if unique_colours:
        o = pick(unique_colours)
        assert isinstance(o, SceneObject)
        out.append(QA(f"What shape is {o.colour}?", o.shape, "shape"))
    present = {(o.shape, o.colour) for o in objects}
    if rng.random() < 0.5 and objects:
        o = pick(list(objects))
        assert isinstance(o, SceneObject)
        out.append(QA(f"Is there a {o.colour} {o.shape}?", "yes", "exists"))
    else:
        absent = [(s, c) for s in SHAPES for c in COLOURS if (s, c) not in present]
        # mostly near misses: the shape or the colour is in the scene, the pair is not
        near = [(s, c) for s, c in absent if shape_count[s] or colour_count[c]]
        s, c = pick(near if near and rng.random() < 0.7 else absent)
        out.append(QA(f"Is there a {c} {s}?", "no", "exists"))
    if rng.random() < 0.5:
        out.append(QA("How many shapes are there?", str(len(objects)), "count"))
    else:
        shape = str(pick(SHAPES))
        out.append(QA(f"How many {_plural(shape)} are there?", str(shape_count[shape]), "count"))
    side = min(height, width)
    named = [o for o in objects if sum(p.name == o.name for p in objects) == 1]
    horizontal = [o for o in named if abs(o.center[0] - width / 2) > _POSITION_MARGIN * side]
    vertical = [o for o in named if abs(o.center[1] - height / 2) > _POSITION_MARGIN * side]
    options = [("h", o) for o in horizontal] + [("v", o) for o in vertical]
    if options:
        axis, o = pick(options)
        if axis == "h":
            answer = "left" if o.center[0] < width / 2 else "right"
            out.append(QA(f"Is the {o.name} on the left or the right?", answer, POSITION))
        else:
            answer = "top" if o.center[1] < height / 2 else "bottom"
            out.append(QA(f"Is the {o.name} at the top or the bottom?", answer, POSITION))
    return out


def _scene_rng(seed: int, index: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), int(index), 7919])


def _drawn_size(rng: np.random.Generator) -> tuple[int, int]:
    """The scene's (height, width): the first draw of its generator."""
    return IMAGE_SIZES[int(rng.integers(0, len(IMAGE_SIZES)))]


def scene_size(seed: int, index: int) -> tuple[int, int]:
    """The (height, width) that ``make_scene(seed, index)`` draws, without drawing the scene (to lay out storage for
    a pool of scenes before they are drawn)."""
    return _drawn_size(_scene_rng(seed, index))


def make_scene(
    seed: int,
    index: int,
    *,
    size: tuple[int, int] | None = None,
    photos: Sequence[Image.Image] = (),
) -> Scene:
    """Scene ``index`` of split ``seed``: an RGB image, its objects and up to one question per type.

    ``size`` (height, width) overrides the drawn image size; ``photos`` are candidate backgrounds (a quarter of
    the scenes use a dimmed, desaturated crop of one when given). Deterministic in ``(seed, index, size, photos)``.
    """
    rng = _scene_rng(seed, index)
    height, width = size if size is not None else _drawn_size(rng)
    background = _background(rng, height, width, photos)
    count = int(rng.integers(1, MAX_OBJECTS + 1))
    objects = _place(rng, height, width, count)
    image = Image.fromarray(background, "RGB")
    draw = ImageDraw.Draw(image)
    for obj in objects:
        draw_object(draw, obj)
    questions = _questions(rng, objects, height, width)
    return Scene(seed, index, image, tuple(objects), tuple(questions))


def iter_questions(
    seed: int,
    count: int,
    *,
    photos: Sequence[Image.Image] = (),
    size: tuple[int, int] | None = None,
) -> Iterator[tuple[Scene, QA]]:
    """``count`` (scene, question) pairs of split ``seed``, types balanced: question i asks type i mod 5, taken
    from the next scene that has a question of that type."""
    index = 0
    for i in range(count):
        wanted = QUESTION_TYPES[i % len(QUESTION_TYPES)]
        while True:
            scene = make_scene(seed, index, size=size, photos=photos)
            index += 1
            qa = next((q for q in scene.questions if q.type == wanted), None)
            if qa is not None:
                yield scene, qa
                break


def answer_question(
    adapter: Any,
    tokens: Any,
    question: str,
    *,
    method: Any = None,
    keep: int | None = None,
    seed: int = 0,
    max_new_tokens: int = 10,
) -> tuple[str, torch.Tensor]:
    """Greedy answer of ``adapter`` to ``question`` about the image of ``tokens`` (its ImageTokens), through
    :class:`~care_core.pipeline.ReductionPipeline` -- the path of ``care reduce --generate``: with ``method`` (a
    registered method instance, its hyperparameters as given) and ``keep`` the pipeline reduces (probes, method,
    projector) and the language model gets only the method's K rows; without, all N projected rows. The answer is
    the pipeline's :meth:`~care_core.pipeline.ReductionPipeline.answer` (the adapter's ``generate``: replayed CUDA
    graphs where it can). Returns (answer text, the projected rows fed)."""
    import torch

    from .budget import Budget
    from .config import CaReConfig
    from .pipeline import ReductionPipeline

    pipe = ReductionPipeline(adapter, [] if method is None else [method], CaReConfig(seed=seed))
    with torch.no_grad():
        if method is None:
            projected, kept = adapter.projector(tokens.features), None
        else:
            budget = Budget.keep(int(keep if keep is not None else tokens.num_tokens))
            run = pipe(tokens, question, [budget]).runs[0]
            projected, kept = run.projected, run.result.token_index
        answer = pipe.answer(tokens, question, projected, kept, max_new_tokens=max_new_tokens)
    return answer.text, projected


def first_word(text: str) -> str:
    """The first word of a generated answer, lower case, without punctuation around it ("" if none)."""
    words = text.strip().split()
    return words[0].strip(".,;:!?\"'()").lower() if words else ""
