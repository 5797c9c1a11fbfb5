"""LoRA adapter files: read as diffusers reads them, checked against the transformer.

Reading is diffusers' own: the pipeline class's ``lora_state_dict`` (for Wan,
``WanLoraLoaderMixin``: it converts the original-Wan/"lightx2v" ``diffusion_model.*
lora_down/lora_up/alpha/diff_b`` layout and the musubi ``lora_unet_*`` one into PEFT keys,
folding ``alpha / rank`` into the factors, and drops DoRA scales and zeroed norm deltas),
then diffusers' ``_create_lora_config`` for the file's ``r``/``lora_alpha`` (its metadata
header, or the ranks) and PEFT's own pattern matching for per-module ranks and alphas. So
``scale * lora_alpha / r`` per module is the number PEFT computes after ``set_adapters``.

What we add is strictness, before any compute: every key must land on an ``nn.Linear`` of
this transformer with the right shapes, or the file is refused (``LoraError`` names the
adapter and the key). diffusers only warns about keys it cannot place; a LoRA for another
family or another model size would then run as a silent no-op.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from service.offload.lora import AdapterCache, DeviceAdapter, LoraFactors, SideBranches
from service.offload.quant import Fp8Linear

from .lora_checks import factor_problem, file_sha256, scaling_problem, tensor_problem
from .lora_ref import MAX_SCALE, LoraError, LoraRef
from .request import RequestError

SUFFIXES = (".lora_A.weight", ".lora_B.weight", ".lora_B.bias")
PREFIX = "transformer."  # diffusers' prefix for the transformer's keys after conversion


@dataclass(frozen=True)
class Target:
    """A Linear an adapter may change: its shape and the dtype its factors are served in."""

    in_features: int
    out_features: int
    dtype: torch.dtype


@dataclass(frozen=True)
class Targets:
    """What an adapter's keys are checked against: one transformer's Linears, by name."""

    family: str
    linears: dict[str, Target]
    others: dict[str, str]  # module name -> class name (a key naming one is refused by kind)
    pipeline: str  # the diffusers pipeline class whose lora_state_dict reads the files

    def nbytes(self, layers: dict[str, LoraFactors]) -> int:
        """Device bytes of an adapter's factors in the dtypes they are served in."""
        total = 0
        for name, f in layers.items():
            size = self.linears[name].dtype.itemsize
            total += size * (f.down.numel() + f.up.numel() + (f.bias.numel() if f.bias is not None else 0))
        return total


def linear_targets(module: nn.Module, family: str, pipeline: str) -> Targets:
    """The Linears of ``module`` (meta-built or loaded). Factors are served in the dtype of the
    base weight, as PEFT moves them to it; an fp8 weight's factors in its bias dtype (bf16)."""
    linears: dict[str, Target] = {}
    others: dict[str, str] = {}
    for name, m in module.named_modules():
        if isinstance(m, nn.Linear | Fp8Linear):
            dtype = m.weight.dtype
            if not dtype.is_floating_point or dtype.itemsize == 1:
                dtype = m.bias.dtype if m.bias is not None else torch.bfloat16
            linears[name] = Target(m.in_features, m.out_features, dtype)
        elif name:
            others[name] = type(m).__name__
    return Targets(family, linears, others, pipeline)


@dataclass(frozen=True)
class AdapterFile:
    """One adapter file, read and checked: its factors on the CPU, as loaded."""

    name: str
    layout: str  # "peft", "wan" (original Wan / lightx2v / Kohya-style) or "musubi"
    layers: dict[str, LoraFactors]
    sha256: str
    nbytes: int  # on the device, in the serving dtypes

    def summary(self) -> dict[str, Any]:
        ranks = sorted({f.rank for f in self.layers.values()})
        return {"layout": self.layout, "modules": len(self.layers), "rank": ranks[-1] if ranks else 0,
                "ranks": ranks, "bytes": self.nbytes,
                "bias": any(f.bias is not None for f in self.layers.values())}


def read_adapter(path: str | os.PathLike, name: str, targets: Targets, sha256: str | None = None
                 ) -> AdapterFile:
    """Read and check the adapter file at ``path``; LoraError naming ``name`` and the key.

    ``sha256``: the digest it was registered with; a file that changed since is refused.
    """
    path = Path(path)
    digest = _digest(path, name)
    if sha256 and digest != sha256:
        raise LoraError(name, "file", f"the file changed since it was registered (sha256 {digest[:12]}..., "
                                      f"registered {sha256[:12]}...): register it again")
    raw_keys = _header_keys(path, name)
    layout = _layout(raw_keys, name, targets)
    state, metadata = _convert(path, name, targets)
    layers = _factors(state, metadata, name, targets, layout)
    return AdapterFile(name, layout, layers, digest, targets.nbytes(layers))


def _digest(path: Path, name: str) -> str:
    try:
        return file_sha256(path)
    except OSError as e:
        raise LoraError(name, "file", f"cannot read the file: {e.strerror or _quiet(e, path)}") from None


def _quiet(e: BaseException, path: Path) -> str:
    """``e``'s message without the file's path: errors reach API callers, and where the
    server keeps its files is not theirs to know (the adapter's name says which file)."""
    text = str(e).replace(str(path), "the file")
    return text.replace(str(path.parent), "a folder") if len(str(path.parent)) > 1 else text


def _header_keys(path: Path, name: str) -> list[str]:
    """The file's tensor names from its safetensors header (never a pickle: nothing runs)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            keys = list(f.keys())
    except Exception as e:  # noqa: BLE001 - SafetensorError, OSError, a header that is not JSON
        raise LoraError(name, "file", f"not a readable safetensors file: {_quiet(e, path)}") from None
    if not keys:
        raise LoraError(name, "file", "the file holds no tensors")
    return keys


def _layout(keys: list[str], name: str, targets: Targets) -> str:
    if any(k.startswith("diffusion_model.") for k in keys):
        return "wan"
    if any(k.startswith("lora_unet_") for k in keys):
        return "musubi"
    first = next((k for k in keys if not k.startswith(PREFIX)), None)
    if first is not None:
        raise LoraError(name, first, f"not a key of a {targets.family} LoRA layout diffusers reads "
                                     "(transformer.* PEFT keys, diffusion_model.* original Wan keys, or "
                                     "lora_unet_* musubi keys)")
    return "peft"


def _convert(path: Path, name: str, targets: Targets) -> tuple[dict[str, torch.Tensor], dict | None]:
    """diffusers' own reading and key conversion of the pipeline class, safetensors only."""
    import diffusers

    cls = getattr(diffusers, targets.pipeline, None)
    if cls is None or not hasattr(cls, "lora_state_dict"):
        raise LoraError(name, "file", f"{targets.family} ({targets.pipeline}) takes no LoRA adapters")
    try:
        state, metadata = cls.lora_state_dict(str(path), use_safetensors=True, return_lora_metadata=True)
    except Exception as e:  # noqa: BLE001 - the converters raise anything on a foreign layout
        raise LoraError(name, "file", f"diffusers' {targets.pipeline}.lora_state_dict cannot read it "
                                      f"({type(e).__name__}: {_quiet(e, path)})") from None
    return state, metadata


def _factors(state: dict[str, torch.Tensor], metadata: dict | None, name: str, targets: Targets,
             layout: str) -> dict[str, LoraFactors]:
    """Per module: the factors, with the rank and alpha PEFT would give that module."""
    from diffusers.utils.peft_utils import _create_lora_config
    from peft.utils.other import get_pattern_key

    own = {k[len(PREFIX):]: v for k, v in state.items() if k.startswith(PREFIX)}
    foreign = next((k for k in state if not k.startswith(PREFIX)), None)
    if foreign is not None:
        raise LoraError(name, foreign, "not a key of the transformer (only the transformer takes adapters)")
    if not own:
        raise LoraError(name, "file", "no LoRA weights for the transformer in it")
    meta = {k[len(PREFIX):]: v for k, v in metadata.items() if k.startswith(PREFIX)} if metadata else None
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in own.items():
        if ".lora_magnitude_vector" in key or ".lokr_" in key:
            raise LoraError(name, PREFIX + key, "DoRA and LoKr adapters are not served (plain LoRA only)")
        suffix = next((s for s in SUFFIXES if key.endswith(s)), None)
        if suffix is None:
            raise LoraError(name, PREFIX + key,
                            "not a LoRA factor (lora_A.weight, lora_B.weight, lora_B.bias)")
        modules.setdefault(key[: -len(suffix)], {})[suffix] = t
    ranks = {f"^{k}": v.shape[1] for k, v in own.items() if k.endswith(".lora_B.weight") and v.ndim == 2}
    try:
        config = _create_lora_config(own, None, meta, ranks)
    except Exception as e:  # noqa: BLE001 - bad metadata in the header
        raise LoraError(name, "metadata", f"not a LoRA config PEFT accepts: {e}") from None
    if getattr(config, "use_dora", False):
        raise LoraError(name, "metadata", "DoRA adapters are not served (use_dora is set)")
    out: dict[str, LoraFactors] = {}
    for module, parts in sorted(modules.items()):
        key = PREFIX + module
        target = targets.linears.get(module)
        if target is None:
            kind = targets.others.get(module)
            why = (f"{module} is a {kind}: adapters change Linear layers only" if kind else
                   f"{targets.family}'s transformer has no module {module} (a LoRA for another model?)")
            raise LoraError(name, key + ".lora_A.weight", why)
        a, b = parts.get(".lora_A.weight"), parts.get(".lora_B.weight")
        if a is None or b is None:
            missing = ".lora_A.weight" if a is None else ".lora_B.weight"
            raise LoraError(name, key + missing, "missing: a LoRA needs both factors")
        r = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), module), config.r)
        alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), module),
                                         config.lora_alpha)
        for what, value, whole in (("r", r, True), ("lora_alpha", alpha, False)):
            why = factor_problem(f"{module}: {what}", value, integer=whole)
            if why:
                raise LoraError(name, what, why)
        _check_shape(name, key + ".lora_A.weight", a, (r, target.in_features))
        _check_shape(name, key + ".lora_B.weight", b, (target.out_features, r))
        bias = parts.get(".lora_B.bias")
        if bias is not None:
            _check_shape(name, key + ".lora_B.bias", bias, (target.out_features,))
        for k, t in ((".lora_A.weight", a), (".lora_B.weight", b), (".lora_B.bias", bias)):
            if t is not None and not t.dtype.is_floating_point:
                raise LoraError(name, key + k, f"is {t.dtype}, not a floating-point tensor")
            why = None if t is None else tensor_problem(t, target.dtype)
            if why:
                raise LoraError(name, key + k, why)
        out[module] = LoraFactors(a, b, bias, alpha=alpha, rank=r, rslora=bool(config.use_rslora))
        why = scaling_problem(out[module], target.dtype, MAX_SCALE)
        if why:
            raise LoraError(name, "lora_alpha", f"{module}: {why}")
    return out


def _check_shape(name: str, key: str, t: torch.Tensor, want: tuple[int, ...]) -> None:
    if tuple(t.shape) != want:
        raise LoraError(name, key, f"shape {list(t.shape)} does not fit this model (expected {list(want)})")


def targets_of(adapter: Any, dtype: str | None = None, quantization: str | None = None) -> Targets:
    """The LoRA targets of a model adapter's transformer without loading it: a meta build for
    the modules, the checkpoint's header for the dtypes they are served in (the front end's
    view; a rank takes them from its loaded module)."""
    from service.offload.checkpoint import Checkpoint, serving_dtype

    module = adapter.build_transformer()
    ckpt = Checkpoint(adapter.transformer_checkpoint())
    try:
        stored = {k: r.dtype for k, r in ckpt.records.items()}
    finally:
        ckpt.close()
    cast = getattr(torch, dtype) if dtype else None
    blocks = tuple(f"{a}." for a in adapter.block_attrs)

    def served(key: str) -> torch.dtype:
        return serving_dtype(key, stored.get(key, torch.float32), cast, adapter.keep_fp32)

    found = linear_targets(module, adapter.family, str(adapter.index.get("_class_name", "")))
    linears = {}
    for name, t in found.linears.items():
        fp8 = quantization is not None and name.startswith(blocks)
        weight = served(f"{name}.weight")
        dt = served(f"{name}.bias") if fp8 or weight.itemsize == 1 else weight
        linears[name] = Target(t.in_features, t.out_features, dt)
    return Targets(found.family, linears, found.others, found.pipeline)


class RankAdapters:
    """One rank's adapters: the transformer's Linears, the device LRU and the side branches.

    ``applied(refs)`` puts a request's adapters on the device (cache hits cost nothing; a
    miss reads and checks the file again, against the digest its registration recorded)
    and hooks them onto the Linears for the request's forwards, then removes the hooks,
    also when the request failed. Base weights are never written: the hooks add a branch.
    """

    def __init__(self, transformer: nn.Module, family: str, pipeline: str, device: torch.device,
                 budget_bytes: int) -> None:
        self.targets = linear_targets(transformer, family, pipeline)
        self.device = device
        self.cache = AdapterCache(budget_bytes)
        modules = dict(transformer.named_modules())
        self.sides = SideBranches(transformer, {n: modules[n] for n in self.targets.linears})

    def _load(self, ref: LoraRef) -> tuple[str, int, Callable[[], DeviceAdapter]]:
        key = ref.sha256
        if key and key in self.cache:
            return key, self.cache.nbytes(key), lambda: self.cache.get(key)  # type: ignore[return-value]
        file = read_adapter(ref.source, ref.name, self.targets, sha256=ref.sha256 or None)

        def load() -> DeviceAdapter:
            return DeviceAdapter(file.sha256, {n: f.to(self.device, self.targets.linears[n].dtype)
                                               for n, f in file.layers.items()})

        return file.sha256, file.nbytes, load

    @contextmanager
    def applied(self, refs: tuple[LoraRef, ...]) -> Iterator[None]:
        if not refs:
            yield
            return
        wanted = [self._load(r) for r in refs]
        try:
            adapters = self.cache.acquire(wanted)
        except ValueError as e:
            raise RequestError("loras", str(e)) from None
        self.sides.attach([(a, float(r.scale)) for a, r in zip(adapters, refs, strict=True)])
        try:
            yield
        finally:
            self.sides.detach()

    def stats(self) -> dict[str, Any]:
        return self.cache.stats()
