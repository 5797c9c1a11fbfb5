"""Adapter registration's own threads: a read that hangs never holds up job submission.

The hung read is real: a FIFO nobody writes to, opened the ordinary (blocking) way. The
readers are set free at the end by opening the FIFO for writing and closing it.
"""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from service.api.adapter_io import AdapterIO, AdapterIOBusy, AdapterIOTimeout
from tests.api.conftest import wait_final, wait_ready


def release(fifo: Path) -> None:
    """Wake every reader blocked on ``fifo``: a writer comes and goes (EOF)."""
    for _ in range(200):
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            if e.errno == errno.ENXIO:  # no reader left
                return
            raise
        os.close(fd)
        threading.Event().wait(0.02)


def test_a_hung_read_times_out_holds_only_its_own_threads_and_is_undone(tmp_path: Path) -> None:
    fifo = tmp_path / "hung.safetensors"
    os.mkfifo(fifo)
    io = AdapterIO(workers=2, timeout_s=0.5)
    undone: list[bytes] = []

    def read() -> bytes:
        with open(fifo, "rb") as f:  # blocks until a writer comes: a hung mount's read
            return f.read()

    async def scenario() -> None:
        stuck = [asyncio.ensure_future(io.run(read, undo=undone.append)) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(AdapterIOBusy, match="all 2 adapter-reading threads are busy"):
            await io.run(read)  # refused at once: no queue behind stuck threads
        assert await asyncio.to_thread(lambda: "free") == "free"  # the default executor is not theirs
        for t in stuck:
            with pytest.raises(AdapterIOTimeout, match="was not registered"):
                await t

    try:
        asyncio.run(scenario())
    finally:
        release(fifo)
    io.close()
    io._pool.shutdown(wait=True)
    assert undone == [b"", b""]  # the reads ended after their callers gave up: undone


@pytest.fixture(scope="module")
def lora_app(app_url: str, demo_model: str,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A DP1 app with --lora-dir (run-time registration on), beside the shared one."""
    from ray import serve

    from service.api.app import build_app
    from service.api.service import ServiceConfig

    lora_dir = tmp_path_factory.mktemp("lora-dir")
    cfg = ServiceConfig(model=demo_model, dp_size=1, cpus_per_rank=0.25, encoders_per_rank=0,
                        results_url=str(tmp_path_factory.mktemp("lora-results")), pg_timeout_s=60,
                        lora_dirs=[str(lora_dir)])
    serve.run(build_app(cfg.model_dump()), name="loras", route_prefix="/loras")
    url = f"{app_url}/loras"
    wait_ready(url, 180)
    yield url, lora_dir
    serve.delete("loras")


def test_fifo_registrations_are_refused_and_do_not_stop_job_submission(lora_app: tuple[str, Path]) -> None:
    """Twelve registrations of a FIFO under --lora-dir at once (each used to block a thread of
    the pool POST /v1/videos shares, for good): each is a 422 naming ``source`` (or a 503 when
    the registration threads are all busy), and a job posted meanwhile is accepted and completes."""
    url, lora_dir = lora_app
    fifo = lora_dir / "pipe.safetensors"
    os.mkfifo(fifo)
    try:
        with ThreadPoolExecutor(12) as pool:
            regs = [pool.submit(httpx.post, f"{url}/v1/loras", json={"name": f"p{i}", "source": str(fifo)},
                                timeout=30) for i in range(12)]
            body = {"prompt": "a fox", "seed": 3, "num_inference_steps": 2}
            job = httpx.post(f"{url}/v1/videos", json=body, timeout=15)
            answers = [f.result() for f in regs]
        assert job.status_code == 202, job.text
        for r in answers:  # refused unopened, or (every reading thread busy) at once with Retry-After
            assert r.status_code in (422, 503) and r.json()["error"]["param"] == "source", r.text
            assert r.status_code == 503 and "retry-after" in r.headers or \
                "a FIFO: adapters must be regular files" in r.json()["error"]["message"], r.text
        assert any(r.status_code == 422 for r in answers)
        assert httpx.get(f"{url}/v1/loras").json()["data"] == []
        assert wait_final(url, job.json()["id"])["status"] == "completed"
    finally:
        release(fifo)
