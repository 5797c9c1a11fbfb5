"""A tqdm bar behind the ``(done, total)`` callbacks the offload library and the quantizer take."""

from __future__ import annotations

from collections.abc import Callable


def progress_bar(desc: str, unit: str) -> Callable[[int, int], None]:
    """A callback that moves one bar to ``done`` of ``total`` and closes it at the end."""
    from tqdm import tqdm

    bar = tqdm(desc=desc, unit=unit, leave=False)

    def update(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    return update
