"""The model-dependent request checks shared by the ingress and the ranks (models/checks.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from service.config.cache import CacheSpec
from service.models.checks import cache_unsupported, check_request
from service.models.demo import ensure_demo_model
from service.models.lora_ref import LoraRef
from service.models.registry import load_adapter
from service.models.request import GenerationRequest, RequestError

A = GenerationRequest(prompt="x")
REF = LoraRef("style", source="/loras/style.safetensors", sha256="ab")


def refused(adapter: object, req: GenerationRequest, budget: int = 2**30,
            default: CacheSpec | None = None) -> RequestError:
    with pytest.raises(RequestError) as e:
        check_request(adapter, req, budget, default)
    return e.value


def test_one_transformer() -> None:
    one = load_adapter(ensure_demo_model("tiny"))
    check_request(one, replace(A, loras=(REF,), cache=CacheSpec.from_obj("first_block")), 2**30, None)
    assert refused(one, replace(A, loras=(replace(REF, expert="low"),))).field == "loras[0].expert"
    assert refused(one, replace(A, loras=(replace(REF, source=""),))).field == "loras[0].name"
    assert "--lora-cache-gb 0" in refused(one, replace(A, loras=(REF,)), budget=0).message
    sp = load_adapter(ensure_demo_model("tiny"), 2)
    assert "--sequence-parallel-size" in cache_unsupported(sp)
    # the server's default cache counts when the request names none
    assert refused(sp, A, default=CacheSpec.from_obj("first_block")).field == "cache.method"
    check_request(sp, replace(A, cache=CacheSpec()), 2**30, CacheSpec.from_obj("first_block"))


def test_two_experts() -> None:
    two = load_adapter(ensure_demo_model("wan22-t2v-tiny"))
    check_request(two, A, 2**30, None)
    assert refused(two, replace(A, loras=(REF,))).field == "loras"
    assert refused(two, replace(A, cache=CacheSpec.from_obj("first_block"))).field == "cache.method"
