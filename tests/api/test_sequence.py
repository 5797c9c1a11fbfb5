"""The video service with one sequence-parallel group of two Ray rank actors (gloo, CPU).

The SP group is one rank to the scheduler: a request goes to both actors, both run every
forward on half the tokens, the lead's MP4 is the resident reference's bytes. A request
whose tokens cannot split is a 422 naming the field before anything is queued. A dead
actor fails the request it held with the reason; the group is rebuilt and serves again.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import ray

from service.api.records import JobRecord, JobStatus
from service.api.schemas import BodyError
from service.models.request import GenerationRequest


def wait_final(svc, job_id: str, timeout: float = 180) -> JobRecord:  # noqa: ANN001
    end = time.monotonic() + timeout
    while not (rec := svc.get(job_id)).final:
        assert time.monotonic() < end, svc.readiness()
        time.sleep(0.1)
    return rec


@pytest.mark.e2e  # kills a rank actor and waits for the rebuild
def test_sp_group_serves_refuses_unsplittable_and_rebuilds(ray_cluster: dict, demo_model: str,
                                                           resident, tmp_path: Path) -> None:  # noqa: ANN001
    from service.api.service import ServiceConfig, VideoService

    cfg = ServiceConfig(model=demo_model, data_parallel_size=1, sequence_parallel_size=2, cpus_per_rank=0.5,
                        encoders_per_rank=0,
                        results_url=str(tmp_path / "r"), pg_timeout_s=60, max_steps=1000,
                        wave_deadline_base_s=120, wave_deadline_per_forward_s=1.0, job_retries=0)
    svc = VideoService(cfg)  # job_retries=0: the killed job fails (a rerun of its 400 steps is long)
    try:
        end = time.monotonic() + 180
        while svc.readiness()["state"] != "ready":
            assert time.monotonic() < end, svc.readiness()
            time.sleep(0.2)
        ex = svc.dispatcher.executor
        assert [(g.info.size, g.world) for g in ex._groups.values()] == [(1, 2)]
        # SP: no auto
        assert len(ex.config.parallel.bundles()) == 2 and ex.config.offload.mode.value == "allgather"
        with pytest.raises(BodyError) as e:  # 48x48x9: 3 x 3 x 3 = 27 tokens
            svc.create({"prompt": "odd", "width": 48, "height": 48, "num_frames": 9, "seed": 1})
        assert e.value.field == "num_frames" and "27 tokens" in e.value.message
        assert svc.list(None, 100, "asc")[0] == [] and svc.dispatcher.depth == 0  # refused before any queue

        ok = GenerationRequest(prompt="a red fox", seed=3, height=48, width=48, num_frames=5)
        rec = svc.create({"prompt": ok.prompt, "seed": 3, "width": 48, "height": 48, "num_frames": 5})
        done = wait_final(svc, rec.id)
        assert done.status is JobStatus.COMPLETED, done
        assert svc.storage.video_path(rec.id).read_bytes() == resident.generate(ok)
        (g,) = ex._groups.values()
        assert svc.readiness()["sp_size"] == 2 and g.generation == 0

        long = svc.create({"prompt": "doomed", "seed": 4, "num_inference_steps": 400})
        while svc.get(long.id).progress < 1:
            time.sleep(0.05)
        ray.kill(g.handles[1])  # the non-lead actor: the lead alone cannot go on
        failed = wait_final(svc, long.id)
        assert failed.status is JobStatus.FAILED and "rank 1 died" in failed.error["message"], failed
        after = GenerationRequest(prompt="after the rebuild", seed=5)
        rec = svc.create({"prompt": after.prompt, "seed": 5})
        assert wait_final(svc, rec.id).status is JobStatus.COMPLETED
        assert svc.storage.video_path(rec.id).read_bytes() == resident.generate(after)
        assert g.generation >= 1 and g.rebuilds == 1
    finally:
        svc.close()
