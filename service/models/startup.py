"""The one start-up check of ``generate``, ``serve`` and the batch job, in one order: the
flags became the EngineConfig (``EngineArgs.to_config``), the model folder is resolved (the
demo written once), its adapter loaded (config files only, no weights), and what the
settings need of the model checked (``EngineConfig.probe_problem``). Everything a bad flag
or model can fail fails here, before any process starts."""

from __future__ import annotations

from dataclasses import replace

from service.config import EngineConfig

from .adapter import ModelAdapter, ModelError
from .registry import load_adapter, request_defaults, resolve_model


def check_start(config: EngineConfig, model: str | None, device: str) -> tuple[EngineConfig, ModelAdapter]:
    """``config`` with ``model_dir`` the resolved folder, and the model's adapter. ``device``:
    where the ranks will run ("cuda" or "cpu": the probe rules differ). ModelError names a
    model these settings cannot serve."""
    model_dir = resolve_model(model)
    adapter = load_adapter(model_dir, sequence_parallel=config.parallel.sp_size)
    request_defaults(model_dir)  # a bad dloserve_defaults.json fails here, naming it
    problem = config.probe_problem(adapter, device)
    if problem:
        raise ModelError(problem)
    return replace(config, model_dir=model_dir), adapter
