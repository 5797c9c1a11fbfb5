"""``GET /v1/models``: which model this service runs and what it accepts (OpenAI's list shape).

Beside OpenAI's ``id``/``object``/``created``/``owned_by`` each entry names the family, its
tasks (``t2v``, ``i2v``, ``t2i``), whether an image is required, optional or not taken
(``input_reference``), and its denoisers (two for Wan2.2 A14B). The same card is in
``/readyz`` (``model_card``). A request the model cannot serve is refused with a 422 before
any compute (the adapter's ``validate``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dloserve"
    family: str = Field(description="wan-t2v, wan-i2v, wan22-t2v, wan22-i2v, wan22-ti2v or flux-t2i")
    pipeline: str | None = Field(None, description="the diffusers pipeline class of model_index.json")
    tasks: list[str] = Field(description="t2v (text to video), i2v (image to video), t2i (text to image)")
    image_input: Literal["none", "optional", "required"] = Field(
        description="whether input_reference is refused, optional (TI2V) or required (I2V)")
    experts: list[str] = Field(description="denoiser components; two for Wan2.2 A14B (high/low noise)")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def model_card(name: str, card: dict[str, Any], created: float) -> dict[str, Any]:
    """The /v1/models entry of the served model (``card``: ``ModelAdapter.card()``)."""
    return ModelCard(id=name, created=int(created), **card).model_dump()
