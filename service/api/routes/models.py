"""/v1/models: the one model this service runs, its family and what it accepts."""

from typing import Any

from fastapi import APIRouter, Request

from service.api.catalog import ModelCard, ModelList, model_card
from service.api.errors import ModelNotFound
from service.api.routes.common import AUTH, BY_ID, owner, service

# No ``from __future__ import annotations``: FastAPI reads the routes' real types.
router = APIRouter()


@router.get("/v1/models", response_model=ModelList, responses=AUTH)
def list_models(request: Request) -> Any:
    """The model this service runs: its family and what it accepts (T2V, I2V, TI2V, image)."""
    owner(request)
    return {"object": "list", "data": [_card(request)]}


@router.get("/v1/models/{model}", response_model=ModelCard, responses=BY_ID)
def retrieve_model(request: Request, model: str) -> Any:
    owner(request)
    name = service(request).model_name
    if model != name:
        raise ModelNotFound(f"no model {model!r}; this service runs {name!r}")
    return _card(request)


def _card(request: Request) -> dict[str, Any]:
    svc = service(request)
    return model_card(svc.model_name, svc.adapter.card(), svc.started_at)
