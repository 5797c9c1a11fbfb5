"""Drawn clips whose truth is known: the trained demo model's data and its scorer's ground truth.

One object (a circle, square or triangle) of one colour moves left, right, up or down, or stands
still, on a plain background; the prompt says so ("a red circle moving left on a black
background"). Every combination of the words is a valid prompt (:func:`parse_prompt` reads any
of them back); a white object on a white background is drawn, but nobody can see it, so the
scorer's prompt set leaves that pair out. Pure numpy, seeded: the same seed draws the same clip.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

SHAPES = ("circle", "square", "triangle")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 45, 40), "green": (45, 190, 70), "blue": (45, 85, 230),
    "yellow": (240, 215, 45), "white": (250, 250, 250),
}
BACKGROUNDS: dict[str, tuple[int, int, int]] = {"black": (12, 12, 12), "white": (242, 242, 242),
                                                 "gray": (128, 128, 128)}
MOTIONS = ("left", "right", "up", "down", "still")
# unit steps in (x, y) image coordinates: y grows downwards
DIRECTIONS: dict[str, tuple[int, int]] = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1),
                                          "still": (0, 0)}
SUPERSAMPLE = 3  # sub-pixel samples per side: smooth edges, so the VAE sees no aliasing


@dataclass(frozen=True)
class ClipSpec:
    """What one clip shows: the words of its prompt."""

    shape: str
    colour: str
    motion: str
    background: str

    def __post_init__(self) -> None:
        for name, value, allowed in (("shape", self.shape, SHAPES), ("colour", self.colour, COLOURS),
                                     ("motion", self.motion, MOTIONS),
                                     ("background", self.background, BACKGROUNDS)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {sorted(allowed)}, got {value!r}")

    @property
    def prompt(self) -> str:
        verb = "standing still" if self.motion == "still" else f"moving {self.motion}"
        return f"a {self.colour} {self.shape} {verb} on a {self.background} background"

    @property
    def visible(self) -> bool:
        """False only for a white object on a white background."""
        return not (self.colour == "white" and self.background == "white")


def all_specs() -> list[ClipSpec]:
    """Every combination of the words (225), in a fixed order."""
    return [ClipSpec(s, c, m, b) for s, c, m, b in itertools.product(SHAPES, COLOURS, MOTIONS, BACKGROUNDS)]


def parse_prompt(prompt: str) -> ClipSpec:
    """The spec a prompt names: "<background> background" and, before it, a colour, a shape and a
    motion word ("still" or a direction), in any order and among any other words."""
    words = prompt.lower().replace(",", " ").replace(".", " ").split()
    at = words.index("background") if "background" in words else 0
    if at == 0 or words[at - 1] not in BACKGROUNDS:
        raise ValueError(f"prompt {prompt!r} names no background (one of {sorted(BACKGROUNDS)}, "
                         "then the word 'background')")
    rest = words[:at - 1]

    def first(kind: str, allowed: tuple[str, ...] | dict[str, object]) -> str:
        for w in rest:
            if w in allowed:
                return w
        raise ValueError(f"prompt {prompt!r} names no {kind} (one of {sorted(allowed)})")

    return ClipSpec(first("shape", SHAPES), first("colour", COLOURS), first("motion", MOTIONS), words[at - 1])


def _mask(shape: str, xs: np.ndarray, ys: np.ndarray, cx: float, cy: float, r: float) -> np.ndarray:
    dx, dy = xs - cx, ys - cy
    if shape == "circle":
        return dx * dx + dy * dy <= r * r
    if shape == "square":
        half = r * 0.85
        return (np.abs(dx) <= half) & (np.abs(dy) <= half)
    top, base = -r, r * 0.75  # an upright triangle, apex at the top
    t = (dy - top) / (base - top)
    return (dy >= top) & (dy <= base) & (np.abs(dx) <= t * r)


def draw_clip(spec: ClipSpec, seed: int, frames: int = 17, height: int = 64, width: int = 64) -> np.ndarray:
    """A [frames, height, width, 3] uint8 clip of ``spec``; ``seed`` picks size, speed and place."""
    rng = np.random.default_rng(seed)
    side = min(height, width)
    r = side * rng.uniform(0.11, 0.17)
    speed = side * rng.uniform(0.022, 0.036)  # per frame: 1.4-2.3 px at 64 px
    ux, uy = DIRECTIONS[spec.motion]
    travel = speed * (frames - 1)
    margin = r + 2

    def start(size: int, u: int) -> float:
        if u == 0:
            return rng.uniform(margin, size - margin)
        lo, hi = margin, size - margin - travel
        first = rng.uniform(lo, max(lo, hi))
        return first if u > 0 else size - first

    x0, y0 = start(width, ux), start(height, uy)
    ss = SUPERSAMPLE
    ys, xs = np.mgrid[0:height * ss, 0:width * ss].astype(np.float32)
    xs, ys = (xs + 0.5) / ss, (ys + 0.5) / ss
    fg = np.asarray(COLOURS[spec.colour], np.float32)
    bg = np.asarray(BACKGROUNDS[spec.background], np.float32)
    out = np.empty((frames, height, width, 3), np.uint8)
    for f in range(frames):
        cover = _mask(spec.shape, xs, ys, x0 + ux * speed * f, y0 + uy * speed * f, r).astype(np.float32)
        cover = cover.reshape(height, ss, width, ss).mean(axis=(1, 3))[..., None]
        out[f] = np.clip(np.rint(bg + (fg - bg) * cover), 0, 255).astype(np.uint8)
    return out


def dataset(count: int, seed: int, frames: int = 17, height: int = 64,
            width: int = 64) -> tuple[np.ndarray, list[ClipSpec]]:
    """``count`` clips cycling through every spec (each spec's clips differ by their seed)."""
    specs = all_specs()
    rng = np.random.default_rng(seed)
    order = rng.permutation(count) % len(specs)
    chosen = [specs[i] for i in order]
    clips = np.stack([draw_clip(s, int(rng.integers(2**31)), frames, height, width) for s in chosen])
    return clips, chosen
