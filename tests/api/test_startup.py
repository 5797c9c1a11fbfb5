"""/readyz's ``startup``: the steps from the process's start to ready add up, with nothing left
over when every mark is there, and say what is missing when one is not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from service.api.startup import process_started_at, startup_breakdown

MARKS = {"command": 100.0, "checked": 101.5, "ray_up": 110.0}
ENGINE = {"began_at": 126.0, "placement_s": 0.5, "auto_probe_s": 9.5,
          "groups_ready_at": {"a": 150.0, "b": 152.0}}


def test_the_steps_add_up_to_the_command_to_the_last_group_ready() -> None:
    out = startup_breakdown(MARKS, 125.0, ENGINE, groups=2)
    assert out["from"] == "command" and out["ready_s"] == 52.0
    assert out["steps"] == {"launcher_checks_s": 1.5, "ray_start_s": 8.5, "serve_and_replica_start_s": 15.0,
                            "replica_init_s": 1.0, "engine.placement_s": 0.5, "engine.auto_probe_s": 9.5,
                            "groups_s": 16.0}
    assert out["unaccounted_s"] == 0.0
    assert sum(out["steps"].values()) == pytest.approx(out["ready_s"])


def test_from_the_process_start_with_serve_and_the_replica_apart() -> None:
    """The launcher's marks from this process's start (the interpreter and the CLI's imports
    before its first stamp) and Serve's controller up (``serve_up``): the steps
    still add up, now to the time a user's stopwatch shows."""
    marks = {"process": 97.5, **MARKS, "serve_up": 117.0}
    out = startup_breakdown(marks, 125.0, ENGINE, groups=2)
    assert out["from"] == "process" and out["ready_s"] == 54.5
    assert out["steps"] == {"process_start_s": 2.5, "launcher_checks_s": 1.5, "ray_start_s": 8.5,
                            "serve_start_s": 7.0, "replica_start_s": 8.0, "replica_init_s": 1.0,
                            "engine.placement_s": 0.5, "engine.auto_probe_s": 9.5, "groups_s": 16.0}
    assert out["unaccounted_s"] == 0.0
    checked = startup_breakdown({**marks, "model_checked": 104.0}, 125.0, ENGINE, groups=2)
    beside = ["launcher_checks_s", "ray_start_s", "serve_start_s"]
    assert checked["parallel"] == {"model_check_s": {"began_s": 2.5, "s": 4.0, "beside": beside}}
    assert checked["steps"] == out["steps"]  # beside the steps, not one of them
    assert startup_breakdown(marks, 125.0, ENGINE, groups=2)["parallel"] == {}  # no check stamped


def test_a_process_start_is_read_from_proc() -> None:
    """A child's start, read from /proc, lies between the moments before and after it was
    started (to /proc's 10 ms ticks); this process started before its tests ran."""
    before = time.time()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    after = time.time()
    try:
        started = process_started_at(child.pid)
        assert started is not None and before - 0.05 <= started <= after + 0.05, (before, started, after)
    finally:
        child.kill()
        child.wait()
    own = process_started_at()
    assert own is not None and own < before
    assert process_started_at(2**22 + 1) is None  # no such process


def test_not_ready_until_every_group_was_and_a_serve_config_start_begins_at_the_replica() -> None:
    waiting = startup_breakdown(MARKS, 125.0, {**ENGINE, "groups_ready_at": {"a": 150.0}}, groups=2)
    assert waiting["ready_s"] is None and waiting["steps"]["groups_s"] is None
    assert waiting["unaccounted_s"] is None
    engine = {k: v for k, v in ENGINE.items() if k != "auto_probe_s"}  # flags set the mode: no probe
    bare = startup_breakdown({}, 125.0, engine, groups=2)
    assert bare["from"] == "replica" and bare["ready_s"] == 27.0
    assert bare["steps"] == {"replica_init_s": 1.0, "engine.placement_s": 0.5, "groups_s": 25.5}
    assert bare["unaccounted_s"] == 0.0


def _bytecode_check(tmp_path: Path, keep: bool = True, prefix: Path | None = None) -> list[Any]:
    """The launcher's warning and the facts behind it, in a Python of these settings."""
    code = ("import json; from service.api.startup import bytecode_facts, uncompiled_imports; "
            "print(json.dumps([uncompiled_imports(), bytecode_facts()]))")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
    if not keep:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    if prefix is not None:
        env["PYTHONPYCACHEPREFIX"] = str(prefix)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       check=True, env=env, cwd=tmp_path)
    return json.loads(r.stdout)


def test_a_start_warns_where_every_process_would_compile_its_imports_from_source(tmp_path: Path) -> None:
    """torch's bytecode is looked for where Python would (here: a folder of its own, empty);
    missing, with none kept, each process of a start compiles it again: the launcher says so."""
    empty = tmp_path / "pycache"
    problem, facts = _bytecode_check(tmp_path, keep=False, prefix=empty)
    assert facts["torch_cached"] is False and facts["writes"] is False
    assert problem and "PYTHONDONTWRITEBYTECODE is set" in problem and "compileall" in problem
    problem, facts = _bytecode_check(tmp_path, prefix=empty)  # kept: the first process writes it
    assert problem is None and facts["writes"] is True and facts["torch_writable"] is True
    problem, facts = _bytecode_check(tmp_path, keep=False)  # beside torch, as pip installed it
    assert facts["torch_cached"] is True and problem is None


FRONT_END = """
import sys, tempfile
import service.api.app, service.api.deployment, service.api.launch, service.engine.ray_executor
from service.api.jobs import JobStore
from service.config import EngineConfig
from service.models.startup import check_start
check_start(EngineConfig(), None, "cuda")  # the launcher's model check (the committed model)
from service.api.service import ServiceConfig, VideoService
from tests.fakes import FakeExecutor
folder = tempfile.mkdtemp()
svc = VideoService(ServiceConfig(results_url=folder), executor=FakeExecutor((1,)),
                   store=JobStore(folder, {}, 3600.0, 100, 30.0), node_id="node")
status = svc.create({"prompt": "a red ball"}).status.value
svc.close()
print(status, sorted(m for m in ("torch", "diffusers", "transformers", "safetensors") if m in sys.modules))
"""


def test_the_front_end_starts_and_takes_a_request_without_torch() -> None:
    """The launcher's model check, the replica's imports, its start (the committed model's
    card, the job store, the dispatcher) and a request's checks load no torch: its import (1.4 s
    on this CPU, 3-4 s on an H100 host) would be on every start's path before the ranks are asked
    for, and its memory in a process that runs no model. A rank, the LoRA checks and a restart's
    adopted state load it where they need it."""
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", FRONT_END], capture_output=True, text=True, timeout=120,
                       cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split("\n")[-2] == "queued []", r.stdout
