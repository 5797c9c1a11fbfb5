"""The settings object and the shared flags: one declaration, one check order, errors that
name the flag, the same result from the CLI and from a Serve config mapping."""

from __future__ import annotations

import argparse

import pytest

from service.models.flux import FluxAdapter
from service.models.options import (
    FlagError,
    Mode,
    OffloadSettings,
    add_offload_arguments,
    parse_probe_size,
    settings_from_args,
)
from service.models.wan import WanAdapter


def parse(*argv: str, offload_default: bool = False) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_offload_arguments(p, offload_default=offload_default)
    p.add_argument("--scheduler", default="continuous")
    return p.parse_args(list(argv))


def test_flags_become_one_settings_object_that_round_trips_through_a_config_mapping() -> None:
    s = settings_from_args(parse("--enable-distributed-layerwise-offload", "--dlo-mode", "rank-local",
                                 "--dlo-device-memory-gb", "40", "--dlo-components", "text_encoder,dit",
                                 "--dlo-probe-size", "1024x1024x1", "--dtype", "bfloat16"))
    assert s == OffloadSettings(Mode.RANK_LOCAL, device_memory_gb=40.0, components=("dit", "text_encoder"),
                                probe_shape=(1024, 1024, 1), dtype="bfloat16")
    assert not s.use_allgather and s.enabled and s.probed
    assert OffloadSettings.from_dict(s.as_dict()) == s
    assert settings_from_args(parse()).mode is Mode.RESIDENT
    assert settings_from_args(parse("--enable-distributed-layerwise-offload")).mode is Mode.AUTO  # default
    sp = parse("--enable-distributed-layerwise-offload", "--sequence-parallel-size", "2")
    assert settings_from_args(sp).mode is Mode.ALLGATHER  # an SP group always gathers
    assert settings_from_args(parse("--enable-distributed-layerwise-offload", "--dlo-no-use-allgather")) \
        == OffloadSettings(Mode.RANK_LOCAL)
    # the batch job: offload on unless --no-offload
    assert settings_from_args(parse(offload_default=True)).mode is Mode.AUTO
    assert settings_from_args(parse("--no-offload", offload_default=True)).mode is Mode.RESIDENT


def test_auto_resolves_once_and_is_not_usable_before() -> None:
    s = settings_from_args(parse("--enable-distributed-layerwise-offload", "--dlo-mode", "auto"))
    with pytest.raises(ValueError, match="not resolved"):
        _ = s.use_allgather
    assert s.resolved(Mode.ALLGATHER).use_allgather and s.resolved(Mode.RANK_LOCAL).mode is Mode.RANK_LOCAL
    with pytest.raises(ValueError):
        s.resolved(Mode.RESIDENT)


@pytest.mark.parametrize(("argv", "message"), [
    (["--dlo-resident-layers", "-1"], "--dlo-resident-layers must be >= 0"),
    (["--dlo-resident-layers", "2", "--dlo-device-memory-gb", "9"], "not both"),
    (["--dlo-no-use-allgather", "--dlo-mode", "auto"], "contradicts --dlo-mode auto"),
    (["--dlo-probe-size", "0x480x81"], "--dlo-probe-size must be WIDTHxHEIGHTxFRAMES"),
    (["--dlo-components", "vae"], "must include 'dit'"),
    (["--data-parallel-size", "0"], "--data-parallel-size must be >= 1"),
    (["--sequence-parallel-size", "2", "--dlo-no-use-allgather"], "gathers each block over the SP group"),
    (["--sequence-parallel-size", "2", "--dlo-resident-layers", "2"], "--dlo-resident-layers: not yet with"),
    (["--sequence-parallel-size", "2", "--cfg-batch", "on"], "--cfg-batch on: not yet with"),
    (["--sequence-parallel-size", "2", "--compile", "on"], "--compile on: not yet with"),
])
def test_bad_values_name_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(FlagError, match=message):
        settings_from_args(parse("--enable-distributed-layerwise-offload", *argv))


@pytest.mark.parametrize("argv", [["--dlo-resident-layers", "2"], ["--dlo-mode", "auto"],
                                  ["--dlo-no-use-allgather"], ["--dlo-components", "dit,vae"]])
def test_offload_flags_without_offload_are_refused(argv: list[str]) -> None:
    with pytest.raises(FlagError, match="needs --enable-distributed-layerwise-offload"):
        settings_from_args(parse(*argv))


def test_a_config_mapping_is_checked_as_strictly_as_the_flags() -> None:
    with pytest.raises(FlagError, match="unknown setting"):
        OffloadSettings.from_dict({"mode": "allgather", "use_allgather": True})
    with pytest.raises(FlagError, match="needs --enable"):
        OffloadSettings.from_dict({"mode": "resident", "resident_layers": 3})


def test_probe_support_per_family() -> None:
    assert parse_probe_size("832x480x81") == (480, 832, 81)
    auto = OffloadSettings(Mode.AUTO)
    budget = OffloadSettings(Mode.ALLGATHER, device_memory_gb=30.0)
    assert auto.probe_problem(WanAdapter, "cuda") is None
    assert auto.probe_problem(FluxAdapter, "cuda") is None  # auto without a probe: AllGather
    assert budget.probe_problem(FluxAdapter, "cpu") is None  # no probe on CPU
    assert "--dlo-device-memory-gb" in budget.probe_problem(FluxAdapter, "cuda")


def test_cfg_batch_and_compile_switches() -> None:
    """auto: on CUDA, off on CPU (CPU frames stay bitwise diffusers'); on/off whatever the
    device; a bad value names the flag, from the CLI and from a config mapping alike."""
    auto = settings_from_args(parse())
    assert (auto.cfg_batch, auto.compile) == ("auto", "auto")
    assert auto.cfg_batching("cuda") and not auto.cfg_batching("cpu")
    assert auto.compiling("cuda") and not auto.compiling("cpu")
    on = settings_from_args(parse("--cfg-batch", "on", "--compile", "on"))
    assert on.cfg_batching("cpu") and on.compiling("cpu")
    off = OffloadSettings.from_dict({"cfg_batch": "off", "compile": "off"})
    assert not off.cfg_batching("cuda") and not off.compiling("cuda")
    assert OffloadSettings.from_dict(on.as_dict()) == on
    with pytest.raises(FlagError, match=r"--cfg-batch must be one of \['auto', 'on', 'off'\], got 'yes'"):
        OffloadSettings.from_dict({"cfg_batch": "yes"})
    with pytest.raises(FlagError, match="--compile must be one of"):
        OffloadSettings(compile=True)  # type: ignore[arg-type]
    with pytest.raises(SystemExit):
        parse("--cfg-batch", "sometimes")
