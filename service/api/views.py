"""What each caller may read of the service's state: one tenant never sees another's jobs.

Three views of ``/readyz`` and ``/v1/waves``:

- anonymous (when keys are configured): ready or not, and the instance id (a random id per
  start, which ``dloserve serve`` uses to notice a port shared with another instance);
- an API key: the engine's state, its groups and the offload mode, plus the caller's own
  queued and running counts and limits; never paths, node or worker ids, or counters that
  add up every tenant's requests; its own assignment records, without the global wave
  number;
- an admin key (or an open service, which has nothing to hide): everything.

Free text that reaches a tenant (a job's error, a group's last error) has other job ids
replaced (``redact``): a group's failure reason may quote the request that caused it.
"""

from __future__ import annotations

import re
from typing import Any

JOB_ID = re.compile(r"video_[0-9a-f]{32}")
PUBLIC_GROUP = ("group", "state", "size", "first_rank", "generation", "rebuilds", "last_error")
PRIVATE_RECORD = ("tenant", "wave")


def redact(text: str | None, own: str | None = None) -> str | None:
    """``text`` with every job id but ``own`` replaced by "another request"."""
    if not text:
        return text
    return JOB_ID.sub(lambda m: m.group(0) if m.group(0) == own else "another request", text)


def public_ready(full: dict[str, Any]) -> dict[str, Any]:
    return {"ready": full["ready"], "instance": full.get("instance")}


def tenant_ready(full: dict[str, Any], yours: dict[str, Any]) -> dict[str, Any]:
    groups = [{k: (redact(g.get(k)) if k == "last_error" else g.get(k)) for k in PUBLIC_GROUP}
              for g in full.get("groups", [])]
    keep = ("ready", "state", "availability", "instance", "scheduler", "model", "dp_size", "sp_size",
            "offload_mode", "generation", "rebuilds", "dp_group", "storage")
    return {**{k: full.get(k) for k in keep}, "last_error": redact(full.get("last_error")),
            "groups": groups, "yours": yours}


def tenant_record(rec: dict[str, Any]) -> dict[str, Any]:
    """One of the caller's own assignment records, as it may see it."""
    own = rec["ids"][0] if rec.get("ids") else None
    out = {k: v for k, v in rec.items() if k not in PRIVATE_RECORD}
    if "errors" in out:
        out["errors"] = [redact(e, own) for e in out["errors"]]
    return out
