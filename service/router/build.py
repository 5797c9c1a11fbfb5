"""The one place a dispatcher is wired to an executor: the service, the batch job and
``dloserve generate`` all call ``build_dispatcher`` with their EngineConfig (its
``parallel.executor`` picks the transport, its ``scheduler`` the queue)."""

from __future__ import annotations

from typing import Any

from service.config import EngineConfig
from service.engine.executor import Executor
from service.router.dispatcher import Dispatcher, Sink
from service.router.policy import DeadlinePolicy
from service.router.scheduler import make_scheduler
from service.router.tenants import Tenants


def make_executor(config: EngineConfig, placement: Any = None, progress: bool = False) -> Executor:
    """The transport the config names: Ray actors in a placement group, or processes of this
    host (imported on demand: the local executor needs no Ray)."""
    if config.parallel.executor == "ray":
        from service.engine.ray_executor import RayExecutor

        return RayExecutor(config, placement)
    from service.engine.local import LocalExecutor

    return LocalExecutor(config, progress=progress)


def build_dispatcher(
    config: EngineConfig,
    sink: Sink,
    *,
    placement: Any = None,
    executor: Executor | None = None,
    deadlines: DeadlinePolicy | None = None,
    max_attempts: int | None = None,
    progress: bool = False,
    tenants: Tenants | None = None,
) -> Dispatcher:
    """A dispatcher over a new executor for ``config`` (or the one given); call ``start()`` on it."""
    executor = executor or make_executor(config, placement, progress)
    s = config.scheduler
    return Dispatcher(
        executor, sink, make_scheduler(s.scheduler, config.parallel.dp_size, s.queue_size, s.starve_s,
                                       s.max_wait_ms / 1000, tenants),
        deadlines=deadlines or DeadlinePolicy(), max_queue_wait_s=s.max_queue_wait_s,
        max_attempts=max_attempts, job_retries=s.job_retries,
    )
