"""The flags ``generate``, ``serve`` and the batch job share: one arguments object whose fields
are the flags (vLLM's ``EngineArgs`` form). ``add_cli_args`` declares each flag from its field
(name, default, help), ``from_namespace`` reads them back, and ``to_config`` is the one place
they become an ``EngineConfig``, checked in one order (FlagError naming the flag). No torch:
the CLIs import this to build their parsers.
"""

from __future__ import annotations

import argparse
import warnings
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from service.offload.mode import OffloadMode

from .engine import EngineConfig, step_cache
from .errors import FlagError
from .lora import LoraConfig
from .model import ATTENTIONS, DTYPES, QUANTIZATIONS, SWITCHES, ModelConfig
from .offload import (
    COMPONENTS,
    NEEDS_OFFLOAD,
    STREAMED_DEFAULT,
    OffloadConfig,
    parse_components,
    parse_probe_size,
)
from .parallel import CPUS_PER_RANK, STRATEGIES, ParallelConfig
from .scheduler import WAVE_DEADLINE_BASE_S, WAVE_DEADLINE_PER_FORWARD_S, SchedulerConfig

# The flag groups, and which front end declares which.
OFFLOAD, LORA, PLACEMENT, QUEUE = ("ranks and offload", "LoRA adapters (docs/lora.md)",
                                   "rank placement and scheduling", "queue")
GENERATE, BATCH, SERVE = (OFFLOAD, LORA), (OFFLOAD, LORA, PLACEMENT), (OFFLOAD, LORA, PLACEMENT, QUEUE)


def _count(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {n}")
    return n


def batch_size(text: str) -> int | str:
    """``--max-batch-size``: "auto" or an integer >= 1."""
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be auto or an integer >= 1, got {text!r}")
    return n


def flag(default: Any, group: str, help: str, *names: str, **argparse_kw: Any) -> Any:  # noqa: A002
    """A field that is a flag: its default, its group, its help, its names (the first is
    ``--field-name`` unless given) and any other ``add_argument`` keywords."""
    meta = {"group": group, "help": help, "names": names, "kw": argparse_kw}
    if isinstance(default, list):
        return field(default_factory=list, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class EngineArgs:
    """Every shared flag, as parsed (strings where the flag takes words)."""

    data_parallel_size: int = flag(
        ParallelConfig.dp_size, OFFLOAD,
        "N ranks (one per GPU): N requests at once, one host copy of the weights")
    sequence_parallel_size: int = flag(
        ParallelConfig.sp_size, OFFLOAD,
        "S ranks per request (Ulysses); with --data-parallel-size D: D groups of S",
        "--sequence-parallel-size", "--usp")
    offload: bool = flag(
        False, OFFLOAD, "stream transformer blocks from host memory (DLO)",
        "--enable-distributed-layerwise-offload", action="store_true")
    dlo_no_use_allgather: bool = flag(
        False, OFFLOAD, "deprecated: use --dlo-mode rank-local", action="store_true")
    dlo_mode: str | None = flag(
        None, OFFLOAD,
        "auto (the default): AllGather or rank-local, chosen at load from a short probe of per-block "
        "compute vs transfer time and the cost of lock-step (the choice and why: the log and /readyz); "
        "or allgather, rank-local",
        choices=[m.value for m in OffloadMode if m is not OffloadMode.RESIDENT])
    dlo_resident_layers: int | None = flag(
        OffloadConfig.resident_layers, OFFLOAD,
        "keep this many transformer blocks on the device (spread over the depth)", type=int)
    dlo_device_memory_gb: float | None = flag(
        OffloadConfig.device_memory_gb, OFFLOAD,
        "keep as many blocks resident as fit in this many GiB beside the two slots, the non-block tensors "
        "and the probe forward's activations", type=float)
    dlo_device_share: float = flag(
        OffloadConfig.device_share, OFFLOAD,
        "where neither of the two above is given, on CUDA: keep as many blocks resident as fit, with the two "
        "slots and the non-block tensors, in this share of the GPU's memory (a model that fits streams "
        "nothing: short clips are transfer-bound; activations and the components use the rest); 0 streams "
        "every block", type=float)
    dlo_components: str = flag(
        ",".join(OffloadConfig.components), OFFLOAD,
        f"what offload covers, comma-separated from {','.join(COMPONENTS)}: text_encoder streams its blocks "
        "too, vae is on the device only for decode")
    dlo_probe_size: str | None = flag(
        None, OFFLOAD,
        "WIDTHxHEIGHTxFRAMES of the load-time probe forward (auto mode, memory budget); default 832x480x81 "
        "(generate: the request's own size)")
    dtype: str = flag("auto", OFFLOAD, "transformer dtype (auto: the checkpoint's)", choices=DTYPES)
    quantization: str = flag(
        "auto", OFFLOAD,
        "fp8: the transformer blocks' Linear weights in FP8 with per-channel scales, quantized at load: half "
        "the bytes on the host, over PCIe and in the gathers. auto (default): the checkpoint's own (a "
        "'dloserve quantize' folder is read as fp8, any other as stored); none: never fp8 (an fp8 folder is "
        "refused)", choices=("auto", *QUANTIZATIONS))
    cfg_batch: str = flag(
        ModelConfig.cfg_batch, OFFLOAD,
        "a CFG request's conditional and unconditional rows in one transformer forward (batch 2): each block "
        "filled once per step, half the forwards; auto: on CUDA, off on CPU (frames bitwise diffusers'); "
        "requests with a step cache run unbatched", choices=SWITCHES)
    compile: str = flag(
        ModelConfig.compile, OFFLOAD,
        "torch.compile the repeated transformer block (regional; the offload's weight swaps do not "
        "recompile): auto: on CUDA, off on CPU; warm-up is a start-up stage", choices=SWITCHES)
    attention: str = flag(
        ModelConfig.attention, OFFLOAD,
        "attention kernel: exact (default: SDPA, cuDNN first, and for Wan on sm90 flash-attn-4 where a "
        "table timed on the GPU at load finds it faster), sdpa (SDPA only), fa4 (flash-attn-4 for every Wan "
        "call it takes; sm90, pip extra 'gpu'); approximate, opt-in, Wan's self-attention on sm90 only: "
        "fp8 (cuDNN's FP8 SDPA, pip extra 'gpu'; a 40-layer CFG step 4.78 s against exact's 5.25 s on an "
        "H200, output 0.011 relative error, random weights); docs/benchmarks.md",
        choices=ATTENTIONS)
    cache: str | None = flag(
        None, OFFLOAD,
        "step cache of requests that name none (generate: the request's): none (default), "
        "first_block[:threshold=0.05], mag:threshold=0.06,... or a JSON object; skipped blocks also skip "
        "their weight transfers (docs/caches.md)", "--cache", "--cache-default", metavar="SPEC")
    lora: list[str] = flag(
        [], LORA,
        "NAME=PATH registers an adapter file (diffusers/PEFT or the original Wan 'lightx2v' layout; "
        "repeatable); a path that is no file is refused before anything starts, the file's contents "
        "where it is registered (generate: before the model loads; serve: the replica's start fails "
        "naming it). generate also takes NAME[:SCALE] to apply a registered one (default: every "
        "registered one, scale 1); the service and the batch job name "
        "adapters per request", action="append", metavar="NAME=PATH | NAME[:SCALE]")
    lora_cache_gb: float = flag(
        LoraConfig.cache_gb, LORA,
        f"device memory for adapter weights, an LRU of whole adapters (default {LoraConfig.cache_gb:g}; 0: "
        "no adapters); counted by --dlo-device-memory-gb", type=float)
    gpus_per_rank: float | None = flag(
        None, PLACEMENT, "default: 1 if the cluster has GPUs, else 0", type=float)
    cpus_per_rank: float | None = flag(
        None, PLACEMENT,
        "CPUs reserved per rank (its MP4 encoders follow them); default: serve on a cluster of its own "
        "shares the node's CPUs, less 2 for the ingress, among its ranks (at least "
        f"{CPUS_PER_RANK:g}); on a joined cluster and in the batch job, {CPUS_PER_RANK:g}", type=float)
    placement_strategy: str = flag(
        ParallelConfig.strategy, PLACEMENT, "how the ranks' bundles are placed", choices=STRATEGIES)
    scheduler: str = flag(
        SchedulerConfig.scheduler, PLACEMENT,
        "continuous: a freed rank starts the next request at the next forward; waves: request-level waves "
        "of one compatibility key", choices=("continuous", "waves"))
    encoders_per_rank: int | None = flag(
        ParallelConfig.encoders_per_rank, PLACEMENT,
        "MP4 encoder processes beside each rank (default: auto, the rank's CPUs // x264 threads per "
        "encode, at least 1; 0: encode on the rank)", type=int)
    rank_standby: bool | None = flag(
        ParallelConfig.rank_standby, PLACEMENT,
        "keep one pre-imported process per rank waiting, so a rank that dies is replaced without a new "
        "interpreter and its imports (host memory: about one process's imports per rank); default: on "
        "with GPU ranks, off on CPU", action=argparse.BooleanOptionalAction)
    rank_standby_preload: bool = flag(
        ParallelConfig.rank_standby_preload, PLACEMENT,
        "a standby of a one-process group (DP1, or rank-local/resident ranks) also loads the pipeline "
        "and warms the compiled blocks while it waits, so it takes over in about a second (device "
        "memory: one more copy of what stays on the GPU; it drops its load when that leaves under a "
        "quarter of the GPU free); off: it only imports", action=argparse.BooleanOptionalAction)
    job_retries: int = flag(
        SchedulerConfig.job_retries, PLACEMENT,
        "the request on a rank whose process died runs again, ahead of the queue, up to this many times "
        "(the group's other requests, which only stood by, always do); 0: no request runs again, they "
        "fail with the reason", type=_count)
    wave_deadline_base_s: float = flag(
        WAVE_DEADLINE_BASE_S, PLACEMENT, "fixed part of each request's deadline", type=float)
    wave_deadline_per_forward_s: float = flag(
        WAVE_DEADLINE_PER_FORWARD_S, PLACEMENT,
        "deadline = base + this x forwards x (pixels*frames / 832*480*81)", type=float)
    max_wait_ms: float = flag(
        SchedulerConfig.max_wait_ms, QUEUE, "how long a partial wave waits for more compatible requests",
        type=float)
    queue_size: int = flag(SchedulerConfig.queue_size, QUEUE, "queued requests before 429", type=int)
    max_queue_wait_s: float = flag(
        SchedulerConfig.max_queue_wait_s, QUEUE,
        "a queued job waits at most this long for a rank (e.g. through a rebuild)", type=float)
    max_batch_size: int | str = flag(
        SchedulerConfig.max_batch_size, QUEUE,
        "requests of one batch key that share each streamed forward on a rank (continuous scheduler); "
        "auto: as many as the streamed bytes cover (engine/batching.py); 1: one request per forward",
        type=batch_size)
    starve_s: float = flag(
        SchedulerConfig.starve_s, QUEUE,
        "continuous: a request queued this long goes next, whatever its cost", type=float)

    @classmethod
    def add_cli_args(cls, p: argparse.ArgumentParser, groups: tuple[str, ...],
                     defaults: dict[str, Any] | None = None) -> None:
        """Declare the flags of ``groups`` on ``p``, each default from its field; ``defaults``:
        a front end's own (the batch job: offload on, a longer deadline), said in the help."""
        own = defaults or {}
        made: dict[str, argparse._ArgumentGroup] = {}
        for f in fields(cls):
            meta = f.metadata
            if meta["group"] not in groups:
                continue
            g = made.setdefault(meta["group"], p.add_argument_group(meta["group"]))
            names = meta["names"] or (f"--{f.name.replace('_', '-')}",)
            default = own.get(f.name, [] if f.default is MISSING else f.default)
            kw = dict(meta["kw"])
            if "type" not in kw and "action" not in kw and type(default) is int:
                kw["type"] = int
            note = " (the default here)" if f.name in own and kw.get("action") == "store_true" else ""
            g.add_argument(*names, dest=f.name, default=default, help=meta["help"] + note, **kw)
            if f.name == "offload":
                g.add_argument("--no-offload", dest="offload", action="store_false",
                               help="keep the whole transformer on every rank's device")

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> EngineArgs:
        """The shared flags of a parsed command line (flags a front end lacks keep their field's
        default)."""
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})

    def mode(self) -> OffloadMode:
        """The offload mode the flags ask for: checked in this order: sizes, the offload switch,
        the deprecated alias, the mode."""
        mode = self.dlo_mode
        if self.dlo_no_use_allgather:
            warnings.warn("--dlo-no-use-allgather is deprecated: use --dlo-mode rank-local", FutureWarning,
                          stacklevel=2)
            if not self.offload:
                raise FlagError(f"--dlo-no-use-allgather {NEEDS_OFFLOAD}")
            if mode not in (None, OffloadMode.RANK_LOCAL.value):
                raise FlagError(f"--dlo-no-use-allgather contradicts --dlo-mode {mode}")
            mode = OffloadMode.RANK_LOCAL.value
        if not self.offload:
            if mode is not None:
                raise FlagError(f"--dlo-mode: {NEEDS_OFFLOAD}")
            return OffloadMode.RESIDENT
        if mode == OffloadMode.AUTO.value and self.sequence_parallel_size > 1:
            raise FlagError("--dlo-mode auto: not yet with --sequence-parallel-size > 1 (an SP group "
                            "always gathers over its ranks and streams the transformer only)")
        return STREAMED_DEFAULT if mode is None else OffloadMode(mode)

    def to_config(self, model_dir: str = "", *, gpus_per_rank: float | None = None,
                  cpus_per_rank: float | None = None) -> EngineConfig:
        """The one EngineConfig of these flags (FlagError naming the flag). ``gpus_per_rank`` /
        ``cpus_per_rank``: what the front end resolved where the flag left it open (the cluster's
        GPUs, the host's CPUs); the flag wins where given."""
        gpus = self.gpus_per_rank if self.gpus_per_rank is not None else (gpus_per_rank or 0.0)
        cpus = self.cpus_per_rank if self.cpus_per_rank is not None else (cpus_per_rank or CPUS_PER_RANK)
        parallel = ParallelConfig(dp_size=self.data_parallel_size, sp_size=self.sequence_parallel_size,
                                  cpus_per_rank=cpus, gpus_per_rank=gpus, strategy=self.placement_strategy,
                                  encoders_per_rank=self.encoders_per_rank, rank_standby=self.rank_standby,
                                  rank_standby_preload=self.rank_standby_preload)
        offload = OffloadConfig(
            mode=self.mode(),
            resident_layers=self.dlo_resident_layers,
            device_memory_gb=self.dlo_device_memory_gb,
            device_share=self.dlo_device_share,
            components=parse_components(self.dlo_components),
            probe_shape=parse_probe_size(self.dlo_probe_size) if self.dlo_probe_size else None,
        )
        model = ModelConfig(dtype=None if self.dtype == "auto" else self.dtype,
                            quantization=None if self.quantization in (None, "auto") else self.quantization,
                            cfg_batch=self.cfg_batch, compile=self.compile,
                            attention=self.attention)
        scheduler = SchedulerConfig(scheduler=self.scheduler,  # type: ignore[arg-type]
                                    queue_size=self.queue_size, starve_s=self.starve_s,
                                    max_wait_ms=self.max_wait_ms,
                                    max_queue_wait_s=self.max_queue_wait_s, job_retries=self.job_retries,
                                    max_batch_size=self.max_batch_size)  # type: ignore[arg-type]
        return EngineConfig(model_dir=model_dir, parallel=parallel, offload=offload, model=model,
                            lora=LoraConfig(self.lora_cache_gb), step_cache=step_cache(self.cache),
                            scheduler=scheduler)
