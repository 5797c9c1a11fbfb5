"""The OpenAPI schema tells the truth: schemathesis, every check, hundreds of cases, 0 failures.

A module-scoped app (DP1, under /fuzz) with small limits, so the valid requests the fuzzer
sends stay cheap; the schema it fuzzes states those limits (service/api/openapi.py). The
one allowance is in tests/api/schemathesis.toml: cross-field rules answer 422.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import wait_ready

HERE = Path(__file__).resolve().parent
# 32x32x5 at most: a valid /v1/videos/sync costs the fuzz ~0.2 s (64x64x9: ~0.9 s, and ~70 of them)
LIMITS = {"max_width": 32, "max_height": 32, "max_frames": 5, "max_steps": 2}


@pytest.fixture(scope="module")
def fuzz_url(app_url: str, demo_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from ray import serve

    from service.api.app import build_app
    from service.api.service import ServiceConfig

    cfg = ServiceConfig(model=demo_model, data_parallel_size=1, cpus_per_rank=0.25, encoders_per_rank=0,
                        queue_size=4,
                        results_url=str(tmp_path_factory.mktemp("fuzz")), pg_timeout_s=60, **LIMITS)
    serve.run(build_app(cfg.model_dump()), name="fuzz", route_prefix="/fuzz")
    url = f"{app_url}/fuzz"
    wait_ready(url, 180)
    yield url
    serve.delete("fuzz")


@pytest.mark.e2e  # its own app (the fuzz's, with small limits)
def test_the_schema_states_this_instances_limits(fuzz_url: str) -> None:
    spec = httpx.get(f"{fuzz_url}/openapi.json").json()
    body = spec["paths"]["/v1/videos"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    props = body["properties"]
    assert props["prompt"]["maxLength"] == 2000
    assert props["width"]["anyOf"][0] == {"type": "integer", "minimum": 16, "maximum": 32, "multipleOf": 16,
                                          "x-max-pixels": 1280 * 720}  # the budget rule stays a 422
    assert props["num_frames"]["anyOf"][0]["enum"] == [1, 5]
    assert not [p for p in spec["paths"] if p.startswith("/ui")]  # the playground is not the API
    responses = spec["paths"]["/v1/videos/{video_id}/content"]["get"]["responses"]
    assert "video/mp4" in responses["200"]["content"] and {"401", "404", "409"} <= set(responses)
    create = spec["paths"]["/v1/videos"]["post"]["responses"]
    assert {"401", "408", "413", "415", "422", "429", "503"} <= set(create)
    assert props["size"]["anyOf"][0]["pattern"] == "^(16|32)x(16|32)$"  # ASCII digits, one x
    assert {"number", "string"} <= {v.get("type") for v in props["seconds"]["anyOf"]}  # OpenAI sends "4"
    content = spec["paths"]["/v1/videos/{video_id}/content"]
    assert {"get", "head"} <= set(content) and {"304", "400", "416"} <= set(content["get"]["responses"])
    assert "head" in spec["paths"]["/healthz"] and "head" in spec["paths"]["/readyz"]


@pytest.mark.e2e  # schema fuzzing: ~1,000 generated requests
# `all` includes a 10 s response-time limit; /v1/videos/sync waits for a whole generation on a
# shared CI machine, so the limit is the request timeout: it catches hangs, loadtest/ measures speed.
# Two workers (operations in parallel): the client's case generation overlaps the service's
# answers (~170 s -> ~95 s here); which cases a worker draws varies a little run to run.
def test_schemathesis_all_checks_finds_nothing(fuzz_url: str) -> None:
    cmd = [str(Path(sys.executable).parent / "st"), "--config-file", str(HERE / "schemathesis.toml"), "run",
           f"{fuzz_url}/openapi.json", "--url", fuzz_url, "--checks", "all", "--workers", "2",
           "--max-response-time", "60", "-n", "60",
           "--phases", "examples,coverage,fuzzing", "--request-timeout", "60", "--seed", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    report = HERE.parents[1] / "out" / "schemathesis.txt"  # the whole report (CI keeps out/)
    report.parent.mkdir(exist_ok=True)
    report.write_text(r.stdout + r.stderr)
    tail = f"(whole report: {report})\n" + r.stdout[-4000:]
    m = re.search(r"(\d+) generated", r.stdout)
    assert m and int(m.group(1)) >= 500, tail
    assert r.returncode == 0 and f"{m.group(1)} generated, {m.group(1)} passed" in r.stdout, tail
