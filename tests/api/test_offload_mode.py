"""/readyz says which offload mode the replica serves and why (auto's choice is tested on
the Ray executor: tests/engine/test_ray_executor.py)."""

from __future__ import annotations

import httpx


def test_readyz_names_the_offload_mode(app_url: str) -> None:
    ready = httpx.get(f"{app_url}/readyz").json()
    assert ready["offload_mode"] == {"mode": "allgather", "reason": "set by flags"}
    assert [g["size"] for g in ready["groups"]] == [2]  # one group of two ranks
