"""Configuration: one file per concern, gathered in one ``EngineConfig``; plain data, no torch.

A layer of its own between ``models`` and ``offload`` (it speaks the offload library's
``OffloadMode``; everything above imports it): offload (where the weights live), model
(dtype, quantization, CFG batching, compile), parallel (ranks and placement), scheduler,
lora, cache (the step cache), engine (them all), and errors (``FlagError``).
"""

from service.offload.mode import ModeChoice, OffloadMode

from .cache import CacheError, CacheSpec
from .engine import EngineConfig, step_cache
from .errors import FlagError
from .lora import LoraConfig
from .model import ModelConfig
from .offload import OffloadConfig
from .parallel import ParallelConfig
from .scheduler import SchedulerConfig

__all__ = ["CacheError", "CacheSpec", "EngineConfig", "FlagError", "LoraConfig", "ModeChoice", "ModelConfig",
           "OffloadConfig", "OffloadMode", "ParallelConfig", "SchedulerConfig", "step_cache"]
