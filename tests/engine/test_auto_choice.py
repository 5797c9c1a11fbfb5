"""``--dlo-mode auto`` is applied in one place for both transports (``GroupExecutor._resolve_auto``):
the probe runs once, the config carries the typed choice, the groups are laid out for it, and
/readyz and the front ends read it from the config (no dict beside it)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from service.config import EngineConfig, ModeChoice, OffloadConfig, OffloadMode, ParallelConfig
from service.engine.executor import Group, GroupExecutor, Reply
from service.engine.start import rule_mode
from service.router.build import build_dispatcher
from tests.fakes import RecordingSink


class NoTransport(GroupExecutor):
    """Only the shared part: nothing is started (the tests call ``_resolve_auto`` themselves)."""

    def start(self) -> None: ...
    def _open(self, g: Group) -> None: ...
    def _kill(self, g: Group) -> None: ...
    def _send(self, g: Group, process: int, op: str, *args: Any) -> None: ...
    def _replies(self, timeout: float) -> list[tuple[Group, int, int, Reply]]:
        return []

    def _names(self, g: Group) -> list[str]:
        return []


def auto(model: str, dp: int = 2, gpus: float = 1.0) -> EngineConfig:
    return EngineConfig(model, parallel=ParallelConfig(dp_size=dp, gpus_per_rank=gpus),
                        offload=OffloadConfig(OffloadMode.AUTO))


def test_auto_is_probed_once_and_the_config_carries_the_typed_choice(demo_model: str) -> None:
    calls: list[int] = []

    def probe() -> ModeChoice:
        calls.append(1)
        return ModeChoice(OffloadMode.RANK_LOCAL, "compute covers the fill")

    ex = NoTransport(auto(demo_model))
    ex._resolve_auto(probe)
    ex._resolve_auto(probe)  # resolved: no second probe
    assert calls == [1] and ex.probes == 1
    assert ex.config.offload.mode is OffloadMode.RANK_LOCAL
    assert ex.config.choice == ModeChoice(OffloadMode.RANK_LOCAL, "compute covers the fill", source="probe")
    ex._lay_out()
    assert [(g.size, g.collective) for g in ex.groups()] == [(1, False), (1, False)]  # rank-local: two groups
    assert ex.status()["offload_mode"] == {"mode": "rank-local", "reason": "compute covers the fill",
                                           "source": "probe"}
    d = build_dispatcher(ex.config, RecordingSink(), executor=ex)
    assert d.choice is ex.config.choice  # what generate and the batch job print


def test_a_mode_set_by_flags_is_not_probed_and_says_so() -> None:
    ex = NoTransport(EngineConfig("unused", offload=OffloadConfig(OffloadMode.ALLGATHER)))
    ex._resolve_auto(lambda: pytest.fail("no probe for a mode the flags set"))
    assert ex.config.choice is None
    assert ex.status()["offload_mode"] == {"mode": "allgather", "reason": "set by flags"}


def test_a_failed_probe_names_the_flag(demo_model: str) -> None:
    def probe() -> ModeChoice:
        raise OSError("no device")

    with pytest.raises(RuntimeError, match="--dlo-mode auto probe failed: .*no device"):
        NoTransport(auto(demo_model))._resolve_auto(probe)


def test_one_gpu_rank_is_decided_without_a_probe_and_says_why(demo_model: str) -> None:
    """World 1 on CUDA: AllGather gathers nothing, so the choice is rank-local where its copy
    engine reads the page cache as fast (the files as served), else AllGather (a cast or FP8
    quantized at load need the slower pack thread). The rule (what the rank runs at its load:
    ``decide_auto``) needs no probe and no device, and says why."""
    def one(**model: str) -> dict:
        config = auto(demo_model, dp=1)
        config = replace(config, model=replace(config.model, **model))
        choice = rule_mode(config)
        assert choice is not None
        return choice.as_dict()

    stored = one()
    assert stored["mode"] == "rank-local" and stored["source"] == "rule", stored
    assert "one rank, no probe" in stored["reason"] and "page cache as fast" in stored["reason"]
    cast = one(dtype="bfloat16")  # the demo's blocks are stored in float32
    assert cast["mode"] == "allgather" and "a cast needs the pack" in cast["reason"], cast
    fp8 = one(quantization="fp8")
    assert fp8["mode"] == "allgather" and "computed at load" in fp8["reason"], fp8
    # two ranks are measured: the rule does not reach them
    two = NoTransport(auto(demo_model, dp=2))
    two._resolve_auto(lambda: ModeChoice(OffloadMode.ALLGATHER, "measured"))
    assert two.probes == 1


def test_one_group_leaves_auto_to_its_rank_and_takes_its_choice(demo_model: str) -> None:
    """DP1: the layout is one group whatever the mode, so the engine's process decides
    nothing (no model imports there, no probe); the rank's load reports its choice and the
    engine keeps it (standbys and rebuilds load that mode; /readyz says it)."""
    ex = NoTransport(auto(demo_model, dp=1))
    ex._resolve_auto(lambda: pytest.fail("no probe in the engine for one group"))
    assert ex.probes == 0 and ex.config.offload.mode is OffloadMode.AUTO
    assert ex.status()["offload_mode"]["mode"] == "auto"
    ex._lay_out()
    assert [g.size for g in ex.groups()] == [1]
    rule = rule_mode(ex.config)
    ex._take_rank_choice([{"rank": 0, "choice": None}, {"rank": 0, "choice": rule}])
    assert ex.config.offload.mode is OffloadMode.RANK_LOCAL and ex.config.choice == rule
    assert ex.status()["offload_mode"]["source"] == "rule"
    ex._take_rank_choice([{"choice": ModeChoice(OffloadMode.ALLGATHER, "later")}])  # resolved: kept
    assert ex.config.choice == rule


def test_the_choice_is_allgather_or_rank_local_only() -> None:
    with pytest.raises(ValueError, match="allgather or rank-local"):
        ModeChoice(OffloadMode.RESIDENT, "no")
    assert ModeChoice("allgather", "x").mode is OffloadMode.ALLGATHER


def test_the_transport_comes_from_the_config() -> None:
    from service.engine.local import LocalExecutor
    from service.router.build import make_executor

    local = EngineConfig("unused", parallel=ParallelConfig(executor="local"))
    assert isinstance(make_executor(local), LocalExecutor)
