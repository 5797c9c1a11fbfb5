"""Score a generated clip against the prompt it was made from (the trained demo model's quality).

What a person checks at a glance, measured: the background's colour (the border's median), the
object's colour (the mean of the pixels far from the background), its motion (the slope of its
centroid over the frames, or none), its shape (how much of its bounding box it fills) and how
smoothly it moves (the centroid's frame-to-frame acceleration). Tested on the drawn clips of
``clips.py``, whose truth is known.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .clips import BACKGROUNDS, COLOURS, ClipSpec

OBJECT_DISTANCE = 70.0  # RGB distance from the background that counts as the object
STILL_SPEED = 0.006  # centroid speed (of the frame's side per frame) under which it stands still
FILL = {"triangle": 0.5, "circle": np.pi / 4, "square": 1.0}  # area / bounding box


@dataclass(frozen=True)
class ClipScore:
    """What was seen in one clip; the ``*_ok`` fields compare it with the prompt's words."""

    background: str
    colour: str | None
    motion: str | None
    shape: str | None
    jitter: float  # median |centroid acceleration| in pixels per frame^2 (drawn clips: ~0)
    seen_frames: float  # share of frames where an object was found
    background_ok: bool
    colour_ok: bool
    motion_ok: bool
    shape_ok: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _nearest(rgb: np.ndarray, table: dict[str, tuple[int, int, int]]) -> str:
    names = list(table)
    d = [float(np.linalg.norm(rgb - np.asarray(table[n], np.float32))) for n in names]
    return names[int(np.argmin(d))]


def _shape(mask: np.ndarray) -> str | None:
    ys, xs = np.nonzero(mask)
    if len(xs) < 6:
        return None
    box = (xs.max() - xs.min() + 1) * (ys.max() - ys.min() + 1)
    fill = len(xs) / box
    return min(FILL, key=lambda n: abs(FILL[n] - fill))


def score_clip(frames: np.ndarray, spec: ClipSpec) -> ClipScore:
    """``frames``: [F, H, W, 3] uint8 (the decoded video); ``spec``: what the prompt asked for."""
    clip = np.asarray(frames, np.float32)
    f, h, w, _ = clip.shape
    border = np.concatenate([clip[:, 0], clip[:, -1], clip[:, :, 0], clip[:, :, -1]], axis=1)
    bg_rgb = np.median(border.reshape(-1, 3), axis=0)
    background = _nearest(bg_rgb, BACKGROUNDS)
    far = np.linalg.norm(clip - bg_rgb, axis=-1) > OBJECT_DISTANCE  # [F, H, W]
    counts = far.reshape(f, -1).sum(axis=1)
    seen = counts >= max(4, h * w // 400)
    colour = motion = shape = None
    jitter = 0.0
    if seen.any():
        colour = _nearest(clip[far].mean(axis=0), COLOURS)
        ys, xs = np.mgrid[0:h, 0:w]
        idx = np.nonzero(seen)[0]
        cx = np.array([xs[far[i]].mean() for i in idx])
        cy = np.array([ys[far[i]].mean() for i in idx])
        if len(idx) >= 2:
            vx, vy = np.polyfit(idx, cx, 1)[0], np.polyfit(idx, cy, 1)[0]
        else:
            vx = vy = 0.0
        side = min(h, w)
        if max(abs(vx), abs(vy)) < STILL_SPEED * side:
            motion = "still"
        elif abs(vx) >= abs(vy):
            motion = "right" if vx > 0 else "left"
        else:
            motion = "down" if vy > 0 else "up"
        if len(idx) >= 3:
            acc = np.hypot(np.diff(cx, 2), np.diff(cy, 2))
            jitter = float(np.median(acc))
        shape = _shape(far[idx[len(idx) // 2]])
    return ClipScore(background=background, colour=colour, motion=motion, shape=shape, jitter=jitter,
                     seen_frames=float(seen.mean()), background_ok=background == spec.background,
                     colour_ok=colour == spec.colour, motion_ok=motion == spec.motion,
                     shape_ok=shape == spec.shape)


def prompt_set() -> list[ClipSpec]:
    """The fixed prompt set quality is measured on: 50 visible specs, every colour with every
    motion twice, shapes and backgrounds in turn (white on white left out: nobody can see it)."""
    from .clips import MOTIONS, SHAPES

    specs: list[ClipSpec] = []
    bgs = list(BACKGROUNDS)
    i = 0
    for colour in COLOURS:
        for motion in MOTIONS:
            for _ in range(2):
                bg = bgs[i % len(bgs)]
                if colour == "white" and bg == "white":
                    bg = bgs[(i + 1) % len(bgs)]
                specs.append(ClipSpec(SHAPES[i % len(SHAPES)], colour, motion, bg))
                i += 1
    return specs


def summarise(scores: list[ClipScore]) -> dict[str, float]:
    """Accuracies over a set of scored clips (0-1), and the median jitter."""
    n = max(1, len(scores))
    return {
        "clips": len(scores),
        "colour": sum(s.colour_ok for s in scores) / n,
        "motion": sum(s.motion_ok for s in scores) / n,
        "background": sum(s.background_ok for s in scores) / n,
        "shape": sum(s.shape_ok for s in scores) / n,
        "all_three": sum(s.colour_ok and s.motion_ok and s.background_ok for s in scores) / n,
        "jitter_px": float(np.median([s.jitter for s in scores])) if scores else 0.0,
    }
