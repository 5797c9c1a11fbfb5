"""The one engine config: every concern's settings, gathered (vLLM's ``VllmConfig`` form).

Made once (from the flags of ``generate``, ``serve`` or the batch job: ``service.config.args``;
or from the Serve config: ``service.api.config.ServiceConfig.engine_config``) and handed
down unchanged to the executor, every rank and the pipeline; only ``--dlo-mode auto`` is
replaced, once, by what the probe chose (``resolved``), and the choice travels with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from service.offload.mode import ModeChoice, OffloadMode

from .cache import CacheError, CacheSpec
from .errors import FlagError
from .lora import LoraConfig
from .model import ModelConfig
from .offload import OffloadConfig
from .parallel import ParallelConfig
from .scheduler import SchedulerConfig


@dataclass(frozen=True)
class EngineConfig:
    """What one ingress replica, batch job or ``generate`` runs: the model folder and each
    concern's config. ``step_cache``: the step cache of requests that name none (None: no
    cache). ``choice``: what ``--dlo-mode auto`` resolved to (set by ``resolved``), else None."""

    model_dir: str = ""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    step_cache: CacheSpec | None = None
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    choice: ModeChoice | None = None

    def __post_init__(self) -> None:
        if self.step_cache is not None and not self.step_cache.enabled:
            object.__setattr__(self, "step_cache", None)  # method none: no cache
        if self.parallel.sp_size > 1:
            if self.offload.mode is OffloadMode.AUTO:  # an SP group gathers: one mode to choose
                object.__setattr__(self, "offload", self.offload.resolved(OffloadMode.ALLGATHER))
            self._check_sequence_parallel()

    def _check_sequence_parallel(self) -> None:
        """What an SP group cannot do yet, every refusal named in one message."""
        off, model = self.offload, self.model
        if off.mode is OffloadMode.RANK_LOCAL:
            raise FlagError("--sequence-parallel-size gathers each block over the SP group: "
                            "drop --dlo-no-use-allgather / --dlo-mode rank-local")
        placed = (("--dlo-resident-layers", off.resident_layers),
                  ("--dlo-device-memory-gb", off.device_memory_gb))
        refused = [flag for flag, value in placed if value is not None]
        if off.components != ("dit",):
            refused.append("--dlo-components")
        if model.quantization == "fp8":
            refused.append("--quantization")
        if self.step_cache is not None:
            refused.append("--cache")
        if model.attention not in ("exact", "sdpa"):  # exact routes SP's all-to-all calls to SDPA
            refused.append(f"--attention {model.attention}")
        refused += [f"--{k.replace('_', '-')} on" for k in ("cfg_batch", "compile")
                    if getattr(model, k) == "on"]
        if refused:
            raise FlagError(f"{', '.join(refused)}: not yet with --sequence-parallel-size > 1 (an SP group "
                            "always gathers over its ranks and streams the transformer only)")

    # -- the auto choice --------------------------------------------------------------
    @property
    def mode(self) -> OffloadMode:
        return self.offload.mode

    def resolved(self, choice: ModeChoice) -> EngineConfig:
        """The same config with auto's choice in place (and kept: ``choice``)."""
        if self.offload.mode is not OffloadMode.AUTO:
            raise ValueError(f"--dlo-mode is {self.offload.mode.value}: nothing to resolve")
        return replace(self, offload=self.offload.resolved(choice.mode), choice=choice)

    @property
    def rank_decides_auto(self) -> bool:
        """auto with one group of one process: the layout is the same for either mode, so the
        rank decides at its load (where it opens the checkpoint anyway, its imports done)
        instead of the engine's process importing the model's classes to decide first."""
        return (self.offload.mode is OffloadMode.AUTO and self.parallel.dp_size == 1
                and self.parallel.sp_size == 1)

    def mode_report(self) -> dict[str, Any]:
        """The mode and why, as /readyz's ``offload_mode`` says it."""
        if self.choice is not None:
            return self.choice.as_dict()
        if self.offload.mode is OffloadMode.AUTO:
            return {"mode": "auto", "reason": "not decided yet: the rank decides at its load (one group)"}
        return {"mode": self.offload.mode.value, "reason": "set by flags"}

    # -- the groups -------------------------------------------------------------------
    @property
    def collective(self) -> bool:
        """Whether the ranks gather weights from each other (and so must tick together)."""
        return self.offload.mode is OffloadMode.ALLGATHER and self.parallel.dp_size > 1

    def group_layout(self) -> list[tuple[int, int]]:
        """(first rank process, scheduler ranks) of each group: one AllGather group of N, N
        single ranks, or D SP groups (each one scheduler rank over S processes).
        Auto mode must be resolved first."""
        if self.offload.mode is OffloadMode.AUTO and not self.rank_decides_auto:
            raise ValueError("resolve --dlo-mode auto before laying out the groups")
        dp, sp = self.parallel.dp_size, self.parallel.sp_size
        if sp > 1:
            return [(d * sp, 1) for d in range(dp)]
        if self.collective:
            return [(0, dp)]
        return [(r, 1) for r in range(dp)]

    # -- checks that need the model ---------------------------------------------------
    def probe_problem(self, adapter: Any, device: str) -> str | None:
        """Why this model cannot run the load-time probe (or serve the weights) these settings
        need, or None (auto without a probe picks AllGather and says so; a device budget cannot
        do without one)."""
        quantization = self.model.quantization
        if self.offload.device_memory_gb is not None and device == "cuda" and not adapter.can_probe:
            return (f"--dlo-device-memory-gb needs a load-time probe, which {adapter.family} does not have "
                    "yet (Wan does)")
        # a model folder (not a family class) says what it holds: fp8 unless the flag says otherwise
        if quantization != "fp8" and not isinstance(adapter, type) and adapter.stored_quantization():
            if quantization == "none":
                return (f"--quantization none: {adapter.model_dir} holds fp8 weights (written by "
                        "`dloserve quantize`) and cannot be served unquantized; drop the flag (its fp8 "
                        "is read by default)")
            if adapter.sequence_parallel > 1:
                return (f"{adapter.model_dir} holds fp8 weights: not yet with --sequence-parallel-size > 1 "
                        "(serve the unquantized folder)")
        return None


def step_cache(value: str | dict[str, Any] | CacheSpec | None) -> CacheSpec | None:
    """A ``--cache`` spec (or a Serve config mapping) -> the checked spec; None for ``none``."""
    if value is None:
        return None
    try:
        spec = CacheSpec.from_obj(value)
    except (CacheError, TypeError) as e:
        raise FlagError(f"--cache: {e}") from None
    return spec if spec.enabled else None


# -- the Serve config's ``offload`` mapping ------------------------------------------------

# Its keys (the settings of the old OffloadSettings) -> (concern, field) where each now lives.
OFFLOAD_KEYS = {
    **{f.name: ("offload", f.name) for f in fields(OffloadConfig)},
    **{f.name: ("model", f.name) for f in fields(ModelConfig)},
    "lora_cache_gb": ("lora", "cache_gb"),
    "cache": ("step_cache", ""),
}


def from_offload_mapping(mapping: dict[str, Any], mode: OffloadMode) -> dict[str, Any]:
    """The Serve config's ``offload`` mapping (one flat mapping, as it has always been) -> the
    EngineConfig keyword arguments it sets; ``mode``: when it names none. FlagError naming an
    unknown key, or a bad value, as ``offload.KEY``."""
    if "use_allgather" in mapping:
        raise FlagError("offload.use_allgather is gone: write offload.mode: allgather (true) or rank-local "
                        "(false)")
    unknown = sorted(set(mapping) - set(OFFLOAD_KEYS))
    if unknown:
        raise FlagError(f"offload: unknown setting(s) {unknown}; known: {sorted(OFFLOAD_KEYS)}")
    parts: dict[str, dict[str, Any]] = {"offload": {"mode": mode}, "model": {}, "lora": {}}
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        concern, name = OFFLOAD_KEYS[key]
        if concern == "step_cache":
            out["step_cache"] = step_cache(value)
        else:
            parts[concern][name] = tuple(value) if isinstance(value, list) else value
    try:
        out.update(offload=OffloadConfig(**parts["offload"]), model=ModelConfig(**parts["model"]),
                   lora=LoraConfig(**parts["lora"]))
    except (TypeError, ValueError) as e:
        raise FlagError(f"offload: {e}") from None
    return out


def offload_mapping(config: EngineConfig) -> dict[str, Any]:
    """The inverse: the flat ``offload`` mapping of ``config`` (plain JSON, Serve's ``args``)."""
    off, model = config.offload, config.model
    return {"mode": off.mode.value, "resident_layers": off.resident_layers,
            "device_memory_gb": off.device_memory_gb, "device_share": off.device_share,
            "components": list(off.components),
            "probe_shape": list(off.probe_shape) if off.probe_shape else None,
            "dtype": model.dtype, "quantization": model.quantization, "cfg_batch": model.cfg_batch,
            "compile": model.compile, "attention": model.attention, "lora_cache_gb": config.lora.cache_gb,
            "cache": config.step_cache.as_dict() if config.step_cache else None}
