"""The one place a dispatcher is wired to an executor: the service, the batch job and
``dloserve generate`` all call ``build_dispatcher`` (only the executor kind differs)."""

from __future__ import annotations

from typing import Any, Literal

from service.engine.executor import Executor
from service.engine.spec import EngineSpec
from service.router.dispatcher import Dispatcher, Sink
from service.router.policy import DeadlinePolicy
from service.router.scheduler import make_scheduler
from service.router.tenants import Tenants


def make_executor(spec: EngineSpec, backend: Literal["ray", "local"], placement: Any = None,
                  progress: bool = False) -> Executor:
    """Ray actors in a placement group, or processes of this host (imported on demand: the
    local executor needs no Ray)."""
    if backend == "ray":
        from service.engine.ray_executor import RayExecutor

        return RayExecutor(spec, placement)
    from service.engine.local import LocalExecutor

    return LocalExecutor(spec, progress=progress)


def build_dispatcher(
    spec: EngineSpec,
    sink: Sink,
    backend: Literal["ray", "local"] = "ray",
    *,
    placement: Any = None,
    executor: Executor | None = None,
    scheduler: str = "continuous",
    queue_size: int = 64,
    starve_s: float = 30.0,
    max_wait_s: float = 0.05,
    deadlines: DeadlinePolicy | None = None,
    max_queue_wait_s: float = 1800.0,
    max_attempts: int | None = None,
    job_retries: int = 1,
    progress: bool = False,
    tenants: Tenants | None = None,
) -> Dispatcher:
    """A dispatcher over a new executor for ``spec`` (or the one given); call ``start()`` on it."""
    executor = executor or make_executor(spec, backend, placement, progress)
    return Dispatcher(
        executor, sink, make_scheduler(scheduler, spec.dp_size, queue_size, starve_s, max_wait_s, tenants),
        deadlines=deadlines or DeadlinePolicy(), max_queue_wait_s=max_queue_wait_s, max_attempts=max_attempts,
        job_retries=job_retries,
    )
