"""The video job service behind the HTTP routes: admission, job records, adapters, keys, readiness.

Framework-free (no FastAPI here) so the routes stay thin. Validation runs entirely in
the ingress (pydantic -> GenerationRequest.check -> model adapter rules from the model's
config files -> operator limits): bad input never reaches a worker.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import time
import uuid
from pathlib import Path
from typing import Any

from service.api.adapter_io import AdapterIO
from service.api.config import ServiceConfig
from service.api.durable import StateKeeper
from service.api.errors import ForbiddenSource, LoraExists
from service.api.heartbeat import Heartbeat
from service.api.images import take_image
from service.api.keys import AuthError, Caller, Keys, owner_id
from service.api.records import JobRecord, JobStatus
from service.api.results import StorageError, open_storage
from service.api.schemas import BodyError, Video, validate_create
from service.api.sink import JobSink
from service.api.startup import Launched, startup_breakdown
from service.api.storage_health import StorageHealth
from service.api.store import JobTable
from service.api.views import public_ready, tenant_ready, tenant_record
from service.engine.executor import Executor
from service.models.checks import check_request
from service.models.lora_checks import NotRegularFile, check_regular
from service.models.lora_ref import LoraError
from service.models.lora_registry import LoraRegistry, Registered
from service.models.registry import load_adapter, request_defaults, resolve_model
from service.models.request import GenerationRequest, RequestError
from service.router.build import build_dispatcher

log = logging.getLogger("dloserve.api")
__all__ = ["AuthError", "ServiceConfig", "VideoService", "connect_job_store", "video_object"]


def connect_job_store(cfg: ServiceConfig, url: str | None = None) -> Any:
    """The cluster's job store for ``cfg``'s results storage (``url``: its opened URL), started
    if not running: the replica's, and the launcher's start of it beside Serve's."""
    from service.api.jobs import connect_store

    if url is None:
        url = open_storage(os.path.expanduser(cfg.results_url), cfg.storage_options).url
    return connect_store(url, cfg.storage_options, retention_s=cfg.retention_s, max_jobs=cfg.max_jobs,
                         group_timeout_s=cfg.group_timeout_s, webhooks=cfg.webhook_targets())


class VideoService:
    """One DP group, its dispatcher and the job store. The dispatcher reports to the job sink
    (sink.py); the heartbeat (heartbeat.py) keeps the group's standing in the store."""

    def __init__(self, cfg: ServiceConfig, placement_group: Any = None, dp_group: str | None = None, *,
                 executor: Executor | None = None, store: Any = None, node_id: str | None = None,
                 launched: Launched | None = None) -> None:
        """``executor`` and ``store`` default to Ray's (rank actors, the cluster's job-store
        actor); tests pass the fake executor and an in-process ``JobStore``. ``launched``:
        what ``dloserve serve`` did before Serve started this replica."""
        self.replica_at = time.time()  # /readyz startup: the launcher's steps end here
        self.cfg = cfg
        self.launched = launched or Launched()
        self.model_dir = resolve_model(cfg.model)
        self.model_name = cfg.model_name or Path(self.model_dir).name
        self.adapter = load_adapter(self.model_dir, cfg.sequence_parallel_size)  # config files only
        self.limits = cfg.request_limits()
        # An image larger than any video this instance makes is refused from its header.
        self.image_pixels = min(cfg.max_image_pixels, self.limits.max_width * self.limits.max_height)
        self.engine = cfg.engine_config(self.model_dir)  # the one EngineConfig of this replica
        model = self.engine.model

        def lora_targets() -> Any:  # the transformer's Linears (torch's import) at the first adapter
            from service.models.lora import targets_of

            return targets_of(self.adapter, model.dtype, model.quantization)

        self.loras = LoraRegistry(lora_targets, owners=bool(cfg.api_key_hashes))
        for name, source in cfg.loras.items():  # a bad adapter fails the start, naming it
            self.loras.register(name, os.path.expanduser(source))
        self.adapter_io = AdapterIO(cfg.lora_io_threads, cfg.lora_read_timeout_s)  # POST /v1/loras' reads
        # a field a request leaves out: the service's defaults, else the model folder's, else ours
        self.defaults = GenerationRequest(prompt="-", **{**request_defaults(self.model_dir), **cfg.defaults})
        self._cache_default = self.engine.step_cache
        self.dp_group = dp_group or uuid.uuid4().hex[:12]
        self.keys = Keys(cfg.api_key_hashes, cfg.admin_key_hashes)
        self._owners = {owner_id(h) for h in cfg.api_key_hashes}  # an adopted job's key must be one
        self.storage = open_storage(os.path.expanduser(cfg.results_url), cfg.storage_options)
        if node_id is None:
            import ray

            node_id = ray.get_runtime_context().get_node_id()
        self.node_id = node_id
        self.storage_health = StorageHealth(self.storage, self.dp_group)  # a failed write: not ready, 507
        self.states = StateKeeper(self.storage)  # running jobs' per-step states, for a restart
        if store is None:
            store = connect_job_store(cfg, self.storage.url)
        self.store: JobTable = store  # JobStore's methods, in-process or through its actor
        self.sink = JobSink(self.store, self.storage, self.storage_health, self.states, self.dp_group)
        self.dispatcher = build_dispatcher(
            self.engine, self.sink, placement=placement_group, executor=executor,
            deadlines=cfg.deadlines(), tenants=cfg.tenants(),
        )
        self.started_at = time.time()
        self._draining: str | None = None
        self.dispatcher.start()
        self.heartbeat = Heartbeat(self)
        self.heartbeat.start()

    def revoked(self, owner: str | None) -> bool:
        """Whether ``owner``'s key is no longer one of this service's (an adopted job's key
        must be one: a key removed from the key file before a restart takes its jobs along)."""
        return owner is not None and not self.keys.open and owner not in self._owners

    # -- requests ----------------------------------------------------------------------
    def create(self, fields: dict[str, Any], owner: str | None = None, strict: bool = True) -> JobRecord:
        """Validate fully, record, queue. Raises BodyError (422), QuotaExceeded (429, the
        owner's own queue), QueueFull (429, the whole queue) or Unavailable (503: no rank
        group can serve and none is about to). ``strict``: a JSON body, whose numbers must
        be numbers (a form's are strings). Admission first: the storage, the owner's quota
        and the queue's room are checked before the image is decoded (StorageError: 507)."""
        self.storage_health.refuse()
        self.dispatcher.admit(owner)
        image = take_image(fields, self.cfg.max_image_bytes, self.image_pixels)
        body = validate_create(fields, strict=strict)
        if body.model is not None and body.model != self.model_name:
            raise BodyError("model", f"this service serves {self.model_name!r}, not {body.model!r}")
        if body.seed is None and "seed" not in self.cfg.defaults:
            # Like other generation APIs: no seed, a fresh one (reported, so reproducible).
            body = body.model_copy(update={"seed": secrets.randbelow(2**31)})
        req = dataclasses.replace(body.to_request(self.defaults), image=image)
        req = self._priority(req, body.priority is None, owner)
        try:
            self.adapter.validate(req)
            self.limits.check(req)
            req = self._resolve_loras(req, owner)
            # the rank's own checks, here: what the edge accepts no rank refuses
            check_request(self.adapter, req, self.engine.lora.cache_bytes, self._cache_default)
        except RequestError as e:
            field = {"image": "input_reference"}.get(e.field, e.field.removeprefix("extra."))
            raise BodyError(field, e.message) from None
        now = time.time()
        rec = JobRecord(
            id=f"video_{uuid.uuid4().hex}",
            created_at=int(now),
            created=now,
            model=self.model_name,
            prompt=req.prompt,
            seconds=f"{(req.num_frames - 1) / req.fps:g}",
            size=f"{req.width}x{req.height}",
            seed=req.seed,
            num_frames=req.num_frames,
            fps=req.fps,
            num_inference_steps=req.num_inference_steps,
            guidance_scale=req.guidance_scale,
            priority=req.priority,
            loras=[u.model_dump(exclude_none=True) for u in body.loras],  # as asked, so a remix can ask again
            cache=None if body.cache is None else body.cache.model_dump(exclude_none=True),
            owner=owner,  # who may see it (the API key's id); never in the video object
            dp_group=self.dp_group,  # the replica whose DP group runs it, and its node
            node_id=self.node_id,
        )
        try:
            self.store.put(rec, req if self.cfg.job_retries else None)  # the request: to run it elsewhere
        except StorageError as e:
            self.storage_health.failed(e, len(str(rec.to_json())))
            raise
        try:
            self.states.track(rec.id, req)
            self.dispatcher.submit(rec.id, req.compat_key(), req, tenant=owner)
        except Exception:
            self.store.delete(rec.id)
            raise
        return rec  # the job as accepted; the dispatcher may move it on at once

    def _priority(self, req: GenerationRequest, default: bool, owner: str | None) -> GenerationRequest:
        """The key's floor (``min_priority``): a request without a priority gets it where it
        is worse than the default; one better than it is a 422 naming ``priority``."""
        floor = self.dispatcher.scheduler.tenants.quota(owner).min_priority
        if floor is None:
            return req
        if default and req.priority < floor:
            return dataclasses.replace(req, priority=floor)
        if req.priority < floor:
            raise BodyError("priority", f"{req.priority} is better than this API key may ask for: its "
                            f"floor is {floor} (lower is served first; min_priority in the key file)")
        return req

    def _resolve_loras(self, req: GenerationRequest, owner: str | None) -> GenerationRequest:
        """The request's adapters resolved to checked files; RequestError before any compute."""
        if not req.loras:
            return req
        from dataclasses import replace

        refs, need = self.loras.resolve(req.loras, owner)
        budget = self.engine.lora.cache_bytes
        if need > budget:
            raise RequestError("loras", f"the adapters need {need / 2**20:.1f} MiB of device memory, "
                                        f"over the LoRA cache of {budget / 2**20:.1f} MiB (--lora-cache-gb)")
        return replace(req, loras=refs)

    # -- adapters (POST/GET/DELETE /v1/loras) -------------------------------------------------

    def add_lora(self, name: str, source: str, owner: str | None = None) -> Registered:
        """Register a file under one of ``lora_dir``. ForbiddenSource (outside them, or no
        dirs), LoraExists (name taken), LoraLimit (the owner's cap), LoraError (a bad file,
        naming the key)."""
        try:
            path = Path(os.path.expanduser(source)).resolve()
        except (OSError, RuntimeError):  # a symlink loop: its message holds the resolved path
            raise LoraError(name, "source", "cannot resolve it (a symlink loop?)") from None
        roots = [Path(os.path.expanduser(d)).resolve() for d in self.cfg.lora_dir]
        if not roots:
            raise ForbiddenSource("run-time adapter registration is off on this server (start it with "
                                  "--lora-dir FOLDER, or register adapters with --lora NAME=PATH)")
        if not any(path.is_relative_to(r) for r in roots):
            raise ForbiddenSource("source must be a file under one of this server's --lora-dir folders")
        try:
            check_regular(path)  # a FIFO or a device would block the reader: refused unopened
        except NotRegularFile as e:
            raise LoraError(name, "source", str(e)) from None
        except FileNotFoundError:
            raise LoraError(name, "source", f"no file {source!r} under --lora-dir") from None
        except OSError as e:  # EACCES and such (never the path: its message would name it)
            why = e.strerror or type(e).__name__
            raise LoraError(name, "source", f"cannot read it: {why}") from None
        try:
            return self.loras.register(name, str(path), owner, limit=self.cfg.max_loras_per_key)
        except KeyError as e:  # the registry's word for a name that is taken
            raise LoraExists(str(e.args[0])) from None

    def list_loras(self, owner: str | None = None) -> list[Registered]:
        """The adapters ``owner`` may use: the server's and its own (``loras.page``: a page)."""
        return self.loras.list(owner)

    def delete_lora(self, name: str, owner: str | None = None) -> bool:
        return self.loras.remove(name, owner)

    def get(self, job_id: str, owner: str | None = None) -> JobRecord | None:
        """The job if it exists and belongs to ``owner``. Without keys the caller is None:
        a job a key made (a restart on the same folder with the key file missing) stays
        that key's, never an anonymous caller's."""
        rec = self.store.get(job_id)
        if rec is None or rec.owner != owner:
            return None  # another key's job is "not found": its existence is not told either
        return rec

    def delete(self, job_id: str, owner: str | None = None) -> str:
        """'deleted', 'missing', or 'cancelling': it was running, so it stops at its next
        forward and ends ``cancelled`` (a second DELETE removes the record). A job another
        replica holds is cancelled there at its next heartbeat."""
        rec = self.get(job_id, owner)
        if rec is None:
            return "missing"
        if not rec.final:
            if rec.dp_group == self.dp_group:
                if self.dispatcher.cancel(job_id) == "running":
                    return "cancelling"
                self.states.forget(job_id)
            elif rec.status is JobStatus.IN_PROGRESS:
                self.store.request_cancel(job_id)
                return "cancelling"
        self.store.delete(job_id)  # a queued job of another replica: it hears at its next beat
        return "deleted"

    def list(self, after: str | None, limit: int, order: str, owner: str | None = None,
             ) -> tuple[list[JobRecord], bool]:
        return self.store.page(owner, True, after, limit, order)  # keyless: the unowned only

    def owner_of(self, authorization: str | None) -> str | None:
        """The caller's owner id from ``Authorization: Bearer KEY``; AuthError if keys are on
        and it is missing or unknown. Keys are compared by SHA-256, in constant time."""
        return self.keys.owner_of(authorization)

    def caller(self, authorization: str | None) -> Caller:
        return self.keys.caller(authorization)

    def readiness_for(self, caller: Caller) -> dict[str, Any]:
        """/readyz as ``caller`` may read it (views.py): ready or not for anyone, the engine
        and its own counts for an API key, everything for an admin key."""
        full = self.readiness()
        if caller.admin:
            return full
        if not caller.user:
            return public_ready(full)
        quota = self.dispatcher.scheduler.tenants.quota(caller.owner)
        yours = {**self.dispatcher.counts(caller.owner), "max_queued": quota.max_queued,
                 "max_running": quota.max_running, "min_priority": quota.min_priority}
        return tenant_ready(full, yours)

    def readiness(self) -> dict[str, Any]:
        st = self.dispatcher.status()
        if self._draining:
            st["state"], st["last_error"] = "draining", self._draining
        storage = self.storage_health.problem()
        return {
            "ready": st["state"] in ("ready", "degraded") and storage is None,
            "storage": {"ok": storage is None, **(storage or {})},
            **st,
            "scheduler": self.cfg.scheduler,
            "cpus_per_rank": {"value": self.cfg.cpus_per_rank, "why": self.cfg.cpus_per_rank_why},
            "instance": self.cfg.instance,
            "queue_depth": self.dispatcher.depth,
            "in_flight": self.dispatcher.held,
            "waves_run": self.dispatcher.assignments,
            "model": self.model_name,
            "model_card": self.adapter.card(),
            "model_dir": self.model_dir,
            "dp_group": self.dp_group,
            "node_id": self.node_id,
            "results_url": self.storage.url,
            "startup": startup_breakdown(self.launched.marks, self.replica_at, st.get("startup", {}),
                                         len(st["groups"])),
        }

    def health_problem(self) -> str | None:
        """Why this replica cannot serve and will not recover by itself (Serve's health check).

        A group that is rebuilding is recovering: healthy. Unhealthy: the dispatcher thread
        is gone, or no group has been able to start for ``unhealthy_after_s``.
        """
        if self._draining:
            return None
        if not self.dispatcher.alive:
            return "the dispatcher thread is not running"
        since = self.dispatcher.unavailable_since
        if since is not None and time.monotonic() - since > self.cfg.unhealthy_after_s:
            return f"no rank group could start for {time.monotonic() - since:.0f} s: " \
                   f"{self.dispatcher.status()['last_error']}"
        return None

    def draining(self) -> str | None:
        """Why new work is refused (503), or None."""
        return self._draining

    def drain(self, timeout_s: float, reason: str = "service stopped") -> dict[str, Any]:
        """Refuse new work; fail queued jobs now; give running ones ``timeout_s`` to finish,
        then fail them with ``reason``. Status reads keep working throughout."""
        self._draining = f"{reason}: draining"
        t0 = time.monotonic()
        queued = self.dispatcher.fail_queued(reason)
        while self.dispatcher.held and time.monotonic() - t0 < timeout_s:
            time.sleep(0.1)
        left = self.dispatcher.held
        self.dispatcher.stop()
        self.sink.close()  # every outcome stored before the app goes
        return {"queued_failed": queued, "running_failed": left, "seconds": round(time.monotonic() - t0, 1)}

    def waves(self, caller: Caller) -> list[dict[str, Any]]:
        """The recent assignments: an admin's (or an open service's) every record, an API
        key's own only (views.tenant_record: no tenant, no global wave number)."""
        hist = list(self.dispatcher.history)
        if caller.admin:
            return [{k: v for k, v in r.items() if k != "tenant" or not self.keys.open} for r in hist]
        return [tenant_record(r) for r in hist if r.get("tenant") == caller.owner]

    def close(self) -> None:
        """Stop without a drain, ending none of the jobs held: a replica deleted, or SIGTERMed
        by the watchdog after ``serve`` itself was SIGKILLed (a Ray actor's ``__del__`` runs
        on SIGTERM), must leave its jobs as a crash would, unfinished, for the job store to
        hand to another replica or to the next ``serve`` (api/jobs.py); failing them here
        "service stopped" lost them whenever the store outlived the replica. ``drain`` (the
        launcher's stop) is what ends jobs."""
        self.heartbeat.stop()
        self.adapter_io.close()
        self.dispatcher.stop(fail=False)
        self.sink.close()


def video_object(rec: JobRecord, admin: bool = False) -> dict[str, Any]:
    """The public shape of a record (drops nothing the client needs, adds nothing private):
    ``node_id`` (which Ray node ran it: the cluster's business) only for an ``admin`` caller
    (an admin key, or an open service with no key of either kind: keys.py)."""
    v = Video.model_validate(rec.to_json()).model_dump()
    if not admin:
        v["node_id"] = None
    return v
