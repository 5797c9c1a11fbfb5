"""The video job service behind the HTTP routes: validation, job records, the dispatcher.

Framework-free (no FastAPI here) so the routes stay thin. Validation runs entirely in
the ingress (pydantic -> GenerationRequest.check -> model adapter rules from the model's
config files -> operator limits): bad input never reaches a worker.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
import uuid
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from service.api.schemas import BodyError, Video, parse_body, validate_create
from service.api.store import JobStore
from service.engine.group import Engine, EngineSpec, Outcome
from service.engine.metrics import metrics
from service.models.adapter import load_adapter
from service.models.demo import resolve_model
from service.models.request import GenerationRequest, RequestError
from service.router.dispatcher import Dispatcher
from service.router.policy import DeadlinePolicy, Limits
from service.router.waves import Ticket

log = logging.getLogger("dloserve.api")


class ServiceConfig(BaseModel):
    """Everything `dloserve serve` flags and the Serve config file's ``args`` can set."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="diffusers pipeline dir; None = demo model")
    model_name: str | None = None
    dp_size: int = Field(1, ge=1)
    offload: bool = True
    use_allgather: bool = True
    cpus_per_rank: float = 1.0
    gpus_per_rank: float = 0.0
    strategy: str = "STRICT_PACK"
    num_replicas: int = 1
    max_wait_ms: float = 50.0
    queue_size: int = 64
    results_dir: str = str(Path.home() / ".cache" / "dloserve" / "results")
    retention_s: float = 86400.0
    max_jobs: int = 1000
    pg_timeout_s: float = 3600.0  # last resort: request deadlines tear a group down first
    scheduler: Literal["continuous", "waves"] = "continuous"
    starve_s: float = Field(30.0, gt=0)
    encoders_per_rank: int = Field(1, ge=0)
    instance: str | None = Field(None, description="set by the launcher; /readyz reports it")
    limits: dict[str, Any] = Field(default_factory=dict)
    deadline: dict[str, Any] = Field(default_factory=dict)
    defaults: dict[str, Any] = Field(default_factory=dict)

    def engine_spec(self, model_dir: str) -> EngineSpec:
        return EngineSpec(
            model_dir=model_dir,
            dp_size=self.dp_size,
            offload=self.offload,
            use_allgather=self.use_allgather,
            cpus_per_rank=self.cpus_per_rank,
            gpus_per_rank=self.gpus_per_rank,
            strategy=self.strategy,
            pg_timeout_s=self.pg_timeout_s,
            encoders_per_rank=self.encoders_per_rank,
        )


class VideoService:
    """One DP group, its dispatcher and the job store; the Sink the dispatcher reports to."""

    def __init__(self, cfg: ServiceConfig, placement_group: Any = None) -> None:
        self.cfg = cfg
        self.model_dir = resolve_model(cfg.model)
        self.model_name = cfg.model_name or Path(self.model_dir).name
        self.adapter = load_adapter(self.model_dir)  # config files only, no weights
        self.limits = Limits(**cfg.limits)
        self.defaults = GenerationRequest(prompt="-", **cfg.defaults)
        self.store = JobStore(
            os.path.expanduser(cfg.results_dir), ttl_s=cfg.retention_s, max_jobs=cfg.max_jobs
        )
        if cfg.num_replicas == 1:
            self._fail_orphans()
        self.engine = Engine(cfg.engine_spec(self.model_dir), pg=placement_group)
        self.dispatcher = Dispatcher(
            self.engine, self, scheduler=cfg.scheduler, max_wait_s=cfg.max_wait_ms / 1000.0,
            max_queue=cfg.queue_size, deadlines=DeadlinePolicy(**cfg.deadline), starve_s=cfg.starve_s,
        )
        self.started_at = time.time()
        self.dispatcher.start()

    def _fail_orphans(self) -> None:
        """Jobs a previous process left queued/in progress will never run: end them.

        Only safe when this replica is the folder's only writer (num_replicas == 1).
        """
        n = self.store.fail_unfinished("interrupted", "the service restarted before this job ended")
        if n:
            log.warning("marked %d unfinished jobs from a previous run as failed", n)

    # -- requests ----------------------------------------------------------------------
    def create(self, content_type: str, raw: bytes) -> dict[str, Any]:
        """Validate fully, record, queue. Raises BodyError (422) or QueueFull (429)."""
        body = validate_create(parse_body(content_type, raw))
        if body.model is not None and body.model != self.model_name:
            raise BodyError("model", f"this service serves {self.model_name!r}, not {body.model!r}")
        if body.seed is None and "seed" not in self.cfg.defaults:
            # Like other generation APIs: no seed, a fresh one (reported, so reproducible).
            body = body.model_copy(update={"seed": secrets.randbelow(2**31)})
        req = body.to_request(self.defaults)
        try:
            self.adapter.validate(req)
            self.limits.check(req)
        except RequestError as e:
            field = "max_sequence_length" if e.field == "extra.max_sequence_length" else e.field
            raise BodyError(field, e.message) from None
        job_id = f"video_{uuid.uuid4().hex}"
        rec = {
            "id": job_id,
            "object": "video",
            "status": "queued",
            "progress": 0,
            "created_at": int(time.time()),
            "model": self.model_name,
            "prompt": req.prompt,
            "seconds": f"{(req.num_frames - 1) / req.fps:g}",
            "size": f"{req.width}x{req.height}",
            "seed": req.seed,
            "num_frames": req.num_frames,
            "fps": req.fps,
            "num_inference_steps": req.num_inference_steps,
            "guidance_scale": req.guidance_scale,
        }
        self.store.put(rec)
        accepted = dict(rec)  # the job as accepted; the dispatcher may move it on at once
        try:
            self.dispatcher.submit(job_id, req.compat_key(), req)
        except Exception:
            self.store.delete(job_id)
            raise
        return accepted

    def get(self, job_id: str) -> dict[str, Any] | None:
        return self.store.get(job_id)

    def delete(self, job_id: str) -> str:
        """'deleted', 'missing', or 'running' (a running wave cannot drop one rank)."""
        rec = self.store.get(job_id)
        if rec is None:
            return "missing"
        if rec["status"] == "in_progress":
            return "running"
        if rec["status"] == "queued" and not self.dispatcher.cancel(job_id):
            return "running"  # picked by a wave just now
        self.store.delete(job_id)
        return "deleted"

    def list(self, after: str | None, limit: int, order: str) -> tuple[list[dict], bool]:
        recs = self.store.list()
        if order == "desc":
            recs.reverse()
        if after:
            ids = [r["id"] for r in recs]
            recs = recs[ids.index(after) + 1 :] if after in ids else []
        return recs[:limit], len(recs) > limit

    def readiness(self) -> dict[str, Any]:
        st = self.engine.status()
        return {
            "ready": st["state"] in ("ready", "degraded"),
            **st,
            "scheduler": self.cfg.scheduler,
            "instance": self.cfg.instance,
            "queue_depth": self.dispatcher.depth,
            "in_flight": self.dispatcher.held,
            "waves_run": self.dispatcher.assignments,
            "model": self.model_name,
            "model_dir": self.model_dir,
        }

    def waves(self) -> list[dict[str, Any]]:
        return list(self.dispatcher.history)

    def close(self) -> None:
        self.dispatcher.stop()

    # -- Sink: called from the dispatcher thread ---------------------------------------
    def on_start(self, ticket: Ticket, info: dict[str, Any]) -> None:
        self.store.update(ticket.id, status="in_progress", wave=info["wave"], dp_rank=info["rank"])

    def on_progress(self, ticket_id: str, step: int, total: int) -> None:
        self.store.update(ticket_id, progress=min(99, int(100 * step / max(1, total))))

    def on_finish(self, ticket: Ticket, outcome: Outcome, info: dict[str, Any]) -> None:
        if outcome.ok:
            self.store.finish(
                ticket.id, outcome.mp4, status="completed", progress=100, dp_rank=outcome.dp_rank
            )
            status = "completed"
        else:
            err = {"code": "generation_failed", "message": outcome.error or "unknown error"}
            self.store.finish(ticket.id, None, status="failed", error=err)
            status = "failed"
        metrics()["requests"].inc(1, tags={"status": status})


def video_object(rec: dict[str, Any]) -> dict[str, Any]:
    """The public shape of a record (drops nothing the client needs, adds nothing private)."""
    return Video.model_validate(rec).model_dump()
