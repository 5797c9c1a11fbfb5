"""What one dloserve instance is configured with: the Serve app's ``args``, made from the
``dloserve serve`` flags (serve_flags.py) or a ``serve deploy`` config file.

One name per setting: a field is its flag (``--max-jobs`` is ``max_jobs``) and its Serve
config key. A field marked ``Flag`` is declared as a flag from the field itself (its default,
its description as the help; serve_flags.py); the engine half's flags are ``EngineArgs``'
(service.config.args), named as these fields are. Older Serve config keys (``dp_size``,
``limits: {...}``, ...) are still read, with a FutureWarning naming the new key.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from service.api.keys import owner_id
from service.config import EngineConfig, FlagError, ParallelConfig, SchedulerConfig
from service.config.engine import from_offload_mapping, offload_mapping
from service.config.offload import STREAMED_DEFAULT
from service.models.image import MAX_IMAGE_PIXELS
from service.models.lora_ref import MAX_LORAS_PER_KEY
from service.router.policy import DeadlinePolicy, Limits
from service.router.tenants import Quota, Tenants

# Defaults written once, where they are used: the engine half's in its config dataclasses,
# the request limits and deadlines in the router's policy.
P, S, L, D = ParallelConfig, SchedulerConfig, Limits, DeadlinePolicy


@dataclass(frozen=True)
class Flag:
    """Marks a ServiceConfig field as a ``dloserve serve`` flag (``--field-name`` unless
    ``names``): serve_flags.py declares it from the field. ``zero_is_none``: the flag's 0
    is the field's None (no cap)."""

    names: tuple[str, ...] = ()
    zero_is_none: bool = False
    kw: dict[str, Any] = field(default_factory=dict)


FLAG, CAP = Flag(), Flag(zero_is_none=True)

# Serve config keys of earlier releases: still read, with a FutureWarning.
RENAMED = {"dp_size": "data_parallel_size", "sp_size": "sequence_parallel_size",
           "strategy": "placement_strategy", "lora_dirs": "lora_dir"}
NESTED = {"limits": {k: k for k in ("max_width", "max_height", "max_pixels", "max_frames", "max_steps",
                                    "max_prompt_chars")},
          "deadline": {"base_s": "wave_deadline_base_s", "per_forward_s": "wave_deadline_per_forward_s"}}


class ServiceConfig(BaseModel):
    """Everything `dloserve serve` flags and the Serve config file's ``args`` can set.

    The engine half (ranks, placement, offload, scheduler) is the Serve config's flat form of
    one ``EngineConfig``: ``from_engine`` flattens the one the flags made, ``engine_config``
    makes it again in the replica (every default is the config dataclasses' own).
    """

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="diffusers pipeline dir; None = demo model")
    model_name: str | None = None
    data_parallel_size: int = Field(P.dp_size, ge=1)
    sequence_parallel_size: int = Field(P.sp_size, ge=1, description="sequence-parallel ranks per request "
                                        "(D SP groups)")
    offload: dict[str, Any] = Field(default_factory=dict,
                                    description="where the weights live, one flat mapping: mode (resident, "
                                                "allgather, rank-local, auto: the default), resident_layers, "
                                                "device_memory_gb, components, probe_shape, dtype, "
                                                "quantization, cfg_batch, compile, attention, lora_cache_gb, "
                                                "cache "
                                                "(service.config.engine.OFFLOAD_KEYS)")
    cpus_per_rank: float = P.cpus_per_rank
    cpus_per_rank_why: str = Field("set", description="where cpus_per_rank came from (/readyz)")
    gpus_per_rank: float = P.gpus_per_rank
    placement_strategy: str = P.strategy
    num_replicas: Annotated[int, FLAG] = Field(1, ge=1, description="DP groups (one per replica)")
    max_wait_ms: float = S.max_wait_ms
    queue_size: int = S.queue_size
    max_queue_wait_s: float = Field(S.max_queue_wait_s, gt=0, description="a queued job waits at most this "
                                    "long for a rank (e.g. while its group is rebuilt)")
    job_retries: int = Field(S.job_retries, ge=0, description="times the request on a rank whose process "
                             "died "
                             "runs again, ahead of the queue (the others on its group always do; "
                             "a lost replica's jobs once); 0: no request runs again")
    results_url: str = Field(str(Path.home() / ".cache" / "dloserve" / "results"),
                             description="folder or fsspec URL (s3://...) for job records and MP4s")
    storage_options: Annotated[dict[str, Any], Flag(kw={"metavar": "JSON"})] = Field(
        default_factory=dict, description='fsspec options for --results-url, e.g. \'{"endpoint_url": '
        '"http://minio:9000"}\' (credentials: the usual environment, e.g. AWS_ACCESS_KEY_ID)')
    group_timeout_s: Annotated[float, FLAG] = Field(30.0, gt=0, description="a replica (DP group) silent "
                                                    "this long is lost: its jobs fail with a reason")
    retention_s: Annotated[float, FLAG] = Field(86400.0, gt=0, description="keep finished jobs this long")
    max_jobs: Annotated[int, FLAG] = Field(1000, ge=1, description="keep at most this many jobs")
    pg_timeout_s: float = P.pg_timeout_s  # last resort: request deadlines tear a group down first
    scheduler: Literal["continuous", "waves"] = S.scheduler
    starve_s: float = Field(S.starve_s, gt=0)
    max_batch_size: int | Literal["auto"] = Field(S.max_batch_size, description="requests sharing each "
                                                  "streamed forward on a rank (engine/batching.py)")
    encoders_per_rank: int | None = Field(P.encoders_per_rank, ge=0, description="None: from the rank's CPUs")
    rank_standby: bool | None = Field(P.rank_standby, description="a pre-imported process per rank "
                                      "replaces one that dies; None: on GPU ranks")
    rank_standby_preload: bool = Field(P.rank_standby_preload, description="a standby of a one-process "
                                       "group loads the pipeline while it waits")
    wave_deadline_base_s: float = Field(D.base_s, ge=0, description="fixed part of each request's deadline")
    wave_deadline_per_forward_s: float = Field(D.per_forward_s, ge=0, description="deadline = base + this x "
                                               "forwards x (pixels*frames / 832*480*81)")
    max_width: Annotated[int, FLAG] = Field(L.max_width, ge=1, description="widest video, pixels")
    max_height: Annotated[int, FLAG] = Field(L.max_height, ge=1, description="tallest video, pixels")
    max_pixels: Annotated[int, FLAG] = Field(L.max_pixels, ge=1, description="largest video, width x height")
    max_frames: Annotated[int, FLAG] = Field(L.max_frames, ge=1, description="longest video, frames")
    max_steps: Annotated[int, FLAG] = Field(L.max_steps, ge=1, description="most denoising steps of a "
                                            "request")
    max_prompt_chars: int = Field(L.max_prompt_chars, ge=1)
    instance: str | None = Field(None, description="set by the launcher; /readyz reports it")
    api_key_hashes: list[str] = Field(default_factory=list,
                                      description="SHA-256 (hex) of the accepted API keys; empty = open")
    admin_key_hashes: list[str] = Field(default_factory=list,
                                        description="SHA-256 (hex) of the keys that read /readyz's detail "
                                                    "and every key's /v1/waves")
    max_queued_per_key: Annotated[int | None, CAP] = Field(
        16, ge=1, description="queued jobs per API key; beyond it 429 quota_exceeded (0 or None: no limit "
        "but --queue-size)")
    max_running_per_key: Annotated[int | None, CAP] = Field(
        None, ge=1, description="jobs per API key on ranks at once (0 or None: as many as are free)")
    key_quotas: dict[str, dict[str, int]] = Field(
        default_factory=dict, description="per-key overrides by key hash: {max_queued, max_running, "
        "min_priority (default 0: a key's requests ask for priority 0 or worse)}")
    max_body_bytes: Annotated[int, FLAG] = Field(65536, ge=1024, description="larger request bodies are "
                                                 "refused with 413 before they are read")
    max_image_bytes: Annotated[int, FLAG] = Field(
        8 * 2**20, ge=1024, description="largest input_reference image file; where the model takes images "
        "a body may be this much larger than --max-body-bytes (x 4/3 for base64 in JSON)")
    max_image_pixels: Annotated[int, FLAG] = Field(
        MAX_IMAGE_PIXELS, ge=1, description="largest input_reference image (width x height from its header, "
        "before decoding); the service also caps it at its largest video, --max-width x --max-height")
    body_timeout_s: Annotated[float, FLAG] = Field(10.0, gt=0, description="a request body must arrive "
                                                   "within this long, or 408 (slow clients)")
    first_byte_timeout_s: Annotated[float, FLAG] = Field(
        3.0, gt=0, description="a request body must start within this long, or 408 (headers sent, then "
        "nothing; only where shorter than --body-timeout-s)")
    max_uploads_per_key: Annotated[int | None, CAP] = Field(
        8, ge=1, description="request bodies one API key may send at once; more get 429 at once (0 or "
        "None: no cap)")
    max_uploads_per_address: Annotated[int | None, CAP] = Field(
        16, ge=1, description="request bodies one client address may send at once (0 or None: no cap; "
        "behind a proxy every client has the proxy's address)")
    max_uploads: int = Field(64, ge=1, description="request bodies read at once in all, well under the "
                             "replica's 256 request slots: health checks and reads always find one")
    allowed_hosts: list[str] = Field(default_factory=list, description="Host names the service answers "
                                     "to (403 forbidden_host otherwise); empty: any. A loopback bind "
                                     "sets the loopback names (DNS rebinding)")
    unhealthy_after_s: float = Field(300.0, gt=0)
    defaults: dict[str, Any] = Field(default_factory=dict)
    loras: dict[str, str] = Field(default_factory=dict, description="adapters registered at start: "
                                  "name -> .safetensors path (--lora NAME=PATH); a bad one fails the start")
    lora_dir: Annotated[list[str], Flag(kw={"action": "append", "metavar": "FOLDER"})] = Field(
        default_factory=list, description="POST /v1/loras may register .safetensors files under FOLDER "
        "(repeatable; none: adapters come only from --lora NAME=PATH at start)")
    lora_io_threads: int = Field(4, ge=1, le=64, description="threads that read adapters for POST /v1/loras "
                                 "(their own: a hung read never holds up job submission); all busy: 503")
    lora_read_timeout_s: float = Field(60.0, gt=0, description="POST /v1/loras answers 504 when reading "
                                       "and checking the file takes longer")
    max_loras_per_key: int = Field(MAX_LORAS_PER_KEY, ge=1, description="adapters one key (or, without "
                                   "keys, all callers) may register at run time; more: 409")

    webhook_url: str | None = Field(None, description="POST video.completed/failed/cancelled events of "
                                    "every job here (Standard Webhooks signatures; --webhook-url)")
    webhook_secret_file: str | None = Field(None, description="file holding the whsec_ secret that signs "
                                            "them (read by the replica that starts the job store; "
                                            "--webhook-secret-file)")
    key_webhooks: dict[str, dict[str, str]] = Field(
        default_factory=dict, description="per-key webhooks by key hash: {url, secret} (the key file's "
        "webhook_url= and webhook_secret=): that key's jobs only")
    webhook_allow_private: bool = Field(False, description="webhooks may go to loopback, private and "
                                        "link-local addresses (--webhook-allow-private; off: refused)")

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        """Earlier Serve config keys, read as today's (a FutureWarning names the new key); a
        key given both ways, or an unknown key in an old mapping, is an error naming it."""
        if not isinstance(data, dict):
            return data
        out = dict(data)
        for old in [k for k in out if k in RENAMED or k in NESTED]:
            value = out.pop(old)
            pairs = [(RENAMED[old], value)] if old in RENAMED else []
            if old in NESTED:
                if not isinstance(value, dict):
                    raise ValueError(f"{old}: a mapping, got {value!r}")
                unknown = sorted(set(value) - set(NESTED[old]))
                if unknown:
                    raise ValueError(f"{old}: unknown setting(s) {unknown}")
                pairs = [(NESTED[old][k], v) for k, v in value.items()]
            for new, v in pairs:
                if new in out:
                    raise ValueError(f"{old} and {new} both given: write {new} only")
                out[new] = v
            warnings.warn(f"Serve config key {old} is deprecated: write "
                          f"{', '.join(n for n, _ in pairs) or RENAMED.get(old, old)}", FutureWarning,
                          stacklevel=2)
        return out

    def request_limits(self) -> Limits:
        """The operator's bounds on one request (router.policy)."""
        return Limits(max_width=self.max_width, max_height=self.max_height, max_pixels=self.max_pixels,
                      max_frames=self.max_frames, max_steps=self.max_steps,
                      max_prompt_chars=self.max_prompt_chars)

    def deadlines(self) -> DeadlinePolicy:
        """How long a request may run before its group is declared hung (router.policy)."""
        return DeadlinePolicy(base_s=self.wave_deadline_base_s,
                              per_forward_s=self.wave_deadline_per_forward_s)

    @model_validator(mode="after")
    def _webhook_pairs(self) -> ServiceConfig:
        if bool(self.webhook_url) != bool(self.webhook_secret_file):
            raise ValueError("webhook_url and webhook_secret_file go together (--webhook-url, "
                             "--webhook-secret-file)")
        return self

    def webhook_targets(self) -> dict[str, Any] | None:
        """The job store's webhook settings (service.api.webhooks), the secret read from its file;
        None without any. OSError for a file that cannot be read."""
        spec: dict[str, Any] = {}
        if self.webhook_url and self.webhook_secret_file:
            spec["url"] = self.webhook_url
            spec["secret"] = Path(self.webhook_secret_file).expanduser().read_text().strip()
        if self.key_webhooks:
            spec["keys"] = {owner_id(h): dict(w) for h, w in self.key_webhooks.items()}
        if spec and self.webhook_allow_private:
            spec["allow_private"] = True
        return spec or None

    @field_validator("offload")
    @classmethod
    def _offload(cls, mapping: dict[str, Any]) -> dict[str, Any]:
        """The mapping checked as strictly as the flags, and written out whole (every key)."""
        try:
            return offload_mapping(EngineConfig(**from_offload_mapping(mapping, STREAMED_DEFAULT)))
        except FlagError as e:
            raise ValueError(str(e)) from None

    @model_validator(mode="after")
    def _engine_checks(self) -> ServiceConfig:
        """What needs more than one field (sequence parallelism against the offload mapping)."""
        try:
            self.engine_config()
        except FlagError as e:
            raise ValueError(str(e)) from None
        return self

    def engine_config(self, model_dir: str = "") -> EngineConfig:
        """The one EngineConfig of this Serve config (FlagError naming a bad field)."""
        parallel = ParallelConfig(dp_size=self.data_parallel_size, sp_size=self.sequence_parallel_size,
                                  cpus_per_rank=self.cpus_per_rank, gpus_per_rank=self.gpus_per_rank,
                                  strategy=self.placement_strategy, pg_timeout_s=self.pg_timeout_s,
                                  encoders_per_rank=self.encoders_per_rank, rank_standby=self.rank_standby,
                                  rank_standby_preload=self.rank_standby_preload)
        scheduler = SchedulerConfig(scheduler=self.scheduler, queue_size=self.queue_size,
                                    starve_s=self.starve_s, max_wait_ms=self.max_wait_ms,
                                    max_queue_wait_s=self.max_queue_wait_s, job_retries=self.job_retries,
                                    max_batch_size=self.max_batch_size)
        return EngineConfig(model_dir=model_dir, parallel=parallel, scheduler=scheduler,
                            **from_offload_mapping(self.offload, STREAMED_DEFAULT))

    @staticmethod
    def from_engine(config: EngineConfig) -> dict[str, Any]:
        """The Serve config fields of ``config`` (the flags' EngineConfig, flattened)."""
        p, s = config.parallel, config.scheduler
        return {"data_parallel_size": p.dp_size, "sequence_parallel_size": p.sp_size,
                "offload": offload_mapping(config), "cpus_per_rank": p.cpus_per_rank,
                "gpus_per_rank": p.gpus_per_rank, "placement_strategy": p.strategy,
                "pg_timeout_s": p.pg_timeout_s, "encoders_per_rank": p.encoders_per_rank,
                "rank_standby": p.rank_standby, "rank_standby_preload": p.rank_standby_preload,
                "scheduler": s.scheduler, "queue_size": s.queue_size,
                "starve_s": s.starve_s, "max_wait_ms": s.max_wait_ms, "max_queue_wait_s": s.max_queue_wait_s,
                "job_retries": s.job_retries, "max_batch_size": s.max_batch_size}

    def tenants(self) -> Tenants:
        """Each API key's quota (its owner id's), the defaults where the key file sets none;
        an open service (no keys) is one tenant bounded only by ``queue_size``."""
        if not self.api_key_hashes:
            return Tenants()
        default = Quota(self.max_queued_per_key, self.max_running_per_key, min_priority=0)  # no promotion
        overrides = {owner_id(h): replace(default, **q) for h, q in self.key_quotas.items()}
        return Tenants(default, overrides)
