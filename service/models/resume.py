"""A request's state after a denoising step, as data a rerun starts from (models/rerun.py).

What a request needs to go on from step ``k`` is its latents after step ``k`` and the state
the loop keeps between steps (models/loop.py: the scheduler's history, the step cache's
residuals, the generator); the text embeddings, the timesteps (and so the expert of each
step) follow from the request again. ``StepState`` holds both as plain data that pickles
without torch: the latents' bytes (any dtype, bf16 included, kept bit for bit) and the loop's
tree as JSON with its tensors as raw bytes beside it (``Blob``), so a durable state file
(api/durable.py) is data, never code. Torch is imported only where a tensor or a dtype is
needed: the front end holds states as bytes and starts without it (api/deployment.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

    from .loop import Tree


def _dtype(name: str) -> torch.dtype:
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"{name!r} is not a tensor dtype")
    return dt


@dataclass(frozen=True)
class Blob:
    """One tensor (or numpy array) of the loop's state, as raw bytes; ``cpu``: it was on the
    host (a scheduler's sigmas) and goes back there, else onto the run's device."""

    dtype: str  # torch dtype name, or "np:<numpy dtype>" for a numpy array
    shape: tuple[int, ...]
    cpu: bool
    data: np.ndarray = field(repr=False)  # uint8

    @classmethod
    def of(cls, value: torch.Tensor | np.ndarray) -> Blob:
        if isinstance(value, np.ndarray):
            a = np.ascontiguousarray(value)
            return cls(f"np:{a.dtype.str}", a.shape, True, a.reshape(-1).view(np.uint8).copy())
        host = value.detach().to("cpu", copy=True).contiguous()
        return cls.wrap(host, value.device.type == "cpu")

    @classmethod
    def wrap(cls, host: torch.Tensor, cpu: bool) -> Blob:
        """``host`` (a contiguous CPU tensor this blob now owns) without another copy."""
        import torch

        raw = host.reshape(-1).view(torch.uint8).numpy()
        return cls(str(host.dtype).removeprefix("torch."), tuple(host.shape), cpu, raw)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def expected_bytes(self) -> int:
        if self.dtype.startswith("np:"):
            return np.dtype(self.dtype[3:]).itemsize * int(np.prod(self.shape, dtype=np.int64))
        n = int(np.prod(self.shape, dtype=np.int64))
        return _dtype(self.dtype).itemsize * n

    def value(self, device: torch.device | str = "cpu") -> torch.Tensor | np.ndarray:
        raw = np.ascontiguousarray(self.data)
        if self.dtype.startswith("np:"):
            return raw.view(np.dtype(self.dtype[3:])).reshape(self.shape).copy()
        import torch

        t = torch.from_numpy(raw.copy()).view(_dtype(self.dtype)).reshape(self.shape)
        return t if self.cpu else t.to(device)


def flatten(tree: Any, found: list[Any], ids: dict[int, int]) -> Any:
    """``tree`` as JSON-able data: tensors and arrays as ``{"t": i}`` into ``found`` (one entry
    per object: what two attributes share stays shared), tuples and dicts tagged."""
    import torch

    if isinstance(tree, torch.Tensor | np.ndarray):
        if id(tree) not in ids:
            ids[id(tree)] = len(found)
            found.append(tree)
        return {"t": ids[id(tree)]}
    if isinstance(tree, list):
        return [flatten(v, found, ids) for v in tree]
    if isinstance(tree, tuple):
        return {"tuple": [flatten(v, found, ids) for v in tree]}
    if isinstance(tree, dict):
        return {"dict": {k: flatten(v, found, ids) for k, v in tree.items()}}
    return tree


def unflatten(data: Any, values: list[Any]) -> Any:
    if isinstance(data, list):
        return [unflatten(v, values) for v in data]
    if isinstance(data, dict):
        if "t" in data:
            return values[int(data["t"])]
        if "tuple" in data:
            return tuple(unflatten(v, values) for v in data["tuple"])
        return {k: unflatten(v, values) for k, v in data["dict"].items()}
    return data


@dataclass(frozen=True)
class StepState:
    """The latents after ``step`` of ``total`` steps, as raw bytes with dtype and shape, and
    the loop's state (``loop``: JSON with ``{"t": i}`` for ``blobs[i]``; "" for none)."""

    step: int
    total: int
    dtype: str  # torch dtype name: "float32", "bfloat16", ...
    shape: tuple[int, ...]
    data: np.ndarray = field(repr=False)  # uint8, the tensor's bytes (C order)
    loop: str = ""
    blobs: tuple[Blob, ...] = field(default=(), repr=False)

    @classmethod
    def of(cls, step: int, total: int, latents: torch.Tensor, loop: Tree | None = None) -> StepState:
        """A copy of ``latents`` and of ``loop``'s tensors (any device) in host memory."""
        host = latents.detach().to("cpu", copy=True).contiguous()
        skeleton, values = encode_loop(loop)
        return cls.wrap(step, total, host, skeleton, tuple(Blob.of(v) for v in values))

    @classmethod
    def wrap(cls, step: int, total: int, host: torch.Tensor, loop: str = "",
             blobs: tuple[Blob, ...] = ()) -> StepState:
        """``host`` (a contiguous CPU tensor this state now owns) without another copy."""
        import torch

        raw = host.reshape(-1).view(torch.uint8).numpy()
        return cls(step, total, str(host.dtype).removeprefix("torch."), tuple(host.shape), raw, loop, blobs)

    @property
    def nbytes(self) -> int:
        """Latents and loop state together."""
        return int(self.data.nbytes) + sum(b.nbytes for b in self.blobs)

    def tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The latents again, on ``device``, bit for bit."""
        import torch

        raw = torch.from_numpy(np.ascontiguousarray(self.data))
        return raw.view(_dtype(self.dtype)).reshape(self.shape).to(device)

    def loop_tree(self, device: torch.device | str = "cpu") -> Tree | None:
        """The loop's state again (its device tensors on ``device``); None when none was kept."""
        if not self.loop:
            return None
        return unflatten(json.loads(self.loop), [b.value(device) for b in self.blobs])

    # -- as a file (api/durable.py) ------------------------------------------------------

    def loop_header(self) -> dict[str, Any]:
        return {"loop": self.loop, "blobs": [[b.dtype, list(b.shape), b.cpu] for b in self.blobs]}

    def loop_bytes(self) -> bytes:
        return b"".join(np.ascontiguousarray(b.data).tobytes() for b in self.blobs)

    def with_loop(self, header: dict[str, Any], raw: bytes) -> StepState:
        """This state with the loop part read back from a file; ValueError where it is not whole."""
        loop = header["loop"]
        if not isinstance(loop, str) or not loop:
            raise ValueError("no loop state")
        json.loads(loop)
        blobs, at = [], 0
        for dtype, shape, cpu in header["blobs"]:
            b = Blob(str(dtype), tuple(int(x) for x in shape), bool(cpu), np.empty(0, np.uint8))
            n = b.expected_bytes()
            if at + n > len(raw):
                raise ValueError("torn loop state")
            blobs.append(Blob(b.dtype, b.shape, b.cpu, np.frombuffer(raw, np.uint8, n, at).copy()))
            at += n
        if at != len(raw):
            raise ValueError("loop state bytes left over")
        return StepState(self.step, self.total, self.dtype, self.shape, self.data, loop, tuple(blobs))


def encode_loop(loop: Tree | None) -> tuple[str, list[Any]]:
    """``loop`` as (JSON, its tensors in order); ("", []) for none."""
    if loop is None:
        return "", []
    values: list[Any] = []
    skeleton = flatten(loop, values, {})
    return json.dumps(skeleton), values
