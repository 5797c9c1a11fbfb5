"""How the model's weights are read and its forward runs: ``--dtype``, ``--quantization``,
``--cfg-batch``, ``--compile``, ``--attention``."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import FlagError

DTYPES = ("auto", "bfloat16", "float16", "float32")
QUANTIZATIONS = ("fp8", "none")  # None: the checkpoint's own (a `dloserve quantize` folder: fp8)
SWITCHES = ("auto", "on", "off")  # --cfg-batch, --compile
# --attention: exact kernels (routed by measurement; SDPA only; flash-attn-4 where it takes the call),
# or the approximate self-attention kernel (opt-in): cuDNN's FP8
ATTENTIONS = ("exact", "sdpa", "fa4", "fp8")


@dataclass(frozen=True)
class ModelConfig:
    """Checked when made (FlagError names the flag).

    ``dtype``: a torch dtype name, None keeps the checkpoint's. ``quantization``: "fp8" serves
    the blocks' Linear weights in FP8 (resident or streamed: half the bytes on the host, over
    PCIe and in the gathers); None takes the checkpoint's own (fp8 for a ``dloserve quantize``
    folder); "none" refuses an fp8 folder. ``cfg_batch``: a CFG request's conditional and
    unconditional rows in one transformer forward of batch 2 (auto: on CUDA devices, off on CPU,
    where frames stay bitwise diffusers'). ``compile``: torch.compile of the repeated block
    class (auto: on CUDA, off on CPU). ``attention`` (service.models.attention): "exact" (the
    default: SDPA, and flash-attn-4 for the Wan shapes a table measured on the GPU at load routes
    to it), "sdpa" (SDPA only) or "fa4" (flash-attn-4 wherever it takes the call); or an approximate
    self-attention kernel for Wan on Hopper GPUs: "fp8" (cuDNN's FP8 SDPA, q/k/v/P/O in e4m3).
    fa4 and fp8 are refused at load where they cannot run (CPU, not sm90, the gpu extra missing,
    a model that computes in float32).
    """

    dtype: str | None = None
    quantization: str | None = None
    cfg_batch: str = "auto"
    compile: str = "auto"
    attention: str = "exact"

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPES[1:]:
            raise FlagError(f"--dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise FlagError(f"--quantization must be one of {list(QUANTIZATIONS)}, got {self.quantization!r}")
        for key in ("cfg_batch", "compile"):
            if getattr(self, key) not in SWITCHES:
                raise FlagError(f"--{key.replace('_', '-')} must be one of {list(SWITCHES)}, "
                                f"got {getattr(self, key)!r}")
        if self.attention not in ATTENTIONS:
            raise FlagError(f"--attention must be one of {list(ATTENTIONS)}, got {self.attention!r}")

    def cfg_batching(self, device_type: str) -> bool:
        """Whether CFG requests run both rows in one forward on this server (a setting of the
        server, never of the layout: resident and every offload mode agree, so a request's bytes
        do not depend on the strategy). Auto: on CUDA only; on CPU the default keeps frames
        bitwise equal to diffusers' pipeline."""
        return self.cfg_batch == "on" or (self.cfg_batch == "auto" and device_type == "cuda")

    def compiling(self, device_type: str) -> bool:
        """Whether the repeated transformer block runs under torch.compile (auto: on CUDA)."""
        return self.compile == "on" or (self.compile == "auto" and device_type == "cuda")
