"""What an adapter file must be before its bytes are trusted: a regular file, finite numbers.

Split from ``lora`` (which reads the layouts) because these checks are about hostile or broken
input, not about LoRA formats: a FIFO or a device under ``--lora-dir`` would block a reader
forever, and NaN/Inf factors or a ``lora_alpha`` of 1e308, NaN, -1e6 or "8" would be served
as a black video marked ``completed`` (or fail on a rank with a ``TypeError``).
"""

from __future__ import annotations

import hashlib
import math
import os
import stat
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the file checks run in the front end, which starts without torch
    import torch

    from service.offload.lora import LoraFactors


class NotRegularFile(OSError):
    """The path is a FIFO, a socket, a device or a folder: never opened for reading."""


def kind_of(mode: int) -> str:
    for test, word in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return word
    return "not a regular file"


def check_regular(path: str | os.PathLike) -> None:
    """NotRegularFile unless ``path`` is a regular file (``stat`` never blocks on a FIFO);
    FileNotFoundError/PermissionError as ``os.stat`` raises them."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise NotRegularFile(f"the file is {kind_of(mode)}: adapters must be regular files")


def file_sha256(path: str | os.PathLike) -> str:
    """The file's digest, read through a descriptor opened without blocking (a FIFO swapped in
    after ``check_regular`` is refused here, not waited on)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(f"the file is {kind_of(mode)}: adapters must be regular files")
        h = hashlib.sha256()
        with os.fdopen(fd, "rb", closefd=False) as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        return h.hexdigest()
    finally:
        os.close(fd)


def factor_problem(what: str, value: object, integer: bool = False) -> str | None:
    """Why ``value`` cannot be a LoRA ``r`` (``integer``) or ``lora_alpha``, or None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"{what} must be a number, got {type(value).__name__} {value!r:.40}"
    if not math.isfinite(value) or value <= 0:
        return f"{what} must be a finite number > 0, got {value!r}"
    if integer and value != int(value):
        return f"{what} must be a whole number, got {value!r}"
    return None


def tensor_problem(t: torch.Tensor, dtype: torch.dtype) -> str | None:
    """Why ``t`` cannot be served in ``dtype`` (NaN, Inf, or a value over its range), or None."""
    import torch

    if t.numel() == 0:
        return None
    limit = torch.finfo(dtype).max if dtype.is_floating_point else math.inf
    ok = bool((t.detach().abs() <= limit).all())  # NaN compares False too
    if ok:
        return None
    bad = "NaN" if bool(torch.isnan(t).any()) else "Inf" if bool(torch.isinf(t).any()) else \
        f"values over {dtype}'s range ({limit:.3g})"
    return f"holds {bad}: a non-finite adapter would make every frame black"


def scaling_problem(factors: LoraFactors, dtype: torch.dtype, max_scale: float) -> str | None:
    """Why ``lora_alpha / r`` at the largest request scale would overflow ``dtype`` on B's
    largest entry (a ``lora_alpha`` of 1e308 is finite, and still a black video), or None."""
    import torch

    s = abs(factors.scaling(max_scale))
    peak = float(factors.up.detach().abs().amax()) if factors.up.numel() else 0.0
    limit = torch.finfo(dtype).max if dtype.is_floating_point else math.inf
    if math.isfinite(s) and s * peak <= limit:
        return None
    return (f"lora_alpha / r = {factors.alpha!r} / {factors.rank} scales B (max |B| {peak:.3g}) past "
            f"{dtype}'s range at scale {max_scale:g}: the video would be NaN")
