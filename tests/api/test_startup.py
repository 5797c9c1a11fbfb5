"""/readyz's ``startup``: the steps from the command to ready add up, with nothing left over
when every mark is there, and say what is missing when one is not."""

from __future__ import annotations

import pytest

from service.api.startup import startup_breakdown

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


def test_not_ready_until_every_group_was_and_a_serve_config_start_begins_at_the_replica() -> None:
    waiting = startup_breakdown(MARKS, 125.0, {**ENGINE, "groups_ready_at": {"a": 150.0}}, groups=2)
    assert waiting["ready_s"] is None and waiting["steps"]["groups_s"] is None
    assert waiting["unaccounted_s"] is None
    engine = {k: v for k, v in ENGINE.items() if k != "auto_probe_s"}  # flags set the mode: no probe
    bare = startup_breakdown({}, 125.0, engine, groups=2)
    assert bare["from"] == "replica" and bare["ready_s"] == 27.0
    assert bare["steps"] == {"replica_init_s": 1.0, "engine.placement_s": 0.5, "groups_s": 25.5}
    assert bare["unaccounted_s"] == 0.0


def test_pre_started_ranks_are_a_parallel_span_outside_the_sum() -> None:
    """The rank processes started after Ray import while Serve starts: their span is reported
    beside the steps, which still add up to the whole time without it."""
    out = startup_breakdown(MARKS, 125.0, {**ENGINE, "prestart_imported_at": 124.0}, groups=2)
    assert out["parallel"]["rank_processes_s"] == {
        "began_s": 10.0, "s": 14.0, "beside": ["serve_and_replica_start_s", "replica_init_s", "groups_s"]}
    assert out["unaccounted_s"] == 0.0 and sum(out["steps"].values()) == pytest.approx(out["ready_s"])
    assert startup_breakdown(MARKS, 125.0, ENGINE, groups=2)["parallel"] == {}  # none adopted
