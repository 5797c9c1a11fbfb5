"""Adapters over diffusers pipelines: requests, model families, demo checkpoints, MP4.

    from service.config import EngineConfig
    from service.models import GenerationRequest, PipelineRunner, ensure_demo_model
    runner = PipelineRunner.load(ensure_demo_model(), "cpu", config=EngineConfig())
    mp4 = runner.generate(GenerationRequest("a red fox running through snow", seed=1))

Names are imported on first use: an MP4 encoder process imports ``service.models.video``
without pulling in torch and diffusers.
"""

from __future__ import annotations

from service.offload.lazy import lazy_names

_WHERE = {
    "ModelAdapter": "adapter",
    "ModelError": "adapter",
    "load_adapter": "registry",
    "ensure_demo_model": "demo",
    "write_demo_model": "demo",
    "PipelineRunner": "pipeline",
    "GenerationRequest": "request",
    "RequestError": "request",
    "encode_mp4": "video",
}
__all__ = sorted(_WHERE)

__getattr__ = lazy_names(__name__, _WHERE)
