"""Service limits and wave deadlines: operator policy, independent of the model.

The model adapter says what a model *can* take; these say what this deployment *will*
take (so one huge request cannot hold a DP group for an hour) and how long a wave may run
before it is declared hung and the group is rebuilt.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.config.scheduler import WAVE_DEADLINE_BASE_S, WAVE_DEADLINE_PER_FORWARD_S
from service.models.request import GenerationRequest, RequestError


@dataclass(frozen=True)
class Limits:
    """Upper bounds on one request; violations are RequestErrors naming the field."""

    max_width: int = 1280
    max_height: int = 1280
    max_pixels: int = 1280 * 720
    max_frames: int = 129
    max_steps: int = 100
    max_prompt_chars: int = 2000

    def check(self, req: GenerationRequest) -> None:
        """Operator bounds; the model's own rules come from the adapter (see api)."""
        n = self.max_prompt_chars
        for name in ("prompt", "negative_prompt"):
            if len(getattr(req, name) or "") > n:
                raise RequestError(name, f"longer than this service's limit of {n} characters")
        if req.width > self.max_width:
            raise RequestError("width", f"{req.width} exceeds the limit {self.max_width}")
        if req.height > self.max_height:
            raise RequestError("height", f"{req.height} exceeds the limit {self.max_height}")
        if req.width * req.height > self.max_pixels:
            raise RequestError(
                "size", f"{req.width}x{req.height} exceeds the limit of {self.max_pixels} pixels"
            )
        if req.num_frames > self.max_frames:
            raise RequestError(
                "num_frames", f"{req.num_frames} exceeds the limit {self.max_frames}"
            )
        if req.num_inference_steps > self.max_steps:
            raise RequestError(
                "num_inference_steps",
                f"{req.num_inference_steps} exceeds the limit {self.max_steps}",
            )


@dataclass(frozen=True)
class DeadlinePolicy:
    """Wave deadline = base + per-forward time x forwards x work relative to a reference shape.

    Scaled by steps (forwards, which count CFG) and by pixels x frames, so a long 480p job
    is not killed by a limit tuned for a thumbnail, and a hung tiny job is caught quickly.
    """

    base_s: float = WAVE_DEADLINE_BASE_S
    per_forward_s: float = WAVE_DEADLINE_PER_FORWARD_S
    ref_pixels_frames: int = 832 * 480 * 81

    def deadline_s(self, reqs: list[GenerationRequest]) -> float:
        worst = 0.0
        for r in reqs:
            work = max(1.0, r.width * r.height * r.num_frames / self.ref_pixels_frames)
            worst = max(worst, self.per_forward_s * r.forwards() * work)
        return self.base_s + worst
