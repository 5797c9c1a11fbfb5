"""Meta-device builds from several threads at once (two rank-local pipelines loading in one
process did this) leave torch as they found it."""

from __future__ import annotations

import threading

from torch import nn

from service.models.registry import load_adapter


def test_concurrent_meta_builds_leave_torch_unpatched(demo_model: str) -> None:
    adapter = load_adapter(demo_model)
    errors: list[BaseException] = []

    def build() -> None:
        try:
            for _ in range(20):
                module = adapter.build_transformer()
                assert next(module.parameters()).device.type == "meta"
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert nn.Linear(2, 2).weight.device.type == "cpu"  # accelerate's patch is gone
