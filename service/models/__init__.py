"""Adapters over diffusers pipelines: requests, model families, demo checkpoints, MP4.

    from service.models import PipelineRunner, OffloadConfig, GenerationRequest
    runner = PipelineRunner.load(ensure_demo_model(), "cpu", offload=OffloadConfig())
    mp4 = runner.generate(GenerationRequest("a red fox running through snow", seed=1))
"""

from .adapter import ModelAdapter, ModelError, load_adapter
from .demo import ensure_demo_model, write_demo_model
from .pipeline import OffloadConfig, PipelineRunner
from .request import GenerationRequest, RequestError
from .video import encode_mp4

__all__ = [
    "GenerationRequest",
    "ModelAdapter",
    "ModelError",
    "OffloadConfig",
    "PipelineRunner",
    "RequestError",
    "encode_mp4",
    "ensure_demo_model",
    "load_adapter",
    "write_demo_model",
]
