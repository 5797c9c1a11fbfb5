"""The Serve deployment: one replica, one ``VideoService`` (its DP group's engine).

The replica asks for no CPU and rides in bundle 0 of the placement group Serve reserves for
it from ``placement_group_bundles``; the N worker actors take the N bundles. Its FastAPI app
is built in the replica, after the service (``__serve_build_asgi_app__``), by the factory
``app.build_app`` passes: the OpenAPI document states this replica's own limits.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import ray
from ray import serve

from service.api.http import Uploads
from service.api.service import ServiceConfig, VideoService
from service.api.startup import Launched

log = logging.getLogger("dloserve.api")
AppFactory = Callable[[VideoService, Uploads], Any]


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256,
                  health_check_period_s=5, health_check_timeout_s=30)
@serve.ingress()
class VideoIngress:
    def __init__(self, config: dict[str, Any], launched: Launched | None = None,
                 make_app: AppFactory | None = None) -> None:
        from service.engine.metrics import log_to_stderr

        log_to_stderr()
        assert make_app is not None, "app.build_app passes the app factory"
        self.make_app = make_app
        self.svc = VideoService(
            ServiceConfig(**config), placement_group=ray.util.get_current_placement_group(),
            dp_group=serve.get_replica_context().replica_id.unique_id, launched=launched,
        )
        if not self.svc.cfg.api_key_hashes:
            log.warning("no API key configured: every client can read and delete every job made "
                        "without a key")
        cfg = self.svc.cfg
        self.uploads = Uploads(cfg.max_uploads_per_key, cfg.max_uploads_per_address, cfg.max_uploads)

    def __serve_build_asgi_app__(self) -> Any:
        """This replica's FastAPI app (Serve asks once, after ``__init__``)."""
        return self.make_app(self.svc, self.uploads)

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine cannot serve is reported unhealthy."""
        problem = self.svc.health_problem()
        if problem:
            raise RuntimeError(problem)

    async def drain(self, timeout_s: float) -> dict[str, Any]:
        """Called by the launcher on SIGTERM before the app is deleted (not a route)."""
        return await asyncio.to_thread(self.svc.drain, timeout_s)

    def __del__(self) -> None:
        svc = getattr(self, "svc", None)
        if svc is not None:
            svc.close()
