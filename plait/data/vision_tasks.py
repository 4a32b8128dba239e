"""Built-in tasks with generated images, for vision-language models; tasks.py writes their rows.

Each question function draws one small RGB picture with PIL from the rng and returns a `Drawn`:
the prompt text with verl's `<image>` placeholder, the answer, the picture. The rows follow verl's
geo3k preprocessing (examples/data_preprocess/geo3k.py): a user turn with `<image>` in its text and
an `images` column of `{"bytes": PNG, "path": None}`, one per placeholder.

- `larger_shape`: a red and a blue square (or disc) of clearly different sizes on white; the answer is
  one letter, "r" (red) or "b" (blue), whichever is larger: one token of a character tokenizer, so GRPO's
  reward and loss sit on the one token that decides (docs/vlm.md "The VL demo"). The difference of the red and blue areas is the difference of the
  image's mean red and blue channels, so a tiny model built from a config can pick it up on a CPU.
  Supervised on the first answer token, a Qwen2-VL with a 64-wide text model and one vision block
  built from a config reached 0.98 validation accuracy in 50 steps of 32 rows (majority answer: 0.58).
- `count_dots`: 1 to 4 black dots of one size on white; the count. Harder: the same model and
  training stayed at chance after 150 steps (0.23; majority answer 0.34).
- `geo3k_synthetic`: a geometry figure (a right triangle, a triangle's angles, a rectangle, a
  circle) with its lengths written on it, and a geometry3k-style question about it ("Find x.");
  data_source `hiyouga/geometry3k`, so verl's geometry3k reward scores it. These are NOT
  Geometry3k: a handful of templates, for tests and demos of verl's geo3k command line.

Left out: videos, several images per row, and anything a model needs text in the image to solve
except geo3k_synthetic's labels.
"""

from __future__ import annotations

import functools
import hashlib
import math
import random
from typing import NamedTuple

from PIL import Image, ImageDraw, ImageFont

SIZE = 56  # pixels a side: 4 x 4 patches of 14 for Qwen2-VL, its smallest image (min_pixels 56 * 56)
GEO_SIZE = 112  # geometry figures carry written labels
WHITE, RED, BLUE, BLACK = (255, 255, 255), (220, 30, 30), (30, 60, 220), (0, 0, 0)

LARGER_PROMPT = "<image>Which shape is larger, the red one or the blue one? Answer r for red or b for blue."
COUNT_PROMPT = "<image>How many dots are in the picture? Answer with a number."
# verl's examples/data_preprocess/geo3k.py appends this instruction to every geometry3k problem;
# the rows here carry it too, so the geo3k reward's format part (<think> ... \boxed{}) applies as there.
GEO3K_INSTRUCTION = (r"You FIRST think about the reasoning process as an internal monologue and then provide the "
                     r"final answer. The reasoning process MUST BE enclosed within <think> </think> tags. "
                     r"The final answer MUST BE put in \boxed{}.")
GEO3K_SOURCE = "hiyouga/geometry3k"


class Drawn(NamedTuple):
    """One generated question. A text task's question function returns (text, answer) only."""
    text: str
    answer: str
    images: tuple = ()       # PIL RGB images, one per `<image>` in text
    extra: dict | None = None  # added to the row's extra_info (geo3k rows: "answer", "question")


def identity(text: str, images: tuple | list) -> str:
    """What makes two questions the same: the text and the pixels of each image (not the PNG bytes,
    which change with the zlib version); tasks.py splits train and test by it."""
    digests = [hashlib.sha256(image.tobytes()).hexdigest()[:16] for image in images]
    return "\n".join([text, *digests])


def _canvas(size: int) -> tuple[Image.Image, ImageDraw.ImageDraw]:
    image = Image.new("RGB", (size, size), WHITE)
    return image, ImageDraw.Draw(image)


def larger_shape(rng: random.Random, size: int = SIZE) -> Drawn:
    """A red and a blue shape side by side, the larger at least 1.5 times the other's side."""
    small = rng.randint(size // 8, size // 4)
    large = rng.randint(math.ceil(small * 1.5), size // 2 - 2)
    red_larger = rng.random() < 0.5
    sides = {"red": large if red_larger else small, "blue": small if red_larger else large}
    disc = rng.random() < 0.5
    image, draw = _canvas(size)
    left = rng.choice(["red", "blue"])  # each shape in its own half: they never overlap
    for colour, x0 in ((left, 0), ("blue" if left == "red" else "red", size // 2)):
        side = sides[colour]
        x = x0 + rng.randint(1, size // 2 - side - 1)
        y = rng.randint(1, size - side - 1)
        box = (x, y, x + side - 1, y + side - 1)
        fill = RED if colour == "red" else BLUE
        draw.ellipse(box, fill=fill) if disc else draw.rectangle(box, fill=fill)
    return Drawn(LARGER_PROMPT, "r" if red_larger else "b", (image,))


def count_dots(rng: random.Random, size: int = SIZE, most: int = 4) -> Drawn:
    """1 to `most` black dots of one radius, apart from each other and the border."""
    radius = max(2, size // 14)
    count = rng.randint(1, most)
    centres: list[tuple[int, int]] = []
    while len(centres) < count:  # rejection: a few draws at these sizes
        c = (rng.randint(radius + 1, size - radius - 2), rng.randint(radius + 1, size - radius - 2))
        if all(math.dist(c, o) > 2 * radius + 2 for o in centres):
            centres.append(c)
    image, draw = _canvas(size)
    for x, y in centres:
        draw.ellipse((x - radius, y - radius, x + radius, y + radius), fill=BLACK)
    return Drawn(COUNT_PROMPT, str(count), (image,))


@functools.lru_cache(maxsize=None)
def _font(size: int) -> ImageFont.ImageFont:
    return ImageFont.load_default(size=size)


def _label(draw: ImageDraw.ImageDraw, xy: tuple[float, float], text: str, size: int) -> None:
    draw.text(xy, text, fill=BLACK, font=_font(max(8, size // 9)), anchor="mm")


PYTHAGOREAN = ((3, 4, 5), (5, 12, 13), (8, 15, 17), (7, 24, 25), (6, 8, 10), (9, 12, 15), (20, 21, 29))


def _right_triangle(rng: random.Random, size: int) -> tuple[Image.Image, str, str]:
    k = rng.randint(1, 4)
    a, b, c = (k * n for n in rng.choice(PYTHAGOREAN))
    image, draw = _canvas(size)
    m = size // 6
    corner, top, right = (m, size - m), (m, m), (size - m, size - m)
    draw.polygon([corner, top, right], outline=BLACK, width=2)
    draw.rectangle((m, size - m - 8, m + 8, size - m), outline=BLACK)  # the right angle
    _label(draw, (m // 2, size // 2), str(a), size)
    _label(draw, (size // 2, size - m // 2), str(b), size)
    _label(draw, (size // 2 + m // 2, size // 2 - m // 2), "x", size)
    return image, "<image>Find x.", str(c)


def _angles(rng: random.Random, size: int) -> tuple[Image.Image, str, str]:
    a, b = rng.randint(30, 80), rng.randint(30, 80)
    image, draw = _canvas(size)
    m = size // 6
    left, right, apex = (m, size - m), (size - m, size - m), (rng.randint(2 * m, size - 2 * m), m)
    draw.polygon([left, right, apex], outline=BLACK, width=2)
    _label(draw, (left[0] + m, left[1] - m // 2), f"{a}°", size)
    _label(draw, (right[0] - m, right[1] - m // 2), f"{b}°", size)
    _label(draw, (apex[0], apex[1] + m), "x°", size)
    return image, "<image>Find x.", str(180 - a - b)


def _rectangle(rng: random.Random, size: int) -> tuple[Image.Image, str, str]:
    w, h = rng.randint(2, 20), rng.randint(2, 20)
    image, draw = _canvas(size)
    m = size // 5
    draw.rectangle((m, m, size - m, size - m), outline=BLACK, width=2)
    _label(draw, (size // 2, m // 2), f"{w} ft", size)
    _label(draw, (size - m // 2, size // 2), f"{h} ft", size)
    if rng.random() < 0.5:
        return image, "<image>Find the area of the figure.", str(w * h)
    return image, "<image>Find the perimeter of the rectangle.", str(2 * (w + h))


def _circle(rng: random.Random, size: int) -> tuple[Image.Image, str, str]:
    r = rng.randint(2, 15)
    image, draw = _canvas(size)
    m = size // 6
    draw.ellipse((m, m, size - m, size - m), outline=BLACK, width=2)
    draw.line((size // 2, size // 2, size - m, size // 2), fill=BLACK, width=2)
    _label(draw, (size // 2 + size // 6, size // 2 - m // 2), f"{r} in.", size)
    return image, "<image>Find the circumference of the circle. Round to the nearest tenth.", f"{2 * math.pi * r:.1f}"


def geometry_problem(rng: random.Random, size: int = GEO_SIZE) -> Drawn:
    """A geometry3k-style problem on a drawn figure, in verl's geo3k row layout; the answer a number."""
    image, problem, answer = rng.choice((_right_triangle, _angles, _rectangle, _circle))(rng, size)
    return Drawn(f"{problem} {GEO3K_INSTRUCTION}", answer, (image,), {"answer": answer, "question": problem})
