"""/readyz says which offload mode the replica serves and why: auto is the default, and on
CPU ranks it picks rank-local without a probe, saying so."""

from __future__ import annotations

import httpx


def test_readyz_names_the_offload_mode(app_url: str) -> None:
    ready = httpx.get(f"{app_url}/readyz").json()
    mode = ready["offload_mode"]
    assert mode["mode"] == "rank-local" and mode["reason"].startswith("CPU ranks"), mode
    assert [g["size"] for g in ready["groups"]] == [1, 1]  # rank-local: a group per rank
