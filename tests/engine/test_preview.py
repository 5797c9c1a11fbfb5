"""A rank's previews on the STEP event path: one real rank (the demo model, CPU) emits STEP
events carrying a WebP of its latents, at most one per step, the last step's before FINISHED."""

from __future__ import annotations

import io
import threading

from PIL import Image

from service.engine.encoder import Encoder
from service.engine.events import Event, EventKind
from service.engine.rank import RankWorker
from service.models.request import GenerationRequest

REQ = GenerationRequest(prompt="a fox", seed=5, width=64, height=48, num_frames=5, num_inference_steps=5)


def test_previews_ride_step_events_and_the_last_comes_before_the_end(resident) -> None:  # noqa: ANN001
    worker = RankWorker(resident, encoder=Encoder(1))
    events: list[Event] = []
    done = threading.Event()

    def pump() -> None:
        while not done.is_set():
            for e in worker.events(0.5):
                events.append(e)
                if e.kind is EventKind.FINISHED:
                    done.set()

    try:
        worker.assign("job", REQ)
        t = threading.Thread(target=pump, daemon=True)
        t.start()
        worker.serve()
        assert done.wait(120)
        t.join(5)
    finally:
        worker.close()
    assert resident.adapter.latents_hook is None  # closed: the shared runner is left as it was
    kinds = [e.kind for e in events]
    previews = [e for e in events if e.kind is EventKind.STEP and e.preview is not None]
    plain = [e.step for e in events if e.kind is EventKind.STEP and e.preview is None and e.state is None]
    assert plain == [1, 2, 3, 4, 5] and events[-1].error is None
    steps = [e.step for e in previews]
    assert steps == sorted(set(steps)) and steps[-1] == 5  # at most one per step, the last one kept
    assert events.index(previews[-1]) < kinds.index(EventKind.FINISHED)
    for e in previews:
        im = Image.open(io.BytesIO(e.preview))
        assert im.format == "WEBP" and im.size == (REQ.width // 8, REQ.height // 8) and e.total == 5
