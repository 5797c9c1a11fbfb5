"""Synthetic clips for the encode benchmark (bench_encode.py): numpy only, the same arrays on every host.

``noise``: uniform random pixels, what the demo models' random weights decode to and the
slowest thing x264 meets (nothing to predict). ``smooth``: a low-frequency colour field
panning 2 px right and 1 px down per frame, with a slow brightness drift, closer to what
a real video model makes (motion x264 can predict). Both are seeded, so every process
and host builds the same frames; ``frames_sha256`` proves it in the results.
"""

from __future__ import annotations

import hashlib

import numpy as np

KINDS = ("noise", "smooth")


def noise(t: int, h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (t, h, w, 3), dtype=np.uint8)


def smooth(t: int, h: int, w: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    k = rng.uniform(0.004, 0.03, size=(3, 4, 2)).astype(np.float32)  # 4 waves per channel
    phase = rng.uniform(0, 2 * np.pi, size=(3, 4)).astype(np.float32)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    out = np.empty((t, h, w, 3), dtype=np.uint8)
    for i in range(t):
        xs, ys = x + 2.0 * i, y + 1.0 * i
        for c in range(3):
            v = sum(np.sin(k[c, j, 0] * xs + k[c, j, 1] * ys + phase[c, j]) for j in range(4))
            out[i, :, :, c] = np.clip(128 + 28 * v + 10 * np.sin(i / 9 + c), 0, 255).astype(np.uint8)
    return out


def clip(kind: str, t: int, h: int, w: int, seed: int = 0) -> np.ndarray:
    """uint8 [t, h, w, 3] frames of ``kind`` (one of ``KINDS``)."""
    if kind == "noise":
        return noise(t, h, w, seed)
    if kind == "smooth":
        return smooth(t, h, w, seed)
    raise ValueError(f"clip kind must be one of {KINDS}, got {kind!r}")


def frames_sha256(frames: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(frames).tobytes()).hexdigest()
