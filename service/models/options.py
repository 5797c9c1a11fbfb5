"""How a model is served: one settings object, and the flags every front end shares.

``OffloadSettings`` is built once (from the flags of ``generate``, ``serve`` or the batch
job, or from the Serve config's ``offload`` mapping) and handed down unchanged to every
rank; only ``--dlo-mode auto`` replaces its mode, once, with what the probe chose. The
flags are declared once here and checked once, in one order, so the three CLIs cannot
drift. No torch here: the CLIs import this to build their parsers.
"""

from __future__ import annotations

import argparse
import enum
import json
import re
from dataclasses import asdict, dataclass, replace
from typing import Any

COMPONENTS = ("dit", "text_encoder", "vae")
DTYPES = ("auto", "bfloat16", "float16", "float32")
QUANTIZATIONS = ("fp8", "none")  # settings' None: the checkpoint's own (a `dloserve quantize` folder: fp8)
NEEDS_OFFLOAD = "needs --enable-distributed-layerwise-offload"
LORA_CACHE_GB = 2.0  # device memory for LoRA adapter weights (docs/lora.md)
SWITCHES = ("auto", "on", "off")  # --cfg-batch, --compile


class Mode(enum.Enum):
    """How the transformer's weights reach the device."""

    RESIDENT = "resident"  # no offload: the whole transformer lives on the device
    ALLGATHER = "allgather"  # 1/N host shards per rank, each block rebuilt by an AllGather
    RANK_LOCAL = "rank-local"  # every rank streams whole blocks itself: no collectives
    AUTO = "auto"  # ALLGATHER or RANK_LOCAL, chosen at load from a probe forward


class FlagError(ValueError):
    """A flag (or Serve config field) is invalid; the message names it."""


# Settings field -> the flag that sets it (for messages).
FLAGS = {"mode": "--dlo-mode", "resident_layers": "--dlo-resident-layers",
         "device_memory_gb": "--dlo-device-memory-gb", "components": "--dlo-components",
         "probe_shape": "--dlo-probe-size", "dtype": "--dtype", "quantization": "--quantization",
         "lora_cache_gb": "--lora-cache-gb", "cache": "--cache", "cfg_batch": "--cfg-batch",
         "compile": "--compile"}


@dataclass(frozen=True)
class OffloadSettings:
    """Everything about where the weights live, checked when made (FlagError names the flag).

    ``resident_layers`` / ``device_memory_gb``: transformer blocks kept on the device.
    ``components``: what offload covers besides the transformer (text encoder, VAE).
    ``probe_shape``: (height, width, frames) of the load-time probe forward (auto mode and
    the memory budget); None is 480x832x81. ``dtype``: a torch dtype name, None keeps the
    checkpoint's. ``quantization``: "fp8" serves the blocks' Linear weights in FP8 (resident
    or streamed: half the bytes on the host, over PCIe and in the gathers); None takes the
    checkpoint's own (fp8 for a ``dloserve quantize`` folder); "none" refuses an fp8 folder.
    ``lora_cache_gb``: device memory for LoRA adapter weights (an LRU; 0: no adapters),
    counted by the budget.
    ``cache``: the step cache of requests that name none (a ``--cache`` spec, canonical JSON;
    None: no cache), see cache_spec.py. ``cfg_batch``: a CFG request's conditional and
    unconditional rows in one transformer forward of batch 2 (half the forwards, each block
    filled once per step); auto: on CUDA devices, off on CPU (where frames stay bitwise
    diffusers'), see ``cfg_batching``. ``compile``: torch.compile of the repeated block class
    (auto: on CUDA, off on CPU), see ``compiling``.
    """

    mode: Mode = Mode.RESIDENT
    resident_layers: int | None = None
    device_memory_gb: float | None = None
    components: tuple[str, ...] = ("dit",)
    probe_shape: tuple[int, int, int] | None = None
    dtype: str | None = None
    quantization: str | None = None
    lora_cache_gb: float = LORA_CACHE_GB
    cache: str | None = None
    cfg_batch: str = "auto"
    compile: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Mode(self.mode))
        object.__setattr__(self, "components", parse_components(self.components))
        if self.probe_shape is not None:
            shape = tuple(int(v) for v in self.probe_shape)
            if len(shape) != 3 or min(shape) < 1:
                raise FlagError(f"--dlo-probe-size: three positive sizes, got {self.probe_shape!r}")
            object.__setattr__(self, "probe_shape", shape)
        if self.dtype is not None and self.dtype not in DTYPES[1:]:
            raise FlagError(f"--dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise FlagError(f"--quantization must be one of {list(QUANTIZATIONS)}, got {self.quantization!r}")
        if isinstance(self.lora_cache_gb, bool) or not 0 <= float(self.lora_cache_gb) < float("inf"):
            raise FlagError(f"--lora-cache-gb must be >= 0, got {self.lora_cache_gb!r}")
        if self.cache is not None:
            object.__setattr__(self, "cache", canonical_cache(self.cache))
        for key in ("cfg_batch", "compile"):
            if getattr(self, key) not in SWITCHES:
                raise FlagError(f"{FLAGS[key]} must be one of {list(SWITCHES)}, got {getattr(self, key)!r}")
        if self.resident_layers is not None and self.resident_layers < 0:
            raise FlagError(f"--dlo-resident-layers must be >= 0, got {self.resident_layers}")
        if self.device_memory_gb is not None:
            if not self.device_memory_gb > 0:
                raise FlagError(f"--dlo-device-memory-gb must be > 0, got {self.device_memory_gb}")
            if self.resident_layers is not None:
                raise FlagError("give --dlo-resident-layers or --dlo-device-memory-gb, not both")
        if self.mode is Mode.RESIDENT:
            placed = [FLAGS[k] for k in ("resident_layers", "device_memory_gb", "probe_shape")
                      if getattr(self, k) is not None]
            if self.components != ("dit",):
                placed.append(FLAGS["components"])
            if placed:
                raise FlagError(f"{', '.join(placed)}: {NEEDS_OFFLOAD}")

    @property
    def enabled(self) -> bool:
        """Whether the transformer streams from host memory."""
        return self.mode is not Mode.RESIDENT

    @property
    def use_allgather(self) -> bool:
        """Whether ranks gather blocks from each other (auto: not known until resolved)."""
        if self.mode is Mode.AUTO:
            raise ValueError("--dlo-mode auto is not resolved yet (the probe chooses)")
        return self.mode is Mode.ALLGATHER

    @property
    def probed(self) -> bool:
        """Whether loading runs a probe forward first (auto mode; a budget, on CUDA)."""
        return self.mode is Mode.AUTO or self.device_memory_gb is not None

    def cfg_batching(self, device_type: str) -> bool:
        """Whether CFG requests run both rows in one forward on this server (a setting of the
        server, never of the layout: resident and every offload mode agree, so a request's bytes
        do not depend on the strategy). Auto: on CUDA only; on CPU the default keeps frames
        bitwise equal to diffusers' pipeline."""
        return self.cfg_batch == "on" or (self.cfg_batch == "auto" and device_type == "cuda")

    def compiling(self, device_type: str) -> bool:
        """Whether the repeated transformer block runs under torch.compile (auto: on CUDA)."""
        return self.compile == "on" or (self.compile == "auto" and device_type == "cuda")

    def resolved(self, mode: Mode) -> OffloadSettings:
        """The same settings with auto's choice in place."""
        if mode not in (Mode.ALLGATHER, Mode.RANK_LOCAL):
            raise ValueError(f"auto resolves to allgather or rank-local, not {mode.value}")
        return replace(self, mode=mode)

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON (the Serve config's ``offload`` mapping)."""
        d = asdict(self)
        d["mode"] = self.mode.value
        d["components"] = list(self.components)
        d["probe_shape"] = list(self.probe_shape) if self.probe_shape else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any] | OffloadSettings | None) -> OffloadSettings:
        if isinstance(d, OffloadSettings):
            return d
        d = dict(d or {})
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            known = sorted(cls.__dataclass_fields__)
            raise FlagError(f"offload: unknown setting(s) {unknown}; known: {known}")
        try:
            return cls(**d)
        except (TypeError, ValueError) as e:
            raise FlagError(f"offload: {e}") from None

    def probe_problem(self, adapter: Any, device: str) -> str | None:
        """Why this model cannot run the load-time probe these settings need, or None (auto
        without a probe picks AllGather and says so; a device budget cannot do without one)."""
        if self.device_memory_gb is not None and device == "cuda" and not adapter.can_probe:
            return (f"--dlo-device-memory-gb needs a load-time probe, which {adapter.family} does not have "
                    "yet (Wan does)")
        # a model folder (not a family class) says what it holds: fp8 unless the flag says otherwise
        if self.quantization != "fp8" and not isinstance(adapter, type) and adapter.stored_quantization():
            if self.quantization == "none":
                return (f"--quantization none: {adapter.model_dir} holds fp8 weights (written by "
                        "`dloserve quantize`) and cannot be served unquantized; drop the flag (its fp8 "
                        "is read by default)")
            if adapter.sequence_parallel > 1:
                return (f"{adapter.model_dir} holds fp8 weights: not yet with --sequence-parallel-size > 1 "
                        "(serve the unquantized folder)")
        return None


def canonical_cache(value: str | dict[str, Any]) -> str | None:
    """A ``--cache`` spec (or a Serve config mapping) -> canonical JSON; None for ``none``."""
    from .cache_spec import CacheError, CacheSpec

    try:
        spec = CacheSpec.from_obj(value)
    except (CacheError, TypeError) as e:
        raise FlagError(f"--cache: {e}") from None
    return json.dumps(spec.as_dict(), sort_keys=True) if spec.enabled else None


def parse_components(value: str | tuple[str, ...] | list[str] | None, flag: str = "--dlo-components"
                     ) -> tuple[str, ...]:
    """``"dit,text_encoder,vae"`` -> a checked tuple in canonical order; FlagError naming ``flag``."""
    if value is None:
        return ("dit",)
    items = [v.strip() for v in value.split(",")] if isinstance(value, str) else list(value)
    bad = sorted(set(items) - set(COMPONENTS))
    if bad or not items:
        raise FlagError(f"{flag}: unknown component(s) {bad or items}; choose from {list(COMPONENTS)}")
    if "dit" not in items:
        raise FlagError(f"{flag}: must include 'dit' (the transformer is what offload streams first)")
    return tuple(c for c in COMPONENTS if c in items)


def parse_probe_size(value: str) -> tuple[int, int, int]:
    """``"832x480x81"`` -> (height, width, frames)."""
    m = re.fullmatch(r"\s*(\d+)x(\d+)x(\d+)\s*", value)
    if not m or min(int(g) for g in m.groups()) < 1:
        raise FlagError(f"--dlo-probe-size must be WIDTHxHEIGHTxFRAMES like 832x480x81, got {value!r}")
    w, h, f = (int(g) for g in m.groups())
    return (h, w, f)


# -- the shared flags ------------------------------------------------------------------


def add_offload_arguments(p: argparse.ArgumentParser, offload_default: bool = False) -> None:
    """The ranks and offload flags of ``generate``, ``serve`` and the batch job.

    ``offload_default``: whether DLO is on without a flag (the batch job: on; ``--no-offload``
    turns it off).
    """
    g = p.add_argument_group("ranks and offload")
    g.add_argument("--data-parallel-size", type=int, default=1,
                   help="N ranks (one per GPU): N requests at once, one host copy of the weights")
    g.add_argument("--sequence-parallel-size", "--usp", type=int, default=1, dest="sequence_parallel_size",
                   help="S ranks per request (Ulysses); with --data-parallel-size D: D groups of S")
    g.add_argument("--enable-distributed-layerwise-offload", dest="offload", action="store_true",
                   default=offload_default,
                   help="stream transformer blocks from host memory (DLO)"
                        + (" (the default here)" if offload_default else ""))
    g.add_argument("--no-offload", dest="offload", action="store_false",
                   help="keep the whole transformer on every rank's device")
    g.add_argument("--dlo-no-use-allgather", action="store_true",
                   help="rank-local DLO: every rank streams whole blocks, no sharding "
                        "(= --dlo-mode rank-local)")
    g.add_argument("--dlo-mode", choices=[m.value for m in Mode if m is not Mode.RESIDENT], default=None,
                   help="auto (the default): AllGather or rank-local, chosen at load from a short probe of "
                        "per-block compute vs transfer time and the cost of lock-step (the choice and why: "
                        "the log and /readyz); or allgather, rank-local")
    g.add_argument("--dlo-resident-layers", type=int, default=None,
                   help="keep this many transformer blocks on the device (spread over the depth)")
    g.add_argument("--dlo-device-memory-gb", type=float, default=None,
                   help="keep as many blocks resident as fit in this many GiB beside the two slots, "
                        "the non-block tensors and the probe forward's activations")
    g.add_argument("--dlo-components", default="dit",
                   help=f"what offload covers, comma-separated from {','.join(COMPONENTS)}: "
                        "text_encoder streams its blocks too, vae is on the device only for decode")
    g.add_argument("--dlo-probe-size", default=None,
                   help="WIDTHxHEIGHTxFRAMES of the load-time probe forward (auto mode, memory budget); "
                        "default 832x480x81 (generate: the request's own size)")
    g.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="transformer dtype (auto: the checkpoint's)")
    g.add_argument("--quantization", default="auto", choices=("auto", *QUANTIZATIONS),
                   help="fp8: the transformer blocks' Linear weights in FP8 with per-channel scales, "
                        "quantized at load: half the bytes on the host, over PCIe and in the gathers. "
                        "auto (default): the checkpoint's own (a 'dloserve quantize' folder is read as "
                        "fp8, any other as stored); none: never fp8 (an fp8 folder is refused)")
    g.add_argument("--cfg-batch", default="auto", choices=SWITCHES,
                   help="a CFG request's conditional and unconditional rows in one transformer forward "
                        "(batch 2): each block filled once per step, half the forwards; auto: on CUDA, "
                        "off on CPU (frames bitwise diffusers'); requests with a step cache run unbatched")
    g.add_argument("--compile", default="auto", choices=SWITCHES,
                   help="torch.compile the repeated transformer block (regional; the offload's weight "
                        "swaps do not recompile): auto: on CUDA, off on CPU; warm-up is a start-up stage")
    g.add_argument("--cache", "--cache-default", dest="cache", default=None, metavar="SPEC",
                   help="step cache of requests that name none (generate: the request's): none (default), "
                        "first_block[:threshold=0.05], mag:threshold=0.06,... or a JSON object; skipped "
                        "blocks also skip their weight transfers (docs/caches.md)")
    add_lora_arguments(p)


def add_lora_arguments(p: argparse.ArgumentParser) -> None:
    """``--lora`` and ``--lora-cache-gb``, on ``generate``, ``serve`` and the batch job."""
    g = p.add_argument_group("LoRA adapters (docs/lora.md)")
    g.add_argument("--lora", action="append", default=[], metavar="NAME=PATH_OR_URL | NAME[:SCALE]",
                   help="NAME=PATH_OR_URL registers an adapter file (diffusers/PEFT or the original Wan "
                        "'lightx2v' layout; repeatable), checked before anything starts. generate also "
                        "takes NAME[:SCALE] to apply a registered one (default: every registered one, "
                        "scale 1); the service and the batch job name adapters per request")
    g.add_argument("--lora-cache-gb", type=float, default=None,
                   help="device memory for adapter weights, an LRU of whole adapters (default 2; 0: no "
                        "adapters); counted by --dlo-device-memory-gb")


def settings_from_args(args: argparse.Namespace) -> OffloadSettings:
    """The checked settings of the shared flags; FlagError naming the flag.

    Checked in this order: sizes, the offload switch, the mode, placement, and what
    sequence parallelism and the scheduler allow.
    """
    dp, sp = args.data_parallel_size, args.sequence_parallel_size
    if dp < 1:
        raise FlagError(f"--data-parallel-size must be >= 1, got {dp}")
    if sp < 1:
        raise FlagError(f"--sequence-parallel-size must be >= 1, got {sp}")
    mode = args.dlo_mode
    if args.dlo_no_use_allgather:
        if not args.offload:
            raise FlagError(f"--dlo-no-use-allgather {NEEDS_OFFLOAD}")
        if mode not in (None, Mode.RANK_LOCAL.value):
            raise FlagError(f"--dlo-no-use-allgather contradicts --dlo-mode {mode}")
        mode = Mode.RANK_LOCAL.value
    if not args.offload:
        if mode is not None:
            raise FlagError(f"--dlo-mode: {NEEDS_OFFLOAD}")
        mode = Mode.RESIDENT.value
    if mode is None:  # auto unless only one mode can serve (an SP group always gathers)
        mode = Mode.ALLGATHER.value if sp > 1 else Mode.AUTO.value
    settings = OffloadSettings(
        mode=Mode(mode),
        resident_layers=args.dlo_resident_layers,
        device_memory_gb=args.dlo_device_memory_gb,
        components=parse_components(args.dlo_components),
        probe_shape=parse_probe_size(args.dlo_probe_size) if args.dlo_probe_size else None,
        dtype=None if args.dtype == "auto" else args.dtype,
        quantization=None if args.quantization in (None, "auto") else args.quantization,
        lora_cache_gb=LORA_CACHE_GB if getattr(args, "lora_cache_gb", None) is None else args.lora_cache_gb,
        cache=getattr(args, "cache", None),
        cfg_batch=getattr(args, "cfg_batch", "auto"),
        compile=getattr(args, "compile", "auto"),
    )
    if sp > 1:
        if settings.mode is Mode.RANK_LOCAL:
            raise FlagError("--sequence-parallel-size gathers each block over the SP group: "
                            "drop --dlo-no-use-allgather / --dlo-mode rank-local")
        refused = [FLAGS[k] for k in ("resident_layers", "device_memory_gb") if getattr(settings, k)
                   is not None]
        if settings.mode is Mode.AUTO:
            refused.insert(0, "--dlo-mode auto")
        if settings.components != ("dit",):
            refused.append(FLAGS["components"])
        if settings.quantization == "fp8":
            refused.append(FLAGS["quantization"])
        if settings.cache is not None:
            refused.append(FLAGS["cache"])
        refused += [f"{FLAGS[k]} on" for k in ("cfg_batch", "compile") if getattr(settings, k) == "on"]
        if refused:
            raise FlagError(f"{', '.join(refused)}: not yet with --sequence-parallel-size > 1 (an SP group "
                            "always gathers over its ranks and streams the transformer only)")
    return settings
